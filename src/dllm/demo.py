"""`make demo`: init -> prepare -> train -> generate in a fresh folder, through the real CLI.

It ends by printing generations for arithmetic prompts and how many answers are right. The prompts are
sums of the built-in addition task's eval split, which `dllm init`'s data never contains: the count is
a held-out accuracy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dllm.cli.main import main as dllm
from dllm.data.synthetic import first_int, held_out_sums, parse_sum_prompt

GENERATE = ["--gen-length", "8", "--block-length", "8", "--steps", "8"]
SERVE = ["--set", "gen_length=8", "--port", "8000"]  # then open http://127.0.0.1:8000/


@contextlib.contextmanager
def _cwd(folder: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


def _run(args: list[str], cwd: Path, capture: bool = False) -> str:
    """Run one dllm command as a user would type it; exit on failure."""
    print(f"\n$ dllm {' '.join(args)}", flush=True)
    buf = io.StringIO()
    with _cwd(cwd), contextlib.redirect_stdout(buf) if capture else contextlib.nullcontext():
        code = dllm(args)
    if code != 0:
        sys.exit(code)
    return buf.getvalue()


def _prompts(n: int, seed: int = 1234) -> list[str]:
    """n distinct sums of the addition task's eval split: `dllm init` never writes them, so they are held out."""
    pairs = random.Random(seed).sample(sorted(held_out_sums()), n)
    return [f"{a} + {b} =" for a, b in pairs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", type=Path, default=Path("demo-run"), help="Folder to (re)create for the demo.")
    ap.add_argument("--set", action="append", default=[], help="Extra training override, e.g. training.steps=100.")
    ap.add_argument("--num-prompts", type=int, default=20)
    args = ap.parse_args(argv)
    if not 1 <= args.num_prompts <= len(held_out_sums()):
        print(f"dllm: error: --num-prompts must lie in 1..{len(held_out_sums())} (the held-out sums)", file=sys.stderr)
        return 2
    folder = args.dir.absolute()
    if folder.exists():
        if not (folder / "train.yaml").is_file():
            print(
                f"dllm: error: {folder} exists and is not a demo folder; choose another --dir",
                file=sys.stderr,
            )
            return 2
        shutil.rmtree(folder)
    t0 = time.perf_counter()
    _run(["init", str(folder)], Path.cwd())
    print(f"\n$ cd {folder}")
    _run(["data", "prepare", "--config", "prepare.yaml"], folder)
    _run(["launch", "--config", "train.yaml", *[f"--set={s}" for s in args.set]], folder)
    prompts = _prompts(args.num_prompts)
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    gen = _run(
        ["generate", "--run", "runs/latest", "--prompts-file", "prompts.jsonl", *GENERATE, "--json"],
        folder,
        capture=True,
    )
    (folder / "generations.jsonl").write_text(gen)
    right = 0
    print("\nprompt        completion   expected")
    for line in gen.splitlines():
        rec = json.loads(line)
        expected = parse_sum_prompt(rec["prompt"])
        ok = first_int(rec["completion"]) == expected
        right += ok
        print(f"{rec['prompt']:<13} {rec['completion']!r:<12} {expected:<4} {'right' if ok else 'wrong'}")
    print(f"\narithmetic on held-out sums (none of them in the training data): {right}/{len(prompts)} answers right; "
          f"the whole demo took {time.perf_counter() - t0:.0f}s")  # fmt: skip
    print("what it means: a model of a few million parameters, trained for minutes on generated sentences and "
          "sums, adds numbers it never saw added, some of the time; more steps (--set training.steps=...) raise it, "
          "and `dllm eval tasks` scores 200 of them with its cost in forwards")  # fmt: skip
    print("next:")
    print(f"  try it:   cd {args.dir} && dllm generate --run runs/latest --prompt '12 + 7 =' {' '.join(GENERATE)}")
    print(f"  score it: cd {args.dir} && dllm eval tasks --run runs/latest --tasks addition --limit 200")
    # the last line: the one command that serves this model (OpenAI API on /v1, the live denoising page on /)
    print(f"  serve it: cd {args.dir} && dllm serve --run runs/latest {' '.join(SERVE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
