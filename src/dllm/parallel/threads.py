"""CPU threads per process: torch's intra-op pool and OpenMP's, set from `training.threads`,
`dllm launch --threads` and the `--threads` of every command that runs a model (generate, chat, eval
tasks and likelihood, convert, serve: `cli/common.py: THREADS_OPTION`).

torch gives every process one intra-op thread per core. Several worker processes on one machine, or a
machine that other jobs keep busy, then run more busy threads than there are cores: an op's threads
wait for each other at every barrier while the scheduler runs someone else, and a CPU step gets many
times slower than with fewer threads. So the count is a setting with a rule for `auto`:

  auto = OMP_NUM_THREADS when the environment sets it (the variable torch and OpenMP read themselves),
         else the free cores divided by the worker processes on this node, at least 1, where the free
         cores are the fewer of the cores this process may run on (its CPU affinity) and the machine's
         cores less those other work keeps busy: the 1-minute load average's whole part (load 1.9 on 2
         cores leaves 1 free, load 0.5 leaves 2), or fewer when fewer other tasks are runnable right now
         (/proc/stat's procs_running less this process's own running threads, the median of a few reads:
         the load average still counts, for a minute, the `data prepare` that just ended). One process on
         an idle machine: every core.

The load counts because an op's threads meet at a barrier after every step: one of them descheduled for
another job stalls the rest (one SDPA call for a single query over 130 keys, on 2 cores at a load just
above 2: 7.9 ms with 2 threads, 0.025 ms with 1). The launcher resolves the count once and hands it to
every worker it starts as OMP_NUM_THREADS (torchrun would otherwise set 1 for several workers); each
worker and every decoding command also call torch.set_num_threads with it. `dllm launch` warns when the
load is above the cores, and `dllm doctor` when it is far above them.
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


def machine_cores() -> int:
    """CPUs of the whole machine: those the load average counts."""
    return max(1, os.cpu_count() or usable_cores())


def load_average() -> float:
    """The 1-minute load average (runnable tasks, whole machine); 0 where the OS does not report one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _runnable_others() -> int | None:
    """Runnable tasks on the machine now that are not this process's threads (Linux's /proc); None elsewhere."""
    from pathlib import Path

    try:
        stat = Path("/proc/stat").read_text()
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return None
    running = next((int(line.split()[1]) for line in stat.splitlines() if line.startswith("procs_running ")), None)
    if running is None:
        return None
    own = 0
    for task in tasks:
        try:
            own += (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(0, running - own)


def running_now(reads: int = 5, interval_s: float = 0.02) -> int | None:
    """Other tasks runnable right now: the median of `reads` reads `interval_s` apart; None where unknown."""
    import statistics
    import time

    counts = []
    for i in range(reads):
        if i:
            time.sleep(interval_s)
        count = _runnable_others()
        if count is None:
            return None
        counts.append(count)
    return int(statistics.median(counts))


def busy_cores(load_1min: float, running: int | None) -> float:
    """The cores other work keeps busy: the load average, or fewer when fewer tasks are runnable right now."""
    return load_1min if running is None else min(load_1min, float(running))


def free_cores(load_1min: float, running: int | None = None) -> int:
    """Cores this process may use that other work leaves idle (the module's rule), at least 1."""
    return max(1, min(usable_cores(), machine_cores() - int(busy_cores(load_1min, running))))


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
    return max(1, free_cores(load_average(), running_now()) // max(1, procs_per_node))


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


def launch_load_warning(load_1min: float, cores: int, num_threads: int, running: int | None = None) -> str | None:
    """`dllm launch`'s one line when other work keeps more than the machine's cores busy (`busy_cores`: the
    1-minute load average, unless fewer tasks are runnable now) before CPU training."""
    if busy_cores(load_1min, running) <= cores:
        return None
    return (
        f"the load average ({load_1min:.1f}) is above the {cores} cores: other jobs are running and each CPU "
        f"training step waits on them ({num_threads} thread(s) per process now); wait for a quieter machine, "
        "or launch with --threads 1"
    )
