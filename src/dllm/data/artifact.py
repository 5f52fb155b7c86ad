"""Prepared-data artifacts: a folder with manifest.json and flat little-endian arrays.

Both layouts hold the same three arrays:
  tokens.bin      token ids, uint16 when the vocabulary fits, else uint32
  loss_mask.bin   uint8, 1 where the token is a training target (and may be noised)
  doc_starts.bin  uint64 offsets (into tokens) where each document / sample begins
`packed`: tokens holds num_sequences * seq_len ids (rows cut from one stream of documents).
`indexed`: one sample per document at its own length (<= seq_len); the loader pads it to seq_len.

The writer stages everything in a temporary sibling folder and renames it into place, so a crash
never leaves a half-written artifact. Same input + same config gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from dllm.errors import DataError

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
        self._fh: BinaryIO = open(folder / self.file, "wb")  # noqa: SIM115 - closed in close()
        self._sha = hashlib.sha256()
        self.count = 0

    def write(self, values: np.ndarray | list[int]) -> None:
        arr = np.ascontiguousarray(np.asarray(values), dtype=self.dtype)
        data = arr.tobytes()
        self._fh.write(data)
        self._sha.update(data)
        self.count += arr.size

    def close(self) -> dict[str, Any]:
        self._fh.close()
        return {
            "file": self.file,
            "dtype": self.dtype.str,
            "count": self.count,
            "sha256": self._sha.hexdigest(),
        }


@contextmanager
def staged_folder(output: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temporary folder next to `output`; on success rename it to `output`."""
    output = Path(output)
    if output.exists() and not overwrite:
        raise DataError(f"{output} already exists; pass --overwrite to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = output.parent / f".{output.name}.tmp-{os.getpid()}"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    trash = output.parent / f".{output.name}.old-{os.getpid()}"
    if output.exists():
        os.replace(output, trash)
    os.replace(stage, output)
    shutil.rmtree(trash, ignore_errors=True)


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
        return np.memmap(self.path / entry["file"], dtype=np.dtype(entry["dtype"]), mode="r", shape=(entry["count"],))


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not mf.is_file():
        raise DataError(f"{path}: no {MANIFEST}; prepare the data first with `dllm data prepare`")
    try:
        manifest = json.loads(mf.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{mf}:{e.lineno}: invalid JSON ({e.msg}); re-run `dllm data prepare --overwrite`") from None
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


def validate_artifact(path: str | Path, checksums: bool = True) -> Artifact:
    """Check schema, file sizes, hashes, and value ranges; raises DataError naming the problem."""
    art = open_artifact(path)
    mf = art.path / MANIFEST
    missing = [k for k in _REQUIRED if k not in art.manifest]
    if missing:
        raise DataError(f"{mf}: missing keys {', '.join(missing)}")
    files = art.manifest["files"]
    for name in ("tokens", "loss_mask", "doc_starts"):
        if name not in files:
            raise DataError(f"{mf}: files.{name} is missing")
    for entry in files.values():
        fp = art.path / entry["file"]
        if not fp.is_file():
            raise DataError(f"{fp}: missing file listed in the manifest")
        expected = int(entry["count"]) * np.dtype(entry["dtype"]).itemsize
        if fp.stat().st_size != expected:
            raise DataError(f"{fp}: {fp.stat().st_size} bytes, the manifest says {expected}")
        if checksums and sha256_file(fp) != entry["sha256"]:
            raise DataError(f"{fp}: SHA-256 differs from the manifest (the file changed or is corrupt)")
    indexed = art.manifest["layout"] == "indexed"
    n_tokens = int(files["tokens"]["count"]) if indexed else art.num_sequences * art.seq_len
    for name in ("tokens", "loss_mask"):
        if int(files[name]["count"]) != n_tokens:
            raise DataError(f"{mf}: files.{name}.count is {files[name]['count']}, expected {n_tokens}")
    vocab = int(art.tokenizer["vocab_size"])
    tokens = art.array("tokens")
    if tokens.size and int(tokens.max()) >= vocab:
        raise DataError(f"{art.path}: token id {int(tokens.max())} is outside the vocabulary ({vocab})")
    mask = art.array("loss_mask")
    if mask.size and int(mask.max()) > 1:
        raise DataError(f"{art.path}: loss_mask holds values other than 0 and 1")
    starts = np.asarray(art.array("doc_starts"), dtype=np.int64)
    if starts.size and (np.any(np.diff(starts) <= 0) or int(starts[-1]) >= max(n_tokens, 1)):
        raise DataError(f"{art.path}: doc_starts are not increasing offsets inside tokens")
    if indexed:
        lengths = np.diff(np.append(starts, n_tokens))
        if starts.size != art.num_sequences or (starts.size and starts[0] != 0):
            raise DataError(f"{mf}: an indexed artifact needs one doc_start per sample, the first at 0")
        if lengths.size and int(lengths.max()) > art.seq_len:
            raise DataError(f"{art.path}: a sample has {int(lengths.max())} tokens, more than seq_len {art.seq_len}")
    return art
