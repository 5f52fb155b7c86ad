"""The files of a checkpoint: durable writes, the SHA-256 manifest, and disk-full reporting.

A published checkpoint folder holds `manifest.json`: the size and SHA-256 of every other file in it.
Loading checks that the manifest lists every file, their sizes and their hashes, so a flipped byte, a
truncated or missing shard is one line naming the file instead of a silently wrong model. A folder
without a manifest (written before manifests existed, or with it removed) or with files it does not
list is refused the same way: only `checkpointing.verify: false` loads it, and then only the sizes
of the files a manifest lists are checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dllm.config.training import MAX_STEPS
from dllm.config.untrusted import count, open_regular, read_json, regular_size
from dllm.errors import CheckpointError
from dllm.staging import disk_full

MANIFEST = "manifest.json"
_FORMAT = "dllm.checkpoint"
_CHUNK = 1 << 20
MAX_FILE_BYTES = 1 << 50
"""The largest size a manifest may record for one file (a petabyte: no checkpoint's shard)."""


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in `folder` survive a power loss (the entry lives in the folder)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_durably(path: Path, text: str) -> None:
    """Write `path` through a temp file that is fsynced and renamed into place; a failed write
    removes the temp file and leaves any old `path` as it was."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def set_aside(path: Path) -> Path:
    """Rename `path` to the first free `NAME.replaced-N` beside it and return that: what a run must not
    delete nor resume from stays on disk, under a name nothing reads."""
    n = 1
    while os.path.lexists(path.with_name(f"{path.name}.replaced-{n}")):
        n += 1
    target = path.with_name(f"{path.name}.replaced-{n}")
    os.replace(path, target)
    return target


def _digest(path: Path, sync: bool = False) -> str:
    h = hashlib.sha256()
    with open_regular(path) as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
        if sync:  # the pages DCP or we wrote are on disk before the folder is published
            os.fsync(fh.fileno())
    return h.hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    """fsync every file of `folder` and record its size and SHA-256 in `folder/manifest.json`."""
    files = {
        p.name: {"bytes": p.stat().st_size, "sha256": _digest(p, sync=True)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    body = {"format": _FORMAT, "version": 1, "step": step, "files": files}
    write_text_durably(folder / MANIFEST, json.dumps(body, indent=2, sort_keys=True) + "\n")


VERIFY_OFF = "set checkpointing.verify: false"
"""How a user loads a checkpoint without checking it (the loaders say where: a run's config.yaml, --set)."""


def verify_checkpoint(folder: Path, verify: bool = True, hashes: bool = True, opt_out: str = VERIFY_OFF) -> None:
    """Refuse a checkpoint whose files differ from its manifest. `verify` (checkpointing.verify): the
    manifest must list every file of the folder, and this process checks their SHA-256 when `hashes`
    too; without it only the sizes of the files a manifest lists are checked. `opt_out` ends the
    message of a refused folder: how this command turns `verify` off."""
    folder = Path(folder)
    if not folder.is_dir():
        raise vanished(folder)
    listed = _read_manifest(folder)
    if verify:
        _check_listing(folder, listed, opt_out)
    for name, entry in (listed or {}).items():
        _check_file(folder / name, entry, verify and hashes)


def vanished(folder: Path) -> CheckpointError:
    return CheckpointError(
        f"{folder}: the checkpoint disappeared or changed while it was being loaded (a running training published "
        "a newer one and pruned it); run the command again"
    )


def _check_listing(folder: Path, listed: dict[str, dict[str, Any]] | None, opt_out: str) -> None:
    """A manifest that lists every file of the folder: without one nothing could be checked."""
    trust = f"if you trust this checkpoint, {opt_out} to load it unchecked"
    if listed is None:
        raise CheckpointError(
            f"{folder}: no {MANIFEST}, so its files cannot be checked (written before checkpoints carried "
            f"checksums, or the manifest was removed); {trust}"
        )
    unlisted = sorted(set(os.listdir(folder)) - set(listed) - {MANIFEST})
    if unlisted:
        raise CheckpointError(
            f"{folder / unlisted[0]}: not listed in {MANIFEST} ({len(unlisted)} file(s) in all): the folder or its "
            f"manifest was changed after the checkpoint was written; {trust}"
        )


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    path = folder / MANIFEST
    if not os.path.lexists(path):
        return None
    advice = "use another checkpoint"
    body = read_json(path, "a dllm checkpoint manifest", advice)
    files = body.get("files") if isinstance(body, dict) and body.get("format") == _FORMAT else None
    try:  # `files` is only found in an object: `body` is one then
        ok = isinstance(files, dict) and all(_valid_entry(k, v) for k, v in files.items())
        ok = ok and count(body["step"], "step", MAX_STEPS) >= 0
    except (ValueError, KeyError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: damaged or not a dllm checkpoint manifest; {advice}")
    return files


def _valid_entry(name: Any, entry: Any) -> bool:
    """A plain file name of this folder (nothing that reaches outside it) with a size (a ValueError when it is
    not a count) and a digest."""
    plain = isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
    ok = plain and isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
    return ok and count(entry.get("bytes"), "bytes", MAX_FILE_BYTES) >= 0


def _check_file(path: Path, entry: dict[str, Any], hashes: bool) -> None:
    advice = "restore it from a copy, or use an older checkpoint (resume: name it in checkpoints/latest)"
    size = regular_size(path)
    if size is None:
        if not path.parent.is_dir():
            raise vanished(path.parent)
        raise CheckpointError(f"{path}: missing (listed in {MANIFEST}); the checkpoint is incomplete: {advice}")
    if size != entry["bytes"]:
        raise CheckpointError(f"{path}: {size} bytes where {MANIFEST} records {entry['bytes']} (truncated?): {advice}")
    if hashes and _digest(path) != entry["sha256"]:
        raise CheckpointError(f"{path}: damaged (its SHA-256 differs from {MANIFEST}): {advice}")


# -- disk full ------------------------------------------------------------------------------------
def disk_full_error(exc: BaseException, folder: Path, needed_bytes: int) -> CheckpointError | None:
    """The one-line error for a write that failed for lack of space (by its errno, or because the
    disk now has less room than the write needs), else None."""
    free = _free_bytes(folder)
    if not disk_full(exc) and (free is None or free >= needed_bytes):
        return None
    return no_space(folder, needed_bytes, free)


def no_space(folder: Path, needed_bytes: int, free: int | None) -> CheckpointError:
    have = "" if free is None else f", {_mb(free)} MB free"
    return CheckpointError(
        f"no space left on {folder} (needs about {_mb(needed_bytes)} MB{have}); "
        "free some space or set run.output_dir to a bigger disk, then launch again to resume"
    )


def check_free_space(folder: Path, needed_bytes: int) -> None:
    """Refuse a write that cannot fit before starting it."""
    free = _free_bytes(folder)
    if free is not None and free < needed_bytes:
        raise no_space(folder, needed_bytes, free)


def _free_bytes(folder: Path) -> int | None:
    for p in (folder, *folder.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free
            except OSError:
                return None
    return None


def _mb(num_bytes: int) -> int:
    return max(1, -(-num_bytes // (1 << 20)))
