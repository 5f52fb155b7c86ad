"""Packing of prompt/completion records at the same budget: `split` (rows cut wherever a row ends),
`whole` (the default for these records: each record in one row, best fit) and `indexed` (one record
per row), scored on held-out prompts.

The task is generated here (not the demo's): "sort 7 3 9 =" -> " 3 7 9", "reverse 7 3 9 =" -> " 9 3 7",
2 to 6 digits: records of 15-34 byte tokens, padded with supervised EOS to a multiple of 16 as the
`dllm init` template does (16, 32 or 48 tokens), so many do not fit what is left of a 64-token row.
Completion-only supervision, the template's model and objective (demo preset, mdlm, its optimizer).
The eval prompts are drawn first and no training record has one of them: checked on the records and,
for each variant, in its prepared artifact (evaluation/overlap.py), and reported as `held_out`.

Every variant trains the same steps x rows x seq_len tokens from the same seed, in this one process,
then decodes the held-out prompts (one token per step, the most confident first). Length accuracy: the
answer up to the first EOS has as many digits as the prompt; exact: it is the answer. At this budget
the model has learnt lengths, not yet sorting: exact accuracy stays near 0.

    python bench/packing.py [--steps 600] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.config.sampler import SamplerConfig
from dllm.config.spec import RunSpec
from dllm.data.artifact import open_artifact
from dllm.data.prepare import prepare
from dllm.evaluation.overlap import found_in_artifact
from dllm.evaluation.tasks import Example
from dllm.inference.assembly import setup_sampling
from dllm.inference.engine import generate
from dllm.tokenization import ByteTokenizer
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir

SEQ_LEN = 64
VARIANTS: dict[str, dict[str, Any]] = {
    "split": {"layout": "packed", "packing": "split"},
    "whole": {"layout": "packed"},  # packing auto: whole for prompt/completion records
    "indexed": {"layout": "indexed"},
}


MIN_DIGITS = 2
MAX_DIGITS = 6


def example(rng: random.Random) -> Example:
    digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
    op = rng.choice(["sort", "reverse"])
    answer = sorted(digits) if op == "sort" else digits[::-1]
    return Example(f"{op} {' '.join(digits)} =", " " + " ".join(answer))


def task(num_train: int, num_eval: int, seed: int) -> tuple[list[Example], list[Example]]:
    """Distinct eval prompts first; training examples never repeat one of them."""
    rng = random.Random(seed)
    evals: dict[str, Example] = {}
    while len(evals) < num_eval:
        ex = example(rng)
        evals.setdefault(ex.prompt, ex)
    train = []
    while len(train) < num_train:
        ex = example(rng)
        if ex.prompt not in evals:
            train.append(ex)
    return train, list(evals.values())


def prepared(root: Path, name: str, layout: dict[str, Any], pad_to_multiple: int | None) -> dict[str, Any]:
    values = {
        "tokenizer": {"kind": "byte"},
        "sources": [{"path": "train.jsonl", "format": "prompt_completion", "supervision": "completion_only"}],
        "output": f"data-{name}",
        "seq_len": SEQ_LEN,
        "pad_to_multiple": pad_to_multiple,
        **layout,
    }
    return prepare(validate_config(PrepareSpec, values, source="bench", base_dir=root), root)


def train(root: Path, name: str, args: argparse.Namespace) -> float:
    values = {
        "run": {"name": name, "output_dir": str(root / "runs")},
        "model": {"preset": args.preset},
        "tokenizer": {"kind": "byte"},
        "data": {"path": str(root / f"data-{name}"), "seq_len": SEQ_LEN},
        "objective": {"name": "mdlm", "schedule": "linear", "eps": 0.001, "antithetic": True},
        "training": {"steps": args.steps, "global_batch_size": args.batch, "micro_batch_size": args.batch,
                     "seed": 0, "device": "cpu", "threads": args.threads},
        "optimizer": {"name": "adamw", "lr": 5e-3, "weight_decay": 0.1},
        "scheduler": {"name": "cosine", "warmup_steps": 30, "min_lr_ratio": 0.05},
        "checkpointing": {"save_final": True},
        "logging": {"progress": "off", "tensorboard": "off", "every_steps": args.steps},
    }  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=root))
    t0 = time.perf_counter()
    trainer = build_trainer(spec, prepare_run_dir(spec))
    losses = trainer.fit()
    trainer.metrics.close()
    print(f"{name}: {args.steps} steps in {time.perf_counter() - t0:.0f}s, last loss {losses[-1]:.3f}", file=sys.stderr)
    return losses[-1]


def score(root: Path, name: str, evals: list[Example]) -> dict[str, Any]:
    cfg = SamplerConfig(gen_length=32, block_length=32, steps=32, policy="low_confidence")
    s = setup_sampling(cfg, torch.device("cpu"), run=root / "runs" / name)
    tok = s.loaded.tokenizer
    result = generate(s.loaded.model, [tok.encode(e.prompt) for e in evals], s.sampler, s.special,
                      generator=torch.Generator().manual_seed(0))  # fmt: skip
    right_length = exact = 0
    for ex, ids in zip(evals, result.sequences, strict=True):
        ids = ids[: ids.index(tok.eos_id)] if tok.eos_id in ids else ids
        out = tok.decode(ids)
        right_length += len(out.split()) == len(ex.answer.split())
        exact += out == ex.answer
    n = len(evals)
    return {"length_accuracy": round(right_length / n, 4), "exact_accuracy": round(exact / n, 4)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32, help="rows of 64 tokens per step (every variant)")
    ap.add_argument("--preset", default="demo")
    ap.add_argument("--num-train", type=int, default=8000)
    ap.add_argument("--num-eval", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="training.threads (and this process's)")
    ap.add_argument("--pad-to-multiple", type=int, default=16, help="supervised EOS fill, as `dllm init` writes it")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    train_set, evals = task(args.num_train, args.num_eval, seed=0)
    eval_prompts = {e.prompt for e in evals}
    out: dict[str, Any] = {"bench": "packing", "task": f"sort/reverse {MIN_DIGITS}-{MAX_DIGITS} digits",
                           "seq_len": SEQ_LEN,
                           "steps": args.steps, "rows_per_step": args.batch, "preset": args.preset,
                           "threads": args.threads, "pad_to_multiple": args.pad_to_multiple,
                           "train_records": len(train_set)}  # fmt: skip
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lines = [json.dumps({"prompt": e.prompt, "completion": e.answer}) + "\n" for e in train_set]
        (root / "train.jsonl").write_text("".join(lines))
        held_out = {"eval_prompts": len(evals), "eval_prompts_in_training_records": 0, "found_in_artifacts": 0}
        held_out["eval_prompts_in_training_records"] = sum(e.prompt in eval_prompts for e in train_set)
        for name, layout in VARIANTS.items():
            m = prepared(root, name, layout, args.pad_to_multiple)
            held_out["found_in_artifacts"] += sum(found_in_artifact(open_artifact(root / f"data-{name}"),
                                                                    ByteTokenizer(), evals))  # fmt: skip
            st = m["stats"]
            row = {"packing": m.get("packing"), "rows": m["num_sequences"],
                   "records_per_row": round(st["documents"] / m["num_sequences"], 3),
                   "split_across_rows": st["split_across_rows"],
                   "split_share": round(st["split_across_rows"] / st["documents"], 4),
                   "supervised_split_share": round(st["split_supervised_tokens"] / st["supervised_tokens"], 4),
                   "padding_share": round(st["padding_tokens"] / (m["num_sequences"] * SEQ_LEN), 4)}  # fmt: skip
            row["final_loss"] = round(train(root, name, args), 4)
            row.update(score(root, name, evals))
            out[name] = row
    out["held_out"] = held_out
    if held_out["eval_prompts_in_training_records"] or held_out["found_in_artifacts"]:
        raise SystemExit(f"bench/packing.py: an eval example is in the training data: {held_out}")
    out["whole_minus_indexed_length_accuracy"] = round(
        out["whole"]["length_accuracy"] - out["indexed"]["length_accuracy"], 4
    )
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
