"""Where a command may write: one rule for every flag that names an output file or folder.

An output is never something the command reads: not one of its input files (the same path once links are
resolved, or a hard link to it), not inside a folder it reads, and, for a folder, not holding one. Nor does
it lie inside a folder dllm wrote and reads back (a run folder, a checkpoint, a prepared artifact, a model
folder): a file written there replaces or sits among the files the next load needs. A folder output may be
such a folder itself only when it is of the kind the command writes (a previous output it replaces as a
unit: staging.py). Commands check this before any model is loaded or any work done.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from dllm.errors import ConfigError

Reads = Iterable[tuple[str, Path | str | None]]
"""What a command reads, as (the flag that names it, its path); a hub id or None is skipped."""

RUN = "a run folder"
CHECKPOINT = "a checkpoint folder"
ARTIFACT = "a prepared artifact"
FEATURES = "a feature cache"
MODEL = "a model folder"

# The marker files of those folders. Their names are declared where they are written (training/run.py,
# training/metrics.py, checkpoint/manager.py, data/artifact.py, models/pretrained.py, models/hf_io.py,
# config/profile.py, models/lora.py, cli/convert_cmd.py): not imported, most of those modules load torch.
_CHECKPOINT_FILES = ("trainer_state.json", ".metadata")
_MANIFEST_KINDS = {"dllm-artifact": ARTIFACT, "dllm.checkpoint": CHECKPOINT, "dllm.dflash_features.v1": FEATURES}
_MODEL_FILES = (".dllm-convert.json", "decode_profile.json")
_MODEL_PAIRS = (("model.yaml", "model.safetensors"), ("adapter_config.json", "adapter_model.safetensors"))
_MAX_MANIFEST_BYTES = 1 << 26
_HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def folder_kind(folder: Path) -> str | None:
    """Which folder dllm wrote or reads `folder` is, by its marker files (RUN, CHECKPOINT, ARTIFACT, FEATURES,
    MODEL); None: none of them."""

    def has(name: str) -> bool:
        return os.path.lexists(folder / name)

    if has("config.yaml") and (has("checkpoints") or has("metrics.jsonl")):
        return RUN
    if any(has(name) for name in _CHECKPOINT_FILES):
        return CHECKPOINT
    if has("manifest.json"):
        kind = _MANIFEST_KINDS.get(_manifest_format(folder / "manifest.json"))
        if kind is not None or has("tokens.bin"):  # a damaged manifest still marks an artifact
            return kind or ARTIFACT
    if any(has(name) for name in _MODEL_FILES) or any(has(a) and has(b) for a, b in _MODEL_PAIRS):
        return MODEL
    if has("config.json") and any(has(w) for w in _HF_WEIGHTS):  # a Hugging Face folder
        return MODEL
    return None


def _manifest_format(path: Path) -> str:
    """The `format` a manifest.json names; "" for anything else (a device or pipe is never read)."""
    if not os.path.isfile(path) or os.path.getsize(path) > _MAX_MANIFEST_BYTES:
        return ""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return ""
    return body.get("format", "") if isinstance(body, dict) and isinstance(body.get("format"), str) else ""


def check_output_place(
    output: Path, flag: str, reads: Reads = (), *, folder: bool = False, own: str | None = None
) -> None:
    """Refuse an output (a file, or a folder when `folder`) that overlaps what the command reads, lies inside a
    folder dllm wrote, or (a folder) is one of a kind other than `own`, the kind the command writes."""
    real = Path(os.path.realpath(output))
    for label, path in _local(reads):
        _check_apart(output, real, flag, label, path, folder)
    parent = Path(os.path.realpath(os.path.dirname(os.path.abspath(output))))  # where a link itself is replaced
    for above in dict.fromkeys([*real.parents, parent, *parent.parents]):
        kind = folder_kind(above)
        if kind is not None:
            raise ConfigError(f"{flag}: {output} lies inside {kind} ({above}), whose files dllm reads back; "
                              "write it outside that folder")  # fmt: skip
    kind = folder_kind(real) if folder and real.is_dir() else None
    if kind is not None and kind != own:
        raise ConfigError(f"{flag}: {output} is {kind}; choose another output folder")


def _local(reads: Reads) -> list[tuple[str, Path]]:
    """The reads that are paths here (a hub id names no local path: the hub cache is a model folder)."""
    return [(label, Path(p)) for label, p in reads if p is not None and os.path.lexists(p)]


def _check_apart(output: Path, real: Path, flag: str, label: str, path: Path, folder: bool) -> None:
    """`output` (resolved: `real`) is not `path`, not inside it, does not hold it, nor is a hard link to its files."""
    read = Path(os.path.realpath(path))
    if folder and (real == read or read in real.parents or real in read.parents):
        raise ConfigError(f"{flag}: {output} overlaps {label} {path}, which this command reads; "
                          "choose an output outside it")  # fmt: skip
    if real == read:
        raise ConfigError(f"{flag}: {output} is {label} {path}, which this command reads; choose another output")
    if read in real.parents:
        raise ConfigError(f"{flag}: {output} lies inside {label} {path}, which this command reads; "
                          "write it outside that folder")  # fmt: skip
    linked = None if folder else _hard_link_in(output, read)
    if linked is not None:
        raise ConfigError(f"{flag}: {output} is a hard link to {linked}, which this command reads ({label} {path}); "
                          "choose another output")  # fmt: skip


def _hard_link_in(output: Path, read: Path) -> Path | None:
    """The file of `read` (a file, or any file under a folder) that `output` is a hard link to; None: none."""
    try:
        st = os.stat(output)
    except OSError:
        return None
    if st.st_nlink < 2:
        return None
    files = [read] if not read.is_dir() else [Path(d, f) for d, _, names in os.walk(read) for f in names]
    for f in files:
        try:
            other = os.stat(f)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return f
    return None
