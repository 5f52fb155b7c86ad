"""`dllm doctor`: what this machine offers dllm (versions, devices, backends, optional packages);
with `--config`, what that run needs and whether this machine has it (exit 1 when something is missing)."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import typer

from dllm.cli.common import SetOption, out, warn


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def doctor(
    config: Path | None = typer.Option(None, "--config", "-c", help="Check what this training config needs."),
    overrides: list[str] | None = SetOption,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
) -> None:
    """Print versions, devices, distributed backends and optional features; with --config, check that
    this machine has what the run needs (exit 1 naming what is missing)."""
    rows = _machine_rows()
    busy = _busy_warning()
    if busy is not None:
        warn(busy)
    if config is None:
        if as_json:
            out(json.dumps({**dict(rows), "warnings": [busy] if busy else []}, indent=2))
            return
        _print_rows(rows)
        return
    _doctor_config(config, overrides or [], rows, as_json)


def _busy_warning() -> str | None:
    """Other jobs keep this machine busy (the 1-minute load average far above the cores): parallel/threads.py."""
    from dllm.parallel.threads import busy_warning, usable_cores

    if not hasattr(os, "getloadavg"):
        return None
    return busy_warning(os.getloadavg()[0], usable_cores())


def _thread_rows() -> list[tuple[str, str]]:
    """Cores, the threads `auto` gives one process (parallel/threads.py), and the load average."""
    from dllm.parallel.threads import THREADS_ENV, resolve_threads, usable_cores

    free = "the cores other work leaves free: load and tasks runnable now"
    why = f"{THREADS_ENV} is set" if THREADS_ENV in os.environ else free
    rows = [
        ("usable cores", str(usable_cores())),
        ("threads (auto)", f"{resolve_threads('auto', 1, os.environ)} for one process ({why})"),
    ]
    if hasattr(os, "getloadavg"):
        rows.append(("load average", " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"))
    return rows


def bf16_rows(cpuinfo_text: str | None) -> list[tuple[str, str]]:
    """Whether the CPU computes bfloat16 natively (cpuinfo.py) and what that means for training and decoding."""
    from dllm.cpuinfo import bf16_support

    support = bf16_support(cpuinfo_text)
    return [("cpu bf16", support.summary()), ("bf16 here", support.meaning())]


def _doctor_config(config: Path, overrides: list[str], rows: list[tuple[str, str]], as_json: bool) -> None:
    from dllm.config.loading import load_config
    from dllm.config.spec import RunSpec
    from dllm.training.needs import check_needs

    needs = check_needs(load_config(RunSpec, config, overrides))
    missing = [n.name for n in needs if not n.ok]
    if as_json:
        report = {
            "config": str(config),
            "ok": not missing,
            "missing": missing,
            "needs": [{"name": n.name, "ok": n.ok, "detail": n.detail} for n in needs],
            "machine": dict(rows),
        }
        out(json.dumps(report, indent=2))
    else:
        _print_rows([(n.name, f"{'ok     ' if n.ok else 'MISSING'}  {n.detail}") for n in needs])
    if missing:
        details = "; ".join(f"{n.name} ({n.detail})" for n in needs if not n.ok)
        print(f"dllm doctor: {config} needs what this machine lacks: {details}", file=sys.stderr)
        raise typer.Exit(1)


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out(f"{k:<{width}}  {v}")


def _machine_rows() -> list[tuple[str, str]]:
    import torch
    import torch.distributed as dist

    from dllm import __version__, cpuinfo
    from dllm.training.needs import compiler_available

    rows = [
        ("dllm", __version__),
        ("python", platform.python_version() + f" ({sys.executable})"),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
        *_thread_rows(),
        *bf16_rows(cpuinfo.read_cpuinfo()),
        ("torch", torch.__version__),
        ("cuda", f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "not available"),
        (
            "mps",
            "available" if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available() else "no",
        ),
        ("torch.distributed", "available" if dist.is_available() else "not available"),
        ("gloo", "yes" if dist.is_available() and dist.is_gloo_available() else "no"),
        ("nccl", "yes" if dist.is_available() and dist.is_nccl_available() else "no"),
        ("flex_attention", "yes" if importlib.util.find_spec("torch.nn.attention.flex_attention") else "no"),
        ("torch.compile (cpu)", compiler_available(on_gpu=False)[1]),
        ("torch.compile (gpu)", compiler_available(on_gpu=True)[1]),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            rows.append(
                (
                    f"gpu {i}",
                    f"{p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}",
                )
            )
    for pkg in (
        "pydantic",
        "typer",
        "numpy",
        "transformers",
        "tokenizers",
        "safetensors",
        "tensorboard",
        "wandb",
        "lm_eval",
    ):
        rows.append((pkg, _version(pkg.replace("_", "-"))))
    return rows
