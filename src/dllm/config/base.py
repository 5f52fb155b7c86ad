"""Shared pieces of every config section: strictness, immutability, field docs, relative paths."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected and values cannot change.

    Attribute docstrings become field descriptions (the JSON schema, CLI help and the comments in
    `dllm init` templates), so every field is declared with a one-line docstring below it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _resolve_relative(value: Path, info: ValidationInfo) -> Path:
    """Paths in a config file are relative to the folder that holds the file."""
    value = Path(value).expanduser()
    base = (info.context or {}).get("base_dir") if info.context is not None else None
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return Path(value).absolute() if base is not None else value


RelPath = Annotated[Path, AfterValidator(_resolve_relative)]
"""A path that, in a file, is relative to the file's folder (made absolute when loaded)."""
