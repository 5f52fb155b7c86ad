"""Shared pieces of every config section: strictness, immutability, field docs, relative paths."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected and values cannot change.

    Attribute docstrings become field descriptions (the JSON schema, CLI help and the comments in
    `dllm init` templates), so every field is declared with a one-line docstring below it. No field
    takes an infinite or NaN number (YAML's `.inf`, `.nan`, or `1e999`): none has a meaning for it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


_ENV_VAR = re.compile(r"\$\{[^}]*\}?|\$[A-Za-z_][A-Za-z0-9_]*")


def _no_env_vars(value: str) -> str:
    """A config is read as written: `${HOME}/data` would silently become a folder named `${HOME}`."""
    m = _ENV_VAR.search(str(value))
    if m:
        raise ValueError(f"{m.group()} is an environment variable, and configs do not expand them; write the path out")
    return value


def _resolve_relative(value: Path, info: ValidationInfo) -> Path:
    """Paths in a config file are relative to the folder that holds the file."""
    _no_env_vars(str(value))
    value = Path(value).expanduser()
    base = (info.context or {}).get("base_dir") if info.context is not None else None
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return Path(value).absolute() if base is not None else value


RelPath = Annotated[Path, AfterValidator(_resolve_relative)]
"""A path that, in a file, is relative to the file's folder (made absolute when loaded)."""

PathPattern = Annotated[str, AfterValidator(_no_env_vars)]
"""A file or glob as written in a config (resolved later by its reader); environment variables are refused."""
