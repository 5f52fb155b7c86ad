"""Prepared-data artifacts: a folder with manifest.json and flat little-endian arrays.

Both layouts hold the same three arrays:
  tokens.bin      token ids, uint16 when the vocabulary fits, else uint32
  loss_mask.bin   uint8, 1 where the token is a training target (and may be noised)
  doc_starts.bin  uint64 offsets (into tokens) where each document / sample begins
`packed`: tokens holds num_sequences * seq_len ids (rows cut from one stream of documents).
`indexed`: one sample per document at its own length (<= seq_len); the loader pads it to seq_len.

The manifest gives each array's file, dtype, count, largest value and SHA-256. The writer stages
everything in a temporary sibling folder and renames it into place, so a crash never leaves a
half-written artifact, and it only ever replaces a previous artifact. Same input + same config gives
the same bytes. Training checks the layout and the recorded maxima before it trusts an artifact.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dllm.errors import DataError

FORMAT = "dllm-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class ArrayWriter:
    """Appends one flat array to a file while hashing it (memory stays flat)."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype) -> None:
        self.name = name
        self.file = f"{name}.bin"
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._fh: BinaryIO = (folder / self.file).open("wb")  # closed in close() or discard()
        self._sha = hashlib.sha256()
        self.count = 0
        self.max = 0  # recorded in the manifest: training checks token ids against it without reading the file

    def write(self, values: np.ndarray | list[int]) -> None:
        arr = np.ascontiguousarray(np.asarray(values), dtype=self.dtype)
        data = arr.tobytes()
        self._fh.write(data)
        self._sha.update(data)
        self.count += arr.size
        if arr.size:
            self.max = max(self.max, int(arr.max()))

    def discard(self) -> None:
        """Close the file of a failed preparation (its folder is removed): a full disk must not fail again later."""
        with contextlib.suppress(OSError):
            self._fh.close()

    def close(self) -> dict[str, Any]:
        self._fh.close()
        return {
            "file": self.file,
            "dtype": self.dtype.str,
            "count": self.count,
            "max": self.max,
            "sha256": self._sha.hexdigest(),
        }


@contextmanager
def staged_folder(output: Path, overwrite: bool, keep: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield a temporary folder next to `output`; on success rename it to `output`.

    Only a previous artifact is ever replaced, and never one that is or holds a path in `keep` (the
    inputs and the config's folder). Parent folders created here are removed again on failure, and
    staging folders of killed runs are cleaned up.
    """
    output = Path(output)
    check_replaceable(output, overwrite, keep)
    created = _make_parents(output.parent)
    stage = output.parent / f".{output.name}.tmp-{os.getpid()}"
    try:
        remove_stale_stages(output)
        if stage.exists():  # left by an earlier process with our PID, so a dead one
            shutil.rmtree(stage)
        _mkdir(stage)
        yield stage
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_created(created)
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            raise DataError(
                f"no space left on {output.parent} while writing {output.name}; nothing was kept: free some space "
                "or choose another output, then prepare again"
            ) from None
        raise
    trash = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        os.replace(output, trash)
    os.replace(stage, output)
    shutil.rmtree(trash, ignore_errors=True)


def check_replaceable(output: Path, overwrite: bool, keep: Iterable[Path] = ()) -> None:
    """Refuse an existing `output` unless it is an artifact, `overwrite` is set, and it holds nothing in `keep`."""
    if not os.path.lexists(output):
        return
    if not _is_artifact(output):
        raise DataError(
            f"{output} exists and is not a dllm artifact (no {MANIFEST} of this format); "
            "choose another output (--overwrite only replaces an artifact)"
        )
    if not overwrite:
        raise DataError(f"{output} already exists; pass --overwrite to replace it")
    real = output.resolve()
    for path in keep:
        p = Path(path).resolve()
        if p == real or real in p.parents:
            raise DataError(f"{output} holds {path}, which replacing it would delete; choose another output")


def _is_artifact(folder: Path) -> bool:
    """A folder with a manifest of our format (any version): the only kind of folder --overwrite replaces."""
    if not (folder.is_dir() and (folder / MANIFEST).is_file()):
        return False
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _mkdir(folder: Path, parents: bool = False) -> None:
    """mkdir whose failure (a file in the way, no permission) is one line naming the output."""
    try:
        folder.mkdir(parents=parents, exist_ok=parents)
    except OSError as e:
        blocker = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), folder)
        if not blocker.is_dir():
            raise DataError(f"output: {blocker} is a file, not a folder; choose another output") from None
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or type(e).__name__)
        raise DataError(f"output: cannot create {folder} ({reason}); choose another output") from None


def _make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; returns those created, deepest first."""
    missing = []
    p = folder
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        _mkdir(folder, parents=True)
    except DataError:  # it may have failed halfway down
        _remove_created(missing)
        raise
    return missing


def _remove_created(folders: list[Path]) -> None:
    """Remove folders this run created (deepest first) while they are empty: never anything else."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


_STAGE_FILES = frozenset({MANIFEST, "tokens.bin", "loss_mask.bin", "doc_starts.bin"})


def remove_stale_stages(output: Path) -> list[Path]:
    """Remove the staging folders `.NAME.tmp-PID` of `output` left by killed processes.

    Only folders of exactly that name whose process is gone and which hold nothing but the files
    prepare writes; anything else (a live run, a user's file, another name) is left alone."""
    prefix = f".{output.name}.tmp-"
    removed = []
    for folder in output.parent.glob(glob.escape(prefix) + "*"):
        pid = folder.name[len(prefix) :]
        if not (pid.isascii() and pid.isdigit()) or folder.is_symlink() or not folder.is_dir() or _alive(int(pid)):
            continue
        if set(os.listdir(folder)) <= _STAGE_FILES:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (unknown counts as alive: nothing is removed)."""
    if os.name != "posix" or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, owned by someone else
        return True
    return True


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (folder / MANIFEST).write_text(text, encoding="utf-8")


def fingerprint(prepare_config: dict[str, Any], tokenizer: dict[str, Any], files: dict[str, Any]) -> str:
    """Identity of an artifact: its content hashes, the preparation config and the tokenizer."""
    payload = {
        "format_version": FORMAT_VERSION,
        "prepare_config": prepare_config,
        "tokenizer": tokenizer,
        "content": {k: v["sha256"] for k, v in sorted(files.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Artifact:
    """An opened artifact: its manifest and memory-mapped arrays (read-only)."""

    path: Path
    manifest: dict[str, Any]

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def num_sequences(self) -> int:
        return int(self.manifest["num_sequences"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        return dict(self.manifest["tokenizer"])

    def array(self, name: str) -> np.ndarray:
        entry = self.manifest["files"][name]
        return np.memmap(_file_of(self, name), dtype=np.dtype(entry["dtype"]), mode="r", shape=(entry["count"],))


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise DataError(f"{path}: no {MANIFEST}; prepare the data first with `dllm data prepare`")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{mf}:{e.lineno}: invalid JSON ({e.msg}); re-run `dllm data prepare --overwrite`") from None
    except (ValueError, RecursionError):  # not UTF-8, a number too long to read, nested too deeply
        raise DataError(f"{mf}: not a readable manifest; re-run `dllm data prepare --overwrite`") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{mf}: not a dllm artifact manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{mf}: format version {manifest.get('format_version')} is not supported "
            f"(this dllm reads {FORMAT_VERSION}); re-run `dllm data prepare --overwrite`"
        )
    return manifest


def open_artifact(path: str | Path) -> Artifact:
    path = Path(path)
    return Artifact(path=path, manifest=read_manifest(path))


def sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            sha.update(chunk)
    return sha.hexdigest()


_REQUIRED = ("layout", "seq_len", "num_sequences", "files", "tokenizer", "fingerprint", "stats")
# the dtypes each array may have (what ArrayWriter records); anything else is a corrupt or hostile manifest
_DTYPES = {"tokens": ("<u2", "<u4"), "loss_mask": ("|u1",), "doc_starts": ("<u8",)}
_REDO = "re-run `dllm data prepare --overwrite`"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # a plain name: no separator, no "..", no NUL


def _count(value: Any, where: str) -> int:
    """A non-negative integer field of the manifest (JSON booleans and floats are not counts)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataError(f"{where} must be a non-negative integer, got {str(value)[:40]!r}; {_REDO}")
    return value


def _file_of(art: Artifact, name: str) -> Path:
    """The file of array `name`: a plain name inside the artifact folder (links resolved), never a path outside."""
    mf = art.path / MANIFEST
    entry = art.manifest["files"].get(name)
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not isinstance(entry.get("dtype"), str):
        raise DataError(f"{mf}: files.{name} must be an object with file, dtype and count; {_REDO}")
    file = entry["file"]
    path = art.path / file
    if not _FILE_NAME.fullmatch(file) or path.resolve().parent != art.path.resolve():
        raise DataError(f"{mf}: files.{name}.file {file[:80]!r} points outside the artifact folder; {_REDO}")
    return path


def _check_file(art: Artifact, name: str) -> None:
    """One array's file: inside the folder, an expected dtype, and exactly count x itemsize bytes."""
    mf = art.path / MANIFEST
    path = _file_of(art, name)
    entry = art.manifest["files"][name]
    if entry["dtype"] not in _DTYPES[name]:
        raise DataError(
            f"{mf}: files.{name}.dtype is {entry['dtype'][:20]!r}, expected {' or '.join(_DTYPES[name])}; {_REDO}"
        )
    count = _count(entry.get("count"), f"{mf}: files.{name}.count")
    if not path.is_file():
        raise DataError(f"{path}: missing file listed in the manifest")
    expected = count * np.dtype(entry["dtype"]).itemsize
    if path.stat().st_size != expected:
        raise DataError(f"{path}: {path.stat().st_size} bytes, the manifest says {expected} (truncated or changed)")


def check_layout(art: Artifact) -> None:
    """Schema, file names, dtypes, sizes and counts; reads no file (a few stat calls).

    Training runs it every time it opens an artifact: a corrupt or hostile manifest is one line naming
    the file, never a crash in numpy or a read outside the folder."""
    mf = art.path / MANIFEST
    missing = [k for k in _REQUIRED if k not in art.manifest]
    if missing:
        raise DataError(f"{mf}: missing keys {', '.join(missing)}")
    files, tokenizer = art.manifest["files"], art.manifest["tokenizer"]
    if not isinstance(files, dict) or not isinstance(tokenizer, dict):
        raise DataError(f"{mf}: files and tokenizer must be objects; {_REDO}")
    if art.manifest["layout"] not in ("packed", "indexed"):
        raise DataError(f"{mf}: layout is {str(art.manifest['layout'])[:40]!r}, expected packed or indexed; {_REDO}")
    for key in ("seq_len", "num_sequences"):
        _count(art.manifest[key], f"{mf}: {key}")
    _count(tokenizer.get("vocab_size"), f"{mf}: tokenizer.vocab_size")
    for name in _DTYPES:
        if name not in files:
            raise DataError(f"{mf}: files.{name} is missing")
        _check_file(art, name)
    n_tokens = _num_tokens(art)
    for name in ("tokens", "loss_mask"):
        if int(files[name]["count"]) != n_tokens:
            raise DataError(f"{mf}: files.{name}.count is {files[name]['count']}, expected {n_tokens}")


def _num_tokens(art: Artifact) -> int:
    if art.manifest["layout"] == "indexed":
        return int(art.manifest["files"]["tokens"]["count"])
    return art.num_sequences * art.seq_len


def _check_doc_starts(art: Artifact, n_tokens: int) -> None:
    path = _file_of(art, "doc_starts")
    starts = np.asarray(art.array("doc_starts"), dtype=np.uint64)
    if starts.size and (np.any(starts[1:] <= starts[:-1]) or int(starts[0]) != 0 or int(starts[-1]) >= n_tokens):
        raise DataError(f"{path}: doc_starts are not increasing offsets inside tokens, from 0; {_REDO}")
    if art.manifest["layout"] == "indexed":
        if starts.size != art.num_sequences:
            raise DataError(
                f"{art.path / MANIFEST}: an indexed artifact needs one doc_start per sample, the first at 0"
            )
        lengths = np.diff(np.append(starts.astype(np.int64), n_tokens))
        if lengths.size and int(lengths.max()) > art.seq_len:
            raise DataError(f"{path}: a sample has {int(lengths.max())} tokens, more than seq_len {art.seq_len}")


def check_values(art: Artifact, vocab_size: int | None = None, *, trust_recorded: bool = False) -> None:
    """Document offsets, token ids below the vocabulary and a 0/1 loss mask (after `check_layout`).

    With `trust_recorded`, the maxima the manifest records are used when present (the token and mask
    files are not read): the cheap check at launch; the loader checks every batch it reads, so a file
    changed after preparation still stops training with one line. Otherwise, or for an artifact that
    records no maxima, one numpy pass over each file."""
    _check_doc_starts(art, _num_tokens(art))
    vocab = int(art.tokenizer["vocab_size"]) if vocab_size is None else vocab_size
    for name, limit in (("tokens", vocab - 1), ("loss_mask", 1)):
        recorded = art.manifest["files"][name].get("max")
        if recorded is not None:
            _check_max(art, name, _count(recorded, f"{art.path / MANIFEST}: files.{name}.max"), limit, vocab, True)
        if not (trust_recorded and recorded is not None):
            values = art.array(name)
            _check_max(art, name, int(values.max()) if values.size else 0, limit, vocab, False)


def _check_max(art: Artifact, name: str, top: int, limit: int, vocab: int, recorded: bool) -> None:
    if top <= limit:
        return
    note = f" (the maximum recorded in {MANIFEST})" if recorded else ""
    what = f"token id {top}{note} is outside the vocabulary ({vocab})"
    if name == "loss_mask":
        what = f"loss_mask holds values other than 0 and 1{note}"
    raise DataError(f"{_file_of(art, name)}: {what}; {_REDO}")


def validate_artifact(path: str | Path, checksums: bool = True) -> Artifact:
    """Check schema, file sizes, hashes, and value ranges; raises DataError naming the problem."""
    art = open_artifact(path)
    check_layout(art)
    if checksums:
        for name in _DTYPES:
            fp = _file_of(art, name)
            if sha256_file(fp) != art.manifest["files"][name].get("sha256"):
                raise DataError(f"{fp}: SHA-256 differs from the manifest (the file changed or is corrupt)")
    check_values(art)
    return art
