"""Spread of the Monte Carlo likelihood bound against its cost, plain vs stratified time sampling.

Trains (or loads from --work) a small mdlm and a bd3lm model on the demo corpus, then estimates the
negative ELBO per token of the same held-out rows `--repeats` times with different seeds, for K
samples per row (K forward passes per row) in 1, 2, 4, ..., with independent times ("plain") and with
evenly spaced times ("stratified"). The standard error at each K is the spread of those repeated
estimates (measured, not the estimator's own formula). One JSON line: per model, per K, mean and
standard error of both samplers, and variance_reduction = var(plain) / var(stratified) at equal cost.

    python bench/eval_likelihood.py [--work /tmp/dllm-bench-likelihood] [--repeats 16] [--rows 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dllm.checkpoint.loading import load_for_inference
from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.data.artifact import open_artifact
from dllm.data.loader import StepLoader
from dllm.data.prepare import prepare
from dllm.data.synthetic import demo_corpus
from dllm.evaluation.likelihood import nelbo_samples, scoring_for, summarize
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir

SEQ_LEN = 64


def data(work: Path, name: str, records: int, seed: int) -> Path:
    if not (work / name / "manifest.json").is_file():
        (work / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in demo_corpus(records, seed=seed))
        )
        values = {"sources": [{"path": f"{name}.jsonl"}], "output": name, "seq_len": SEQ_LEN}
        prepare(validate_config(PrepareSpec, values, source="bench", base_dir=work), work, overwrite=True)
    return work / name


def train(work: Path, name: str, objective: dict, steps: int) -> Path:
    run = work / "runs" / name
    if (run / "checkpoints" / "latest").is_file():
        return run
    values = {
        "run": {"name": name, "output_dir": str(work / "runs")},
        "model": {"preset": "demo"},
        "data": {"path": str(work / "train"), "seq_len": SEQ_LEN},
        "objective": objective,
        "training": {"steps": steps, "global_batch_size": 32, "micro_batch_size": 32, "device": "cpu"},
        "optimizer": {"lr": 3e-3},
        "scheduler": {"warmup_steps": 20},
        "checkpointing": {"every_steps": steps, "keep_last_n": 1},
        "logging": {"progress": "off", "tensorboard": "off"},
    }
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=work))
    t0 = time.perf_counter()
    train_from_run_dir(prepare_run_dir(spec))
    print(f"# trained {name}: {steps} steps in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/dllm-bench-likelihood"))
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--samples", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    data(work, "train", 20000, seed=0)
    held_out = data(work, "heldout", 400, seed=99)
    loader = StepLoader(open_artifact(held_out), global_batch_size=1, micro_batch_size=1, shuffle=False)
    batch = loader.read(np.arange(args.rows))
    out: dict = {"bench": "eval_likelihood", "rows": args.rows, "repeats": args.repeats, "seq_len": SEQ_LEN}
    for name, objective in (("mdlm", {"name": "mdlm"}), ("bd3lm", {"name": "bd3lm", "block_size": 16})):
        loaded = load_for_inference(run=train(work, name, objective, args.steps))
        how = scoring_for(loaded)
        per_k = {}
        for k in args.samples:
            row = {}
            for sampler in ("plain", "stratified"):
                estimates = []
                for r in range(args.repeats):
                    gen = torch.Generator().manual_seed(r)
                    anti = sampler == "stratified"
                    s = nelbo_samples(
                        loaded.model,
                        batch.tokens_BL,
                        batch.loss_mask_BL,
                        how,
                        num_samples=k,
                        antithetic=anti,
                        generator=gen,
                    )
                    estimates.append(summarize([s]).nelbo_per_token)
                row[sampler] = {"mean": round(statistics.mean(estimates), 4),
                                "stderr": round(statistics.stdev(estimates), 4)}  # fmt: skip
            row["forward_passes_per_row"] = k
            row["variance_reduction"] = round(
                (row["plain"]["stderr"] / max(row["stratified"]["stderr"], 1e-12)) ** 2, 2
            )
            per_k[f"K{k}"] = row
        out[name] = per_k
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
