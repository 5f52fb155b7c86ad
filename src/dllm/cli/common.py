"""Helpers shared by the command modules."""

from __future__ import annotations

import sys
from typing import Any

import typer

SetOption = typer.Option(None, "--set", help="Override a config field: --set training.steps=50 (repeatable).")


def warn(msg: str) -> None:
    print(f"dllm: warning: {msg}", file=sys.stderr)


def info(msg: str) -> None:
    print(msg, file=sys.stderr)


def out(msg: Any = "") -> None:
    print(msg, flush=True)
