"""Fast-dLLM v2's training layouts on the real model: both views over one clean stream ([x_t^1 ; x_t^2 ; x_0],
3L rows, `objective.shared_clean: true`) against a row [x_t^v ; x_0] per view (4L rows in all, false).

The two compute the same loss and gradient (tests/unit/test_objectives.py checks it on a tiny model); here
they run as the a2d-smollm2-fast-dllm-v2 recipe trains: SmolLM2-135M-Instruct (the converted import, or
--ar-model), seq_len 192, block 32, sub-block 8, 16 rows a step in micro-batches of 8, AdamW at the recipe's
rate, on the recipe's prepared data (--data) or, without it, a generated stand-in of the same shape
(instructions from data/instructions.py, answers of 20-130 words, prepared as the recipe prepares). Both
trainers are built in this process from the same weights and data order; rounds interleave them (A B, B A,
...), one optimizer step each, so both see the same batches and noise step for step. Reported: each
layout's step seconds (median and fastest) and loss per step, the largest loss difference between the two
at the same step (equal math; float summation order differs), and the step-time ratio (median over rounds
of the ratio within a round), with the projected time of the recipe's steps.

    python bench/fdv2_layout.py [--data PREPARED_DIR] [--ar-model DIR] [--model full|trunc] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_model, from a checkout

from tests import real_model as rm  # noqa: E402

RECIPE = {"seq_len": 192, "block_size": 32, "sub_block_size": 8, "global_batch_size": 16, "micro_batch_size": 8,
          "lr": 3.0e-5, "warmup_steps": 20, "steps": 110}  # fmt: skip


def stand_in_data(root: Path, ar_dir: Path, rows: int) -> Path:
    """Chat exchanges of the recipe's shape, prepared as the recipe prepares its own (assistant-only loss)."""
    from dllm.config.loading import validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare

    rng = random.Random(0)
    prompts = rm.instructions(rows, split="train")
    records = []
    for p in prompts:
        words = (p.split() * 40)[: rng.randint(20, 130)]
        chat = {
            "prompt": [{"role": "user", "content": p}],
            "completion": [{"role": "assistant", "content": " ".join(words)}],
        }
        records.append(json.dumps({"chat": chat}))
    (root / "train.jsonl").write_text("\n".join(records) + "\n")
    values = {"tokenizer": {"kind": "hf", "path": str(ar_dir)}, "output": "prepared", "seq_len": RECIPE["seq_len"],
              "layout": "indexed", "pad_to_multiple": 32, "append_eos": False,
              "sources": [{"path": "train.jsonl", "format": "prompt_completion", "prompt_field": "chat.prompt",
                           "completion_field": "chat.completion"}]}  # fmt: skip
    prepare(validate_config(PrepareSpec, values, source="bench", base_dir=root), root, overwrite=True)
    return root / "prepared"


def trainer(root: Path, name: str, ar_dir: Path, data: Path, shared: bool):
    from dllm.config.loading import validate_config
    from dllm.config.spec import RunSpec
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec

    r = RECIPE
    values = {
        "run": {"name": name, "output_dir": str(root / "runs")},
        "model": {"init_from": str(ar_dir)},
        "tokenizer": {"kind": "hf", "path": str(ar_dir)},
        "data": {"path": str(data), "seq_len": r["seq_len"]},
        "objective": {"name": "fast_dllm_v2", "block_size": r["block_size"], "sub_block_size": r["sub_block_size"],
                      "shared_clean": shared},
        "training": {"steps": r["steps"], "global_batch_size": r["global_batch_size"],
                     "micro_batch_size": r["micro_batch_size"], "device": "cpu"},
        "optimizer": {"lr": r["lr"]},
        "scheduler": {"warmup_steps": r["warmup_steps"]},
        "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=root))
    return build_trainer(spec, root / "runs" / name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a prepared artifact of the recipe (default: a generated stand-in)")
    ap.add_argument("--ar-model", type=Path, help="the AR original's folder (default: the cached import)")
    ap.add_argument("--model", choices=["full", "trunc"], default="full", help="the cached import to use")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="steps of each before timing (they count in the losses)")
    args = ap.parse_args()
    if args.ar_model is None and rm.missing() is not None:
        raise SystemExit(f"bench/fdv2_layout.py: {rm.missing()}")
    ar_dir = args.ar_model or rm.converted(args.model)
    load_before = os.getloadavg()
    out: dict = {"bench": "fdv2_layout", "ar": str(ar_dir), "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "recipe": RECIPE}  # fmt: skip
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = args.data or stand_in_data(root, ar_dir, 400)
        out["data"] = str(args.data) if args.data else "generated stand-in (400 exchanges)"
        names = {"shared_clean_3L": True, "two_rows_4L": False}
        trainers = {n: trainer(root, n, ar_dir, data, s) for n, s in names.items()}
        losses: dict[str, list[float]] = {n: [] for n in names}
        walls: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.warmup + args.rounds):
            order = list(names) if r % 2 == 0 else list(reversed(names))
            for n in order:
                tr = trainers[n]
                t0 = time.perf_counter()
                stats = tr.train_step(tr.loader.next_step())
                wall = time.perf_counter() - t0
                losses[n].append(round(stats.loss, 6))
                if r >= args.warmup:
                    walls[n].append(wall)
            times = ", ".join(f"{n} {walls[n][-1] if walls[n] else 0:.1f} s" for n in names)
            print(f"[fdv2_layout] round {r + 1}: {times}", file=sys.stderr, flush=True)
        for tr in trainers.values():
            tr.metrics.close()
    shared, two = walls["shared_clean_3L"], walls["two_rows_4L"]
    out["step_s"] = {
        n: {"median": round(statistics.median(w), 2), "fastest": round(min(w), 2)} for n, w in walls.items()
    }
    out["loss_per_step"] = losses
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(*losses.values(), strict=True))
    ratio = statistics.median(a / b for a, b in zip(shared, two, strict=True))
    out["step_time_shared_over_two_rows"] = round(ratio, 3)
    out["recipe_minutes"] = {n: round(RECIPE["steps"] * statistics.median(w) / 60, 1) for n, w in walls.items()}
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    out["load_average_before"] = [round(x, 2) for x in load_before]
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
