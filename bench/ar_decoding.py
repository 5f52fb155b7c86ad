"""Decoding speed of a causal target: AR with the ragged KV cache vs full recomputation (the baseline
every speculative speedup is measured against), at batch 1 and batch 8.

The target is a random llama (default 4 layers, 256 wide, byte vocabulary), or with --family qwen3_5 a
random hybrid (three Gated DeltaNet layers to one attention layer, whose cache keeps the linear layers'
states per row): throughput does not depend on what the weights learned, and no EOS is set, so every row
generates --gen tokens. Each variant also reports its query tokens per generated token (positions run
through the model: the cache runs each prompt once and a token per round, recomputation every row again). Each
variant decodes the same prompts; rounds interleave the variants (A B A B ...) and each variant's
median wall time over --repeats rounds gives its tokens/s. One JSON line: per batch size, tokens/s of
every variant, target forwards per token, and the ratio of each variant to `ar_recompute`.

Variants are entries of VARIANTS: `(target, prompts, args) -> GenerationResult`, both the causal loop of
sampling/speculative.py without a drafter (with the ragged cache, or recomputing). Speculative decoding with
trained DFlash drafters against `ar_cache` is bench/speculative.py (it needs a trained target and
drafters; this one needs no training).

    python bench/ar_decoding.py [--family llama|qwen3_5] [--layers 4] [--width 256] [--prompt-len 32] [--gen 128]
                                [--repeats 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models import Transformer
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.results import GenerationResult

Variant = Callable[[torch.nn.Module, list[list[int]], argparse.Namespace], GenerationResult]
SPECIAL = SpecialIds(mask_id=319, pad_id=0, eos_id=0)  # no EOS (stop_at_eos off): every row runs --gen tokens


def greedy(args: argparse.Namespace) -> SamplerConfig:
    return SamplerConfig(generation="causal", gen_length=args.gen, stop_at_eos=False)


def ar_cache(target: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> GenerationResult:
    return generate(target, prompts, greedy(args), SPECIAL)


def ar_recompute(target: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> GenerationResult:
    return generate(target, prompts, greedy(args), SPECIAL, recompute=True)


VARIANTS: dict[str, Variant] = {"ar_cache": ar_cache, "ar_recompute": ar_recompute}
BASELINE = "ar_recompute"


def build_target(args: argparse.Namespace) -> torch.nn.Module:
    cfg = ModelConfig(family=args.family, vocab_size=320, num_layers=args.layers, hidden_size=args.width,
                      num_heads=max(args.width // 64, 1), num_kv_heads=max(args.width // 128, 1),
                      max_seq_len=args.prompt_len + args.gen + 64)  # fmt: skip
    model = Transformer(cfg).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    return model


def measure(target: torch.nn.Module, batch: int, args: argparse.Namespace) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 256, (args.prompt_len - (i % 4),), generator=g).tolist() for i in range(batch)]
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
    walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
    forwards: dict[str, float] = {}
    queries: dict[str, float] = {}
    sequences = []
    for name, fn in VARIANTS.items():  # warm-up (allocator, kernels), and the outputs agree
        result = fn(target, prompts, args)
        forwards[name] = result.counters.as_dict()["forwards_per_token"]
        queries[name] = result.counters.query_tokens / (batch * args.gen)
        sequences.append(result.sequences)
    for _ in range(args.repeats):
        for name, fn in VARIANTS.items():
            sync()
            t0 = time.perf_counter()
            result = fn(target, prompts, args)
            sync()
            walls[name].append(time.perf_counter() - t0)
            assert result.counters.tokens_committed == batch * args.gen, (name, result.counters.tokens_committed)
    out: dict[str, float] = {"tokens_equal": float(all(s == sequences[0] for s in sequences))}
    base = statistics.median(walls[BASELINE])
    for name in VARIANTS:
        wall = statistics.median(walls[name])
        out[f"{name}_tok_s"] = round(batch * args.gen / wall, 1)
        out[f"{name}_forwards_per_token"] = round(forwards[name], 4)
        out[f"{name}_query_tokens_per_token"] = round(queries[name], 3)
        out[f"{name}_speedup_vs_{BASELINE}"] = round(base / wall, 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "qwen3_5"], default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    target = build_target(args).to(args.device)
    with torch.inference_mode():
        result = {
            "bench": "speculative",
            "target": {
                "family": args.family,
                "layers": args.layers,
                "width": args.width,
                "params": target.num_params(),
            },
            "prompt_len": args.prompt_len,
            "gen": args.gen,
            "device": args.device,
            "threads": torch.get_num_threads(),
            **{f"batch_{b}": measure(target, b, args) for b in args.batches},
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
