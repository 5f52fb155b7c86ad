"""Shared pieces of every config section: strictness, immutability, field docs, relative paths, hub ids."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo


class Section(BaseModel):
    """Base of every config section: unknown keys are rejected and values cannot change.

    Attribute docstrings become field descriptions (the JSON schema, CLI help and the comments in
    `dllm init` templates), so every field is declared with a one-line docstring below it. No field
    takes an infinite or NaN number (YAML's `.inf`, `.nan`, or `1e999`): none has a meaning for it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, allow_inf_nan=False)


_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w.][\w./-]*))?")
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


SYSTEM_FOLDERS = ("/proc", "/sys", "/dev")
"""Folders of the kernel's own files: nothing a command writes belongs there (most refuse new files only mid-run).
/dev/shm, a RAM disk that holds files, is not one of them."""


def output_folder_problem(folder: Path) -> str | None:
    """Why `folder` can never hold an output folder, from its place alone: the filesystem root (a run there writes
    /NAME and /latest), or a folder in SYSTEM_FOLDERS. None when neither. (Whether it can be written is found by
    trying: dllm.staging.unwritable_problem.)"""
    path = Path(os.path.abspath(folder))
    if path == path.parent:
        return f"{folder} is the filesystem root; give a folder of its own, e.g. {path / 'runs'}"
    system = next((s for s in map(Path, SYSTEM_FOLDERS) if path == s or s in path.parents), None)
    if system is not None and not (path == Path("/dev/shm") or Path("/dev/shm") in path.parents):
        return f"{folder} is in {system}, which holds the kernel's files, not outputs; choose another folder"
    return None


def _output_folder(value: Path) -> Path:
    problem = output_folder_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


OutputFolder = Annotated[Path, AfterValidator(_resolve_relative), AfterValidator(_output_folder)]
"""A folder a command writes (a RelPath): never the filesystem root nor under /proc, /sys or /dev."""

PathPattern = Annotated[str, AfterValidator(_no_env_vars)]
"""A file or glob as written in a config (resolved later by its reader); environment variables are refused."""


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repository, revision or None) of `org/name[@revision]`; None when `text` is not of that form."""
    m = _HUB_ID.fullmatch(text)
    if m is None or "--" in m["repo"] or ".." in m["repo"] or len(m["repo"]) > 96:
        return None
    return m["repo"], m["revision"]


def source_of(text: str, local: Path) -> Path | str:
    """A config value or command-line argument read as a source: the local path `local` (the text resolved
    against its base folder) when it exists or the text cannot be a hub id, else the hub id itself. Text
    with an `@` that is neither is refused (a ValueError: a config or CLI validation message)."""
    if local.exists() or text.startswith((".", "/", "~")):
        return local
    if parse_hub_id(text) is not None:
        return text
    if "@" in text:
        raise ValueError(f"{text!r} is neither a local folder nor a hub id org/name[@revision]")
    return local


def _path_or_hub_id(value: Path | str, info: ValidationInfo) -> Path | str:
    """A local path (relative to the config file's folder; it wins when it exists) or a hub id kept as text."""
    if isinstance(value, Path):
        return _resolve_relative(value, info)
    return source_of(_no_env_vars(value), _resolve_relative(Path(value), info))


PathOrHubId = Annotated[Path | str, AfterValidator(_path_or_hub_id)]
"""A folder (as RelPath) or a Hugging Face hub id `org/name[@revision]`, resolved later by dllm.hub.local_folder."""


def _not_a_boolean(value: Any) -> Any:
    """YAML's true/false are Python ints (pydantic reads `steps: true` as 1): refused where a number is meant."""
    if isinstance(value, bool):
        raise ValueError("true/false is not a number here; write the number")
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
"""An integer field (true and false refused); every int of a config section is one."""

Float = Annotated[float, BeforeValidator(_not_a_boolean)]
"""A float field (true and false refused); every float of a config section is one."""


MAX_SEED = 2**63 - 1
"""The largest seed: torch, numpy and the noise keys take a non-negative 64-bit integer."""

Seed = Annotated[int, BeforeValidator(_not_a_boolean), Field(ge=0, le=MAX_SEED)]
"""A random seed: an integer in [0, 2**63)."""
