"""An edit-flow run on the addition task, through `dllm eval tasks`: accuracy, NFE and edits per answer,
and the lengths of the answers it wrote against the reference lengths (Edit Flows choose the length).

Runs `dllm eval tasks --run RUN --tasks addition --limit N --json --output FILE [--set steps=S]` as a
subprocess (the same command a user types), then reads its per-example outputs. Lengths are in
characters of the answer after the task's cut (stop string, EOS) and stripping, which for the byte
tokenizer are tokens. NFE per answer is the sampler's forwards per call: every answer of a batch
sees each of them. Prints one JSON line.

    python bench/edit_flow_eval.py --run runs/editflow-smoke [--limit 200] [--steps 32]
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--steps", type=int, default=None, help="tau-leaping steps (default: the sampler's)")
    ap.add_argument("--batch-size", type=int, default=50)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp) / "outputs.jsonl"
        cmd = [sys.executable, "-m", "dllm.cli.main", "eval", "tasks", "--run", str(a.run), "--tasks", "addition"]
        cmd += ["--limit", str(a.limit), "--batch-size", str(a.batch_size), "--json", "--output", str(out_file)]
        if a.steps is not None:
            cmd += ["--set", f"steps={a.steps}"]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        summary = json.loads(res.stdout.strip().splitlines()[-1])
        rows = [json.loads(line) for line in out_file.read_text(encoding="utf-8").splitlines()]
    pairs = collections.Counter((len(r["answer"].strip()), len(r["output"].strip())) for r in rows)
    ref_lengths = sorted({k[0] for k in pairs})
    out_lengths = sorted({k[1] for k in pairs})
    print(json.dumps({
        "bench": "edit_flow_eval", "run": str(a.run), "examples": summary["examples"],
        "accuracy": summary["accuracy"], "nfe_per_answer": summary["nfe_per_call"],
        "edits_per_answer": summary["edits_per_answer"], "wall_s": summary["wall_s"],
        "reference_length_hist": dict(sorted(collections.Counter(len(r["answer"].strip()) for r in rows).items())),
        "output_length_hist": dict(sorted(collections.Counter(len(r["output"].strip()) for r in rows).items())),
        "length_right": sum(len(r["answer"].strip()) == len(r["output"].strip()) for r in rows) / len(rows),
        "reference_x_output_lengths": {f"{ref}->{o}": pairs[ref, o] for ref in ref_lengths for o in out_lengths
                                       if pairs[ref, o]},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
