"""Activation checkpointing (training.activation_checkpointing): activation memory a training forward
keeps for its backward, and the forward+backward time, for none / selective / full.

Memory: `parallel.checkpointing.saved_activation_bytes` (distinct storages the forward made that are
still referenced when the loss is returned; parameters excluded). Time: the three modes are stepped
interleaved (none, selective, full once per round) and each ratio to `none` is the median over rounds
of the ratio within a round (the VM's load drifts between rounds, not within one).
Random tokens, one micro-batch, fp32 on this machine's CPU (or GPU with --device cuda).

    python bench/activation_checkpointing.py [--preset small] [--seq-len 128] [--batch 4] [--rounds 7] [--moe]

(--moe adds an MDLM case on the same preset with 8 experts, top 2: ~4 minutes more on 2 CPU cores.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.checkpointing import MODES, apply_activation_checkpointing, saved_activation_bytes
from dllm.training.trainer import run_model

V = 320
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)


def _objective(name: str):
    return MDLMObjective(MDLMConfig(), IDS) if name == "mdlm" else BD3LMObjective(BD3LMConfig(block_size=16), IDS)


def _models(preset: str, moe: bool, device: torch.device) -> dict[str, Transformer]:
    extra = {"family": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2} if moe else {}
    cfg = ModelConfig(preset=preset, vocab_size=V, **extra)
    out = {}
    for mode in MODES:
        model = Transformer(cfg)
        model.init_weights(torch.Generator().manual_seed(0))
        out[mode] = apply_activation_checkpointing(model.to(device), mode)
    return out


def _loss(model, obj, inputs) -> torch.Tensor:
    return obj.loss(run_model(model, inputs), inputs).loss_sum


def _step_s(model, obj, inputs, device: torch.device) -> float:
    start = time.perf_counter()
    _loss(model, obj, inputs).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def bench_case(objective: str, moe: bool, args, device: torch.device) -> dict:
    obj = _objective(objective)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V - 3, (args.batch, args.seq_len), generator=g)
    batch = Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), torch.arange(args.batch), None)
    inputs = obj.prepare(batch, NoiseKeys(0, args.batch))
    inputs = type(inputs)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(inputs).items()})
    models = _models(args.preset, moe, device)
    saved = {m: saved_activation_bytes(lambda m=m: _loss(models[m], obj, inputs), exclude=models[m]) for m in MODES}
    for m in MODES:  # warm-up
        _step_s(models[m], obj, inputs, device)
    rounds = [{m: _step_s(models[m], obj, inputs, device) for m in MODES} for _ in range(args.rounds)]
    return {
        "saved_activation_bytes": saved,
        "saved_vs_none": {m: round(saved[m] / saved["none"], 3) for m in MODES},
        "step_s_median": {m: round(statistics.median(r[m] for r in rounds), 4) for m in MODES},
        "step_time_vs_none": {m: round(statistics.median(r[m] / r["none"] for r in rounds), 3) for m in MODES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--moe", action="store_true", help="also an MoE model (8 experts, top 2)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    result = {"bench": "activation_checkpointing", "preset": args.preset, "seq_len": args.seq_len, "batch": args.batch}
    result["device"] = device.type
    result["threads"] = torch.get_num_threads()
    for objective, moe in (("mdlm", False), ("bd3lm", False), *((("mdlm", True),) if args.moe else ())):
        result[f"{objective}{'-moe' if moe else ''}"] = bench_case(objective, moe, args, device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
