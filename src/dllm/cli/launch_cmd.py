"""`dllm launch`: validate, write the run folder, then train in-process or under torchrun."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import typer

from dllm.cli.common import SetOption, info, out, warn
from dllm.cli.outputs import RUN, check_output_place
from dllm.config.loading import load_config
from dllm.config.spec import RunSpec
from dllm.training.host_memory import memory_retained


def launch(
    config: Path = typer.Option(..., "--config", "-c", help="train.yaml"),
    set_: list[str] = SetOption,
    nproc_per_node: int = typer.Option(None, "--nproc-per-node", min=1, help="Worker processes on this machine."),
    nnodes: int = typer.Option(None, "--nnodes", min=1, help="Machines taking part."),
    node_rank: int = typer.Option(None, "--node-rank", min=0, help="This machine's rank (multi-node)."),
    rdzv_endpoint: str = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT of the rendezvous (multi-node)."),
    threads: str = typer.Option(
        None, "--threads", help="CPU threads per worker process, or auto (training.threads; see dllm doctor)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and print the command, start nothing."),
) -> None:
    """Train: checks the config and world size before any worker starts."""
    from dllm.config.loading import dump_config
    from dllm.parallel.launch import check_nodes, format_command, worker_command
    from dllm.parallel.threads import parse_threads
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import CONFIG_NAME, config_digest, launching, resume_notes, run_dir_of
    from dllm.training.run_lock import lock_run_dir

    overrides = list(set_ or [])
    if nproc_per_node is not None:
        overrides.append(f"topology.nproc_per_node={nproc_per_node}")
    if nnodes is not None:
        overrides.append(f"topology.nnodes={nnodes}")
    if threads is not None:
        overrides.append(f"training.threads={parse_threads(threads, '--threads')}")
    spec = load_config(RunSpec, config, overrides)
    warnings = check_nodes(spec.topology.nnodes, node_rank, rdzv_endpoint)
    spec, more = resolve_run_spec(spec)
    for w in warnings + more:
        warn(w)
    topo = spec.topology
    node_rank = node_rank if node_rank is not None and topo.nnodes > 1 else 0
    check_output_place(run_dir_of(spec), f"{config}: run.output_dir", folder=True, own=RUN)
    spec_path = run_dir_of(spec) / CONFIG_NAME
    in_process = topo.world_size == 1
    worker_env, num_threads = _worker_env(spec)
    cmd = (
        ["python", "-m", "dllm.training.worker", str(spec_path)]
        if in_process
        else worker_command(spec_path, topo, rdzv_endpoint, node_rank, config_digest(dump_config(spec)))
    )
    if dry_run:
        _warn_when_busy(spec, num_threads)
        out(format_command(cmd))
        writer = "at launch" if node_rank == 0 else "by node rank 0 at its launch"
        info(f"dry run: config ok for {topo.world_size} process(es), {num_threads} CPU thread(s) each; {spec_path} "
             f"is written {writer}")  # fmt: skip
        return
    lock = lock_run_dir(run_dir_of(spec), node_rank)
    try:  # the lock is held until every worker has ended
        for note in resume_notes(spec) if node_rank == 0 else []:
            info(note)
        # node rank 0 writes the shared run folder; the workers of every node read its config.yaml
        with launching(spec) if node_rank == 0 else nullcontext(run_dir_of(spec)) as run_dir:
            info(f"run folder: {run_dir} ({num_threads} CPU thread(s) per process, training.threads)")
            _warn_when_busy(spec, num_threads)  # after every refusal: a refused launch says one line
            if in_process and _retains_memory(spec) and not memory_retained():
                info(
                    "note: training.cpu_allocator: retain takes effect in a process started with "
                    f"GLIBC_TUNABLES={worker_env['GLIBC_TUNABLES']} (`dllm launch` sets it for the workers it "
                    "starts; this one-process run trains here, with glibc's default)"
                )
            _train(run_dir, None if in_process else cmd, lock.fd, worker_env)
    except BaseException as e:
        # a refusal, a failed run or a stop (typer.Exit) has no worker left, so the file goes too; after
        # anything else torchrun, which inherits the lock, may still hold it
        lock.release(remove=isinstance(e, Exception))
        raise
    lock.release(remove=True)  # a normal end leaves no run.lock
    info(f"done: {run_dir} (next: dllm generate --run {run_dir})")


def _on_cpu(spec) -> bool:
    import torch

    device = spec.training.device
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def _retains_memory(spec) -> bool:
    """Whether the run trains on the CPU with training.cpu_allocator: retain (training/host_memory.py)."""
    return _on_cpu(spec) and spec.training.cpu_allocator == "retain"


def _warn_when_busy(spec, num_threads: int) -> None:
    """One line when a CPU run starts on a machine whose load is above its cores (parallel/threads.py)."""
    from dllm.parallel.threads import launch_load_warning, load_average, machine_cores, running_now

    if not _on_cpu(spec):
        return
    busy = launch_load_warning(load_average(), machine_cores(), num_threads, running_now())
    if busy is not None:
        warn(busy)


def _worker_env(spec) -> tuple[dict[str, str], int]:
    """The workers' environment and their CPU threads: OMP_NUM_THREADS (parallel/threads.py; a one-process
    run sets torch's threads itself, in training/build.py) and glibc's retain tunables."""
    import os

    from dllm.parallel.threads import resolve_threads, threads_env
    from dllm.training.host_memory import retaining_env

    env = retaining_env(os.environ) if _retains_memory(spec) else dict(os.environ)
    num_threads = resolve_threads(spec.training.threads, spec.topology.nproc_per_node, os.environ)
    return threads_env(env, num_threads), num_threads


def _train(run_dir: Path, torchrun_cmd: list[str] | None, lock_fd: int, env: dict[str, str]) -> None:
    """Train in this process, or under torchrun; SIGINT/SIGTERM end every worker, with a last word."""
    from dllm.parallel.launch import Stopped, format_command, run_command, stop_on_signals
    from dllm.training.run import train_from_run_dir

    try:
        with stop_on_signals():
            if torchrun_cmd is None:
                train_from_run_dir(run_dir)
                return
            info(format_command(torchrun_cmd))
            code = run_command(torchrun_cmd, keep_fds=(lock_fd,), env=env)
    except Stopped as stop:
        info(f"dllm: stopped by {stop.signal_name}: all training processes have ended; {_resume_hint(run_dir)}")
        raise typer.Exit(stop.exit_code) from None
    if code != 0:
        raise typer.Exit(code)


def _resume_hint(run_dir: Path) -> str:
    from dllm.checkpoint.manager import latest_checkpoint
    from dllm.errors import UserError

    try:
        latest = latest_checkpoint(run_dir / "checkpoints")
    except UserError:
        latest = None
    if latest is None:
        return "no checkpoint was published yet"
    return f"the same command resumes from {latest}"
