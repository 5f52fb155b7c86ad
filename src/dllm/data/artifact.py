"""Prepared-data artifacts: a folder with manifest.json and flat little-endian arrays.

Both layouts hold the same three arrays:
  tokens.bin      token ids, uint16 when the vocabulary fits, else uint32
  loss_mask.bin   uint8, 1 where the token is a training target (and may be noised)
  doc_starts.bin  uint64 offsets (into tokens) where each document / sample begins
`packed`: tokens holds num_sequences * seq_len ids (rows cut from one stream of documents).
`indexed`: one sample per document at its own length (<= seq_len); the loader pads it to seq_len.

The manifest gives each array's file, dtype, count, largest value and SHA-256. The writer stages
everything in a temporary sibling folder and renames it into place (dllm/staging.py), so a crash
never leaves a half-written artifact, and it only ever replaces a previous artifact that holds nothing
else. Same input + same config gives the same bytes. Training checks the layout and the recorded
maxima before it trusts an artifact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dllm.errors import DataError
from dllm.staging import OutputKind

FORMAT = "dllm-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


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


def _artifact_files(folder: Path) -> set[str] | None:
    """The files an artifact wrote (its manifest and the arrays it lists); None: not an artifact of this format."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    files = manifest.get("files")
    entries = files.values() if isinstance(files, dict) else []
    return {MANIFEST} | {e["file"] for e in entries if isinstance(e, dict) and isinstance(e.get("file"), str)}


ARTIFACT = OutputKind(
    what="a dllm artifact",
    marker=f"no {MANIFEST} of this format",
    files_of=_artifact_files,
    error=DataError,
    stage_files=frozenset({MANIFEST, "tokens.bin", "loss_mask.bin", "doc_starts.bin"}),
)
"""What `dllm data prepare` writes: only a previous artifact holding nothing else is ever replaced."""


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
