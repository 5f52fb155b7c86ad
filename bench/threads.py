"""CPU threads per process on this machine as it is now: a training step and a sampling call of the
demo model with 1 thread against `auto` (every usable core), interleaved in this one process.

On a machine other jobs keep busy (a load average above the core count), a process with one thread
per core waits for its slowest thread at every op while the scheduler runs someone else's; one thread
does not wait. On a quiet machine `auto` is the faster one. The load average before and after is part
of the result: the ratios mean nothing without it.

    python bench/threads.py [--rounds 8]
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dllm.config.sampler import SamplerConfig, resolve_sampler  # noqa: E402
from dllm.inference.engine import generate  # noqa: E402
from dllm.parallel.threads import resolve_threads, usable_cores  # noqa: E402
from dllm.sampling.canvas import SpecialIds  # noqa: E402
from objectives import artifact, trainer  # noqa: E402  (the objectives bench's artifact and trainer)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    auto = resolve_threads("auto", 1, {})  # every usable core: what a one-process run gets without OMP_NUM_THREADS
    out = {"bench": "threads", "usable_cores": usable_cores(), "auto": auto, "load_average_before": load()}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        artifact(root, 64)
        tr = trainer(root, "mdlm", {"name": "mdlm"}, 64, "demo", "auto", "system")
        profile = tr.checkpoints.profile
        sampler = resolve_sampler(SamplerConfig(gen_length=32, block_length=32, steps=32), profile)
        special = SpecialIds.of(profile)
        prompts = [list(range(40, 56))] * 8
        steps = {1: [], auto: []}
        sampling = {1: [], auto: []}
        for _ in range(args.rounds):
            for n in (auto, 1):
                torch.set_num_threads(n)
                steps[n].append(timed(lambda: tr.train_step(tr.loader.next_step())))
                tr.model.eval()
                sampling[n].append(timed(lambda: generate(tr.model, prompts, sampler, special)))
                tr.model.train()
        tr.metrics.close()
    for what, samples in (("train_step_s", steps), ("generate_s", sampling)):
        out[what] = {f"threads_{n}": round(statistics.median(v), 4) for n, v in samples.items()}
        out[f"{what}_auto_over_1"] = round(
            statistics.median(a / b for a, b in zip(samples[auto], samples[1], strict=True)), 3
        )
    out["load_average_after"] = load()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
