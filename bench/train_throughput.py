"""Training throughput of the demo model at seq_len 128 and 512, eager and compiled (`training.compile`,
one torch.compile per block), and where a step's time goes.

All four variants are built in this one process and measured interleaved (A B C D A B ...) so that
machine jitter hits them alike; the JSON line reports medians, the time shares, the 512/128 ratio,
each compiled variant's compile time (its first step's forward + backward) and compiled/eager tokens/s.
TARGET_SPEEDUP is the compiled/eager speedup asked for at seq 512; the line says whether this machine
reached it, and what this CPU allows at most: compile fuses the elementwise work, norms, RoPE and the
optimizer's small ops, but a compiled graph calls the same matmul and flash-attention kernels as eager.
The bench records those calls of one eager seq-512 step (shapes, from the profiler), replays them alone
on random inputs without the profiler, interleaved with the measured steps, and reports eager step
time / replay time as the ceiling of any compiled speedup here.

    python bench/train_throughput.py [--rounds 8] [--preset demo]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
TARGET_SPEEDUP = 1.3
"""Compiled / eager tokens/s wanted at seq 512."""


def make_trainer(root: Path, seq_len: int, preset: str, compile: bool = False):
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in demo_corpus(20000, seed=0)))
    prep = validate_config(
        PrepareSpec,
        {"sources": [{"path": "corpus.jsonl"}], "output": f"prepared-{seq_len}", "seq_len": seq_len},
        source="bench",
        base_dir=root,
    )
    if not (root / f"prepared-{seq_len}").exists():
        prepare(prep, root, overwrite=True)
    batch = TOKENS_PER_STEP // seq_len
    name = f"bench-{seq_len}" + ("-compiled" if compile else "")
    values = {
        "run": {"name": name, "output_dir": str(root / "runs")},
        "model": {"preset": preset},
        "data": {"path": str(root / f"prepared-{seq_len}"), "seq_len": seq_len},
        "training": {
            "steps": 10_000,
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "device": "cpu",
            "compile": compile,
        },  # fmt: skip
        "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=root))
    trainer = build_trainer(spec, root / "runs" / name)
    return trainer, spec


def one_step(trainer) -> dict[str, float]:
    t0 = time.perf_counter()
    batches = trainer.loader.next_step()
    data_s = time.perf_counter() - t0
    stats = trainer.train_step(batches)
    total = time.perf_counter() - t0
    return {"data": data_s, **stats.times_s, "total": total}


HEAVY_OPS = ("mm", "bmm", "addmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention_for_cpu_backward")  # fmt: skip
"""ATen ops compile cannot speed up on CPU (matmuls and the flash-attention kernel: already library calls;
inductor calls the same kernels from its graphs)."""


def heavy_calls(trainer) -> list[tuple[str, list[list[int]]]]:
    """The HEAVY_OPS calls of one eager step, in order, with their input shapes (one profiled step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        one_step(trainer)
    calls = []
    for event in prof.events():
        name = event.name.removeprefix("aten::")
        if name in HEAVY_OPS:
            calls.append((name, [list(s) for s in event.input_shapes]))
    return calls


def _replay(calls: list[tuple[str, list[list[int]]]]) -> float:
    """Runs every recorded call once on random inputs of its shapes (fp32); returns the seconds taken
    by the calls alone (inputs made beforehand)."""
    aten = torch.ops.aten
    prepared = []
    for name, shapes in calls:
        if name in ("mm", "bmm"):
            args = [torch.randn(s) for s in shapes[:2]]
            prepared.append((getattr(aten, name), args, {}))
        elif name in ("addmm", "baddbmm"):
            args = [torch.randn(s) for s in shapes[:3]]
            prepared.append((getattr(aten, name), args, {}))
        elif name == "_scaled_dot_product_flash_attention_for_cpu":
            q, k, v = (torch.randn(s) for s in shapes[:3])
            mask = torch.zeros(shapes[5]) if shapes[5] else None
            op = aten._scaled_dot_product_flash_attention_for_cpu
            prepared.append((op, [q, k, v, 0.0, False], {"attn_mask": mask}))
        else:  # the backward: grad_out, q, k, v, out, logsumexp, dropout, causal, mask, scale
            g, q, k, v, o = (torch.randn(s) for s in shapes[:5])
            lse = torch.randn(shapes[5])
            mask = torch.zeros(shapes[8]) if shapes[8] else None
            op = aten._scaled_dot_product_flash_attention_for_cpu_backward
            prepared.append((op, [g, q, k, v, o, lse, 0.0, False], {"attn_mask": mask}))
    t0 = time.perf_counter()
    for op, args, kwargs in prepared:
        op(*args, **kwargs)
    return time.perf_counter() - t0


def heavy_floor_s(calls: list[tuple[str, list[list[int]]]], repeats: int = 5) -> float:
    """The least time the step's matmuls and attention kernels take by themselves (min of `repeats`
    replays, no profiler attached): a compiled step cannot be shorter than this on the same CPU."""
    _replay(calls)  # warm the allocator and the kernels' thread pools
    return min(_replay(calls) for _ in range(repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--preset", default="demo")
    args = ap.parse_args()
    torch.manual_seed(0)
    # each seq_len its own static graph, as in two separate runs (not one dynamic-shape graph for both)
    torch._dynamo.config.automatic_dynamic_shapes = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys = [(L, c) for L in (128, 512) for c in (False, True)]
        variants = {k: make_trainer(root, k[0], args.preset, compile=k[1]) for k in keys}
        compile_s: dict[int, float] = {}
        for (L, compiled), (trainer, _) in variants.items():
            for i in range(args.warmup):
                first = one_step(trainer)
                if compiled and i == 0:
                    compile_s[L] = first["forward"] + first["backward"]
        calls = heavy_calls(variants[512, False][0])
        samples: dict[tuple[int, bool], list[dict[str, float]]] = {k: [] for k in variants}
        floors: list[float] = []
        for _ in range(args.rounds):
            for k, (trainer, _) in variants.items():
                samples[k].append(one_step(trainer))
            floors.append(heavy_floor_s(calls, repeats=1))  # interleaved too: the same load as the steps
        result: dict[str, Any] = {
            "bench": "train_throughput",
            "preset": args.preset,
            "device": "cpu",
            "threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2),  # other processes on these cores skew every number
            "tokens_per_step": TOKENS_PER_STEP,
        }
        for (L, compiled), (trainer, spec) in variants.items():
            model = unwrap(trainer.model)
            med = {k: statistics.median(s[k] for s in samples[L, compiled]) for k in samples[L, compiled][0]}
            parts = ("data", "forward", "backward", "optimizer")
            tps = TOKENS_PER_STEP / med["total"]
            flops = train_flops_per_token(spec.model, Layout(seq_len=L, row_len=L))
            result["params"] = model.num_params()
            entry = {
                "tokens_per_s": round(tps, 1),
                "step_s": round(med["total"], 4),
                "gflops_per_s": round(tps * flops / 1e9, 2),
                "share": {k: round(med[k] / med["total"], 3) for k in parts},
            }
            if compiled:
                entry["compile_s"] = round(compile_s[L], 2)
            result[f"seq{L}" + ("_compiled" if compiled else "")] = entry
            trainer.metrics.close()
        result["ratio_tokens_per_s_512_vs_128"] = round(
            result["seq512"]["tokens_per_s"] / result["seq128"]["tokens_per_s"], 3
        )
        for L in (128, 512):
            speedup = result[f"seq{L}_compiled"]["tokens_per_s"] / result[f"seq{L}"]["tokens_per_s"]
            result[f"speedup_compiled_vs_eager_seq{L}"] = round(speedup, 3)
        # the ceiling: eager step time over the time its heavy kernels need alone (medians of the same rounds)
        floor_s = statistics.median(floors)
        ceiling = result["seq512"]["step_s"] / floor_s
        result["seq512_heavy_kernels_s"] = round(floor_s, 4)
        result["seq512_heavy_share_of_eager"] = round(floor_s / result["seq512"]["step_s"], 3)
        result["speedup_ceiling_seq512"] = round(ceiling, 3)
        reached = result["speedup_compiled_vs_eager_seq512"] >= TARGET_SPEEDUP
        verdict = "reached" if reached else "not reached on this machine"
        if not reached:
            below = "below" if ceiling < TARGET_SPEEDUP else "above"
            verdict += (
                f" (the CPU ceiling, {ceiling:.2f}x: the eager step over its matmul and attention kernels"
                f" replayed alone, is {below})"
            )
        result["target_seq512"] = f">= {TARGET_SPEEDUP}x: {verdict}"
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
