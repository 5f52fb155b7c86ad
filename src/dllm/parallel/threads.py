"""CPU threads per process: torch's intra-op pool and OpenMP's, set from `training.threads`,
`dllm launch --threads` and `dllm serve --threads`.

torch gives every process one intra-op thread per core. Several worker processes on one machine, or a
machine that other jobs keep busy, then run more busy threads than there are cores: an op's threads
wait for each other at every barrier while the scheduler runs someone else, and a CPU step gets many
times slower than with fewer threads. So the count is a setting with a rule for `auto`:

  auto = OMP_NUM_THREADS when the environment sets it (the variable torch and OpenMP read themselves),
         else the cores this process may run on (its CPU affinity) divided by the worker processes on
         this node, at least 1 (one process: every core; `dllm serve`: one process).

The launcher resolves the count once and hands it to every worker it starts as OMP_NUM_THREADS (torchrun
would otherwise set 1 for several workers); each worker and `dllm serve` also call torch.set_num_threads
with it. On a machine shared with other jobs, 1 thread per process is often fastest: `dllm doctor`
warns when the load average is far above the core count.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dllm.errors import ConfigError

THREADS_ENV = "OMP_NUM_THREADS"
BUSY_LOAD_RATIO = 1.5
"""`busy_warning` speaks when the 1-minute load average exceeds this many times the core count."""


def usable_cores() -> int:
    """CPUs this process may run on (taskset and container cpusets included)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def parse_threads(value: str, option: str) -> int | str:
    """A --threads value: `auto` or a positive integer; anything else is a one-line ConfigError."""
    if value == "auto":
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ConfigError(f"{option}: expected a positive number of threads or auto, got {value!r}")


def resolve_threads(setting: int | str, procs_per_node: int, env: Mapping[str, str]) -> int:
    """Threads per process: `setting` itself, or for `auto` the rule of this module's docstring."""
    if setting != "auto":
        return int(setting)
    given = env.get(THREADS_ENV, "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, usable_cores() // max(1, procs_per_node))


def use_threads(num_threads: int) -> None:
    """This process's intra-op threads (torch, and the OpenMP pool it runs them on)."""
    import torch

    torch.set_num_threads(num_threads)


def threads_env(env: Mapping[str, str], num_threads: int) -> dict[str, str]:
    """`env` for a worker process that runs `num_threads` threads (read by torch and OpenMP at start)."""
    return {**env, THREADS_ENV: str(num_threads)}


def busy_warning(load_1min: float, cores: int) -> str | None:
    """A warning when the machine runs far more work than it has cores (the 1-minute load average)."""
    if load_1min <= BUSY_LOAD_RATIO * cores:
        return None
    return (
        f"the load average ({load_1min:.1f}) is far above the {cores} cores: other jobs share this machine, and "
        "a process with one thread per core waits on them at every step; train with `dllm launch --threads 1` "
        "(training.threads) and serve with `dllm serve --threads 1`, or run when the machine is quieter"
    )
