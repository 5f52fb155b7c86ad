"""Training throughput of the demo model at seq_len 128 and 512, and where a step's time goes.

Both variants are built in this one process and measured interleaved (A B A B ...) so that machine
jitter hits both alike; the JSON line reports medians, the time shares, and the 512/128 ratio.

    python bench/train_throughput.py [--rounds 8] [--preset demo]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.data.prepare import prepare
from dllm.data.synthetic import demo_corpus
from dllm.models.flops import Layout, train_flops_per_token
from dllm.parallel.apply import unwrap
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec

TOKENS_PER_STEP = 4096


def make_trainer(root: Path, seq_len: int, preset: str):
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in demo_corpus(20000, seed=0)))
    prep = validate_config(
        PrepareSpec,
        {"sources": [{"path": "corpus.jsonl"}], "output": f"prepared-{seq_len}", "seq_len": seq_len},
        source="bench",
        base_dir=root,
    )
    prepare(prep, root, overwrite=True)
    batch = TOKENS_PER_STEP // seq_len
    values = {
        "run": {"name": f"bench-{seq_len}", "output_dir": str(root / "runs")},
        "model": {"preset": preset},
        "data": {"path": str(root / f"prepared-{seq_len}"), "seq_len": seq_len},
        "training": {"steps": 10_000, "global_batch_size": batch, "micro_batch_size": batch, "device": "cpu"},
        "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=root))
    trainer = build_trainer(spec, root / "runs" / f"bench-{seq_len}")
    return trainer, spec


def one_step(trainer) -> dict[str, float]:
    t0 = time.perf_counter()
    batches = trainer.loader.next_step()
    data_s = time.perf_counter() - t0
    stats = trainer.train_step(batches)
    total = time.perf_counter() - t0
    return {"data": data_s, **stats.times_s, "total": total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--preset", default="demo")
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        variants = {L: make_trainer(root, L, args.preset) for L in (128, 512)}
        for trainer, _ in variants.values():
            for _ in range(args.warmup):
                one_step(trainer)
        samples: dict[int, list[dict[str, float]]] = {L: [] for L in variants}
        for _ in range(args.rounds):
            for L, (trainer, _) in variants.items():
                samples[L].append(one_step(trainer))
        result: dict[str, object] = {
            "bench": "train_throughput",
            "preset": args.preset,
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "tokens_per_step": TOKENS_PER_STEP,
        }
        for L, (trainer, spec) in variants.items():
            model = unwrap(trainer.model)
            med = {k: statistics.median(s[k] for s in samples[L]) for k in samples[L][0]}
            parts = ("data", "forward", "backward", "optimizer")
            tps = TOKENS_PER_STEP / med["total"]
            flops = train_flops_per_token(spec.model, Layout(seq_len=L, row_len=L))
            result["params"] = model.num_params()
            result[f"seq{L}"] = {
                "tokens_per_s": round(tps, 1),
                "step_s": round(med["total"], 4),
                "gflops_per_s": round(tps * flops / 1e9, 2),
                "share": {k: round(med[k] / med["total"], 3) for k in parts},
            }
            trainer.metrics.close()
        result["ratio_tokens_per_s_512_vs_128"] = round(
            result["seq512"]["tokens_per_s"] / result["seq128"]["tokens_per_s"],
            3,  # type: ignore[index]
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
