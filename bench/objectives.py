"""Training throughput of every objective on the same tiny model at seq_len 512, relative to mdlm,
and BD3LM's exact block-sparse attention (`blockwise`) against the dense 2L mask (`sdpa`) at L=1024.

All variants are built in this one process and stepped interleaved (A B C ... once per round). On
this shared VM the same step's wall time drifts by up to 1.7x with other tenants' load, so a ratio is
the median over rounds of the ratio within each round (the variants of one round run seconds apart,
under the same load); step times are medians, with each variant's fastest round next to them.
`uniform` does mdlm's work, so its ratio shows how far the remaining noise reaches. `fast_dllm_v2` runs
its two views over one clean stream (3L rows), `fast_dllm_v2_two_rows` as two 2L rows (the same loss).
Tokens/s counts data tokens (L per sequence) for every objective, so a ratio is the cost per token.
`page_faults_per_step` is the process's minor page faults during each objective's steps (median):
memory the C allocator gave back to the OS and the step faults in again (training.cpu_allocator;
`--cpu-allocator system` runs the whole bench with glibc's defaults, for comparison).

The demo corpus packs ~20-token documents and `data.document_mask` is on by default. BD3LM's CPU
attention (the split path, bd_split.py) leaves out the keys no query of a call may see (other
documents), while mdlm's document-masked attention is SDPA with a dense mask (every pair scored). So
the default ratio shows what a user of this data gets, not the 2L layout's own cost:
`cost_per_token_vs_mdlm_L512_no_document_mask` runs mdlm and bd3lm once more without document masks,
mdlm on SDPA's unmasked kernel, which is the comparison the 2L layout is judged by.

    python bench/objectives.py [--rounds 20] [--preset demo] [--cpu-allocator retain|system]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
from dllm.training.build import build_trainer
from dllm.training.host_memory import memory_retained, retaining_env
from dllm.training.preflight import resolve_run_spec

TOKENS_PER_STEP = 4096
OBJECTIVES: dict[str, dict[str, Any]] = {
    "mdlm": {"name": "mdlm"},
    "bd3lm": {"name": "bd3lm", "block_size": 16},
    "fast_dllm_v2": {"name": "fast_dllm_v2", "block_size": 16, "sub_block_size": 4},  # 3L rows: one clean stream
    "fast_dllm_v2_two_rows": {"name": "fast_dllm_v2", "block_size": 16, "sub_block_size": 4, "shared_clean": False},
    "uniform": {"name": "uniform"},
}


def artifact(root: Path, seq_len: int) -> Path:
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in demo_corpus(40000, seed=0)))
    values = {"sources": [{"path": "corpus.jsonl"}], "output": f"prepared-{seq_len}", "seq_len": seq_len}
    prepare(validate_config(PrepareSpec, values, source="bench", base_dir=root), root, overwrite=True)
    return root / f"prepared-{seq_len}"


def trainer(
    root: Path, name: str, objective: dict, seq_len: int, preset: str, backend: str, allocator: str, docs: bool = True
):
    batch = TOKENS_PER_STEP // seq_len
    values = {
        "run": {"name": name, "output_dir": str(root / "runs")},
        "model": {"preset": preset, "attention_backend": backend, "max_seq_len": seq_len},
        "data": {"path": str(root / f"prepared-{seq_len}"), "seq_len": seq_len, "document_mask": docs},
        "objective": objective,
        "training": {
            "steps": 10_000,
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "device": "cpu",
            "cpu_allocator": allocator,
        },
        "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=root))
    return build_trainer(spec, root / "runs" / name)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def step_seconds(tr) -> tuple[float, int]:
    """(wall seconds, minor page faults) of one training step."""
    f0, t0 = minor_faults(), time.perf_counter()
    tr.train_step(tr.loader.next_step())
    return time.perf_counter() - t0, minor_faults() - f0


def measure(variants: dict[str, Any], rounds: int, warmup: int) -> dict[str, list[tuple[float, int]]]:
    """(step seconds, minor page faults) of each variant in each round."""
    for tr in variants.values():
        for _ in range(warmup):
            step_seconds(tr)
    samples: dict[str, list[tuple[float, int]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, tr in variants.items():
            samples[k].append(step_seconds(tr))
    for tr in variants.values():
        tr.metrics.close()
    return samples


def seconds(samples: list[tuple[float, int]]) -> list[float]:
    return [s for s, _ in samples]


def paired_ratio(num: list[tuple[float, int]], den: list[tuple[float, int]]) -> float:
    """Median over rounds of num / den measured in the same round."""
    return statistics.median(a / b for a, b in zip(seconds(num), seconds(den), strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--backend", default="auto", help="attention backend of the throughput comparison")
    ap.add_argument("--cpu-allocator", default="retain", choices=["retain", "system"], help="training.cpu_allocator")
    args = ap.parse_args()
    if args.cpu_allocator == "retain" and not memory_retained():  # glibc reads its tunables at start
        os.execve(sys.executable, [sys.executable, *sys.argv], retaining_env(os.environ))
    torch.manual_seed(0)
    out: dict[str, Any] = {"bench": "objectives", "preset": args.preset, "device": "cpu",
                           "threads": torch.get_num_threads(), "tokens_per_step": TOKENS_PER_STEP,
                           "cpu_allocator": args.cpu_allocator}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        artifact(root, 512)
        alloc = args.cpu_allocator
        variants = {k: trainer(root, k, o, 512, args.preset, args.backend, alloc) for k, o in OBJECTIVES.items()}
        samples = measure(variants, args.rounds, args.warmup)
        out["L512"] = {
            k: {"step_s": round(statistics.median(seconds(v)), 4), "step_s_fastest": round(min(seconds(v)), 4),
                "tokens_per_s": round(TOKENS_PER_STEP / statistics.median(seconds(v)), 1),
                "page_faults_per_step": int(statistics.median(f for _, f in v))}
            for k, v in samples.items()
        }  # fmt: skip
        out["cost_per_token_vs_mdlm_L512"] = {k: round(paired_ratio(v, samples["mdlm"]), 3) for k, v in samples.items()}
        plain = {
            k: trainer(root, f"{k}-no-docs", OBJECTIVES[k], 512, args.preset, args.backend, alloc, docs=False)
            for k in ("mdlm", "bd3lm")
        }
        sp = measure(plain, args.rounds, args.warmup)
        out["L512_no_document_mask_step_s"] = {k: round(statistics.median(seconds(v)), 4) for k, v in sp.items()}
        out["cost_per_token_vs_mdlm_L512_no_document_mask"] = {
            k: round(paired_ratio(v, sp["mdlm"]), 3) for k, v in sp.items() if k != "mdlm"
        }
        artifact(root, 1024)
        bd = {
            b: trainer(root, f"bd3lm-{b}", OBJECTIVES["bd3lm"], 1024, args.preset, b, alloc)
            for b in ("sdpa", "blockwise")
        }
        sb = measure(bd, args.rounds, args.warmup)
        out["bd3lm_L1024_step_s"] = {k: round(statistics.median(seconds(v)), 4) for k, v in sb.items()}
        out["bd3lm_blockwise_speedup_vs_dense_L1024"] = round(paired_ratio(sb["sdpa"], sb["blockwise"]), 3)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
