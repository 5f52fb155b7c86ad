"""Helpers shared by the command modules."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from dllm.errors import ConfigError

SetOption = typer.Option(None, "--set", help="Override a config field: --set training.steps=50 (repeatable).")
MODEL_HELP = "A Hugging Face or `dllm convert` model folder, or a hub id org/name[@revision]."


def model_folder(text: str | Path | None, flag: str = "--model") -> Path | None:
    """The folder a model argument names: a local folder wins, else a hub id `org/name[@revision]` through
    the Hugging Face cache (HF_HUB_OFFLINE honoured); every failure is one ConfigError naming `flag`."""
    if text is None or isinstance(text, Path):
        return text
    from dllm.config.base import source_of
    from dllm.hub import local_folder

    try:
        return local_folder(source_of(text, Path(text).expanduser()), flag)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None


def hub_id(text: str | Path | None) -> str | None:
    """`text` when a model argument is read as a hub id (no local folder of that name), else None."""
    from dllm.config.base import source_of

    if text is None or isinstance(text, Path):
        return None
    try:
        source = source_of(text, Path(text).expanduser())
    except ValueError:
        return None
    return source if isinstance(source, str) else None


def warn(msg: str) -> None:
    print(f"dllm: warning: {msg}", file=sys.stderr)


def info(msg: str) -> None:
    print(msg, file=sys.stderr)


def out(msg: Any = "") -> None:
    print(msg, flush=True)
