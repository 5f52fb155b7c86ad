"""`dllm doctor`: what this machine offers dllm (versions, devices, backends, optional packages)."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import sys

from dllm.cli.common import out


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def doctor() -> None:
    """Print versions, devices, distributed backends and optional features."""
    import torch
    import torch.distributed as dist

    from dllm import __version__

    rows = [
        ("dllm", __version__),
        ("python", platform.python_version() + f" ({sys.executable})"),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
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
        ("compiler (torch.compile)", shutil.which("gcc") or shutil.which("cc") or "no C compiler found"),
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
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        out(f"{k:<{width}}  {v}")
