"""Sources: where records come from. Each yields (record, location) pairs in a fixed order.

Readers stream (memory stays flat for big files) and raise `DataError` naming the file and the line or
row. pyarrow (parquet) and datasets (hf_dataset) are optional and imported only when a source needs them.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import importlib
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import numpy as np

from dllm.config.prepare import (
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    NpySourceConfig,
    ParquetSourceConfig,
    TextSourceConfig,
)
from dllm.errors import DataError

PARQUET_BATCH_ROWS = 1024  # rows held in memory at once when reading a Parquet file


@dataclass(frozen=True)
class Record:
    """One input record and where it came from (for error messages and provenance)."""

    data: dict[str, Any]
    where: str
    error: str | None = None
    """Why the input at `where` is no record (a line that is not a JSON object): failed or skipped (on_bad_record)."""


SourceReader = Callable[[Any, Path], Iterator[Record]]
"""A source kind's reader (registered in dllm.config.registries.SOURCES): its config section -> records."""


# --------------------------------------------------------------------------------------------------
# shared pieces


def _resolve(path: str, base_dir: Path) -> Path:
    return Path(path) if Path(path).is_absolute() else base_dir / path


def expand_paths(pattern: str, base_dir: Path, field: str) -> list[Path]:
    """Sorted files matching a path or glob relative to `base_dir`, each file once; an empty match is an error.

    `**` does not descend into linked folders: glob.glob follows a link back to a parent about 40
    levels deep (the same file read 41 times; two such links, 2**40 paths). A file reached under two
    names (a link to it) is read once, under its first name in sorted order."""
    seen: set[str] = set()
    matches = []
    for path in sorted(_glob(str(_resolve(pattern, base_dir)))):
        real = os.path.realpath(path)
        if path.is_file() and real not in seen:
            seen.add(real)
            matches.append(path)
    if not matches:
        raise DataError(f"{field}: no file matches {pattern!r} (looked in {base_dir})")
    return matches


def _glob(pattern: str) -> Iterable[Path]:
    """glob.glob, but with pathlib's `**`, which does not follow linked folders."""
    parts = Path(pattern).parts
    first = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    if "**" not in parts[first:]:
        return (Path(p) for p in glob.glob(pattern))
    root, rest = Path(*parts[:first]), str(Path(*parts[first:]))
    rest = f"{rest}/*" if parts[-1] == "**" else rest  # pathlib's trailing `**` lists folders only
    hidden = any(part.startswith(".") for part in parts[first:])  # glob.glob skips dot files unless asked
    return (p for p in root.glob(rest) if hidden or not any(q.startswith(".") for q in p.relative_to(root).parts))


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _require(module: str, kind: str) -> ModuleType:
    """An optional dependency, imported when a source first needs it."""
    package = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"sources: kind {kind} needs the {package} package; pip install {package}") from None


def _numbered(rows: Iterable[dict[str, Any]], prefix: str) -> Iterator[Record]:
    """Records `prefix:row N` (1-based); an error of the underlying reader names the row it failed at."""
    num = 0
    try:
        for num, row in enumerate(rows, start=1):
            yield Record(data=row, where=f"{prefix}:row {num}")
    except DataError:
        raise
    except Exception as e:  # third-party readers raise many types (ArrowInvalid, OSError, DatasetsError, ...)
        raise DataError(f"{prefix}:row {num + 1}: cannot read ({_first_line(e)}); check or re-create it") from e


def _open_binary(path: Path) -> IO[bytes]:
    """A file opened for reading bytes; `.gz` is decompressed on the fly."""
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def _lines(path: Path) -> Iterator[tuple[str, bytes]]:
    """(file:line, raw line) of a text file (plain or .gz), streamed; the first line without its UTF-8 BOM."""
    lineno = 0
    try:
        with _open_binary(path) as fh:
            for lineno, raw in enumerate(fh, start=1):
                yield f"{path}:{lineno}", raw.removeprefix(codecs.BOM_UTF8) if lineno == 1 else raw
    except (OSError, EOFError, zlib.error) as e:  # unreadable file, corrupt or truncated gzip
        raise DataError(f"{path}:{lineno + 1}: cannot read ({_first_line(e)}); check or re-create the file") from None


# --------------------------------------------------------------------------------------------------
# jsonl and text


def jsonl_records(path: Path, keep_bad: bool = False) -> Iterator[Record]:
    """JSON objects of a JSON Lines file (plain or .gz), streamed; blank lines skipped; errors name file:line.
    A line that is not a JSON object raises, or with `keep_bad` is a Record carrying the error (prepare's
    on_bad_record decides)."""
    for where, raw in _lines(path):
        if not raw.strip():
            continue
        try:
            record = Record(data=_json_object(_decode(raw, where), where), where=where)
        except DataError as e:
            if not keep_bad:
                raise
            record = Record(data={}, where=where, error=str(e))
        yield record


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON ({e.msg}); fix or remove the line") from None
    except ValueError:  # an integer beyond Python's digit limit
        raise DataError(f"{where}: a number is too large to read; fix or remove the line") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read; flatten or remove the line") from None
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(data).__name__}")
    return data


def read_jsonl(cfg: JsonlSourceConfig, base_dir: Path) -> Iterator[Record]:
    for path in expand_paths(cfg.path, base_dir, "sources.path"):
        yield from jsonl_records(path, keep_bad=True)


def _text_file(path: Path) -> Record:
    try:
        with _open_binary(path) as fh:
            raw = fh.read()
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read ({_first_line(e)}); check or re-create the file") from None
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return Record(data={"text": raw.decode("utf-8")}, where=str(path))
    except UnicodeDecodeError as e:
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def _text_lines(path: Path) -> Iterator[Record]:
    for where, raw in _lines(path):
        text = _decode(raw, where).rstrip("\r\n")
        if text.strip():
            yield Record(data={"text": text}, where=where)


def read_text(cfg: TextSourceConfig, base_dir: Path) -> Iterator[Record]:
    """One record per file, or one per non-empty line (`per_line`), as {"text": ...}."""
    for path in expand_paths(cfg.path, base_dir, "sources.path"):
        if cfg.per_line:
            yield from _text_lines(path)
        else:
            yield _text_file(path)


# --------------------------------------------------------------------------------------------------
# parquet


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    pq = _require("pyarrow.parquet", "parquet")
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
        yield from batch.to_pylist()  # nested columns (struct, list) become dicts and lists


def read_parquet(cfg: ParquetSourceConfig, base_dir: Path) -> Iterator[Record]:
    """Each row of each file (a batch of rows in memory at a time), `file:row N`."""
    for path in expand_paths(cfg.path, base_dir, "sources.path"):
        yield from _numbered(_parquet_rows(path), str(path))


# --------------------------------------------------------------------------------------------------
# npy


def _load_npy(path: Path) -> np.ndarray:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({_first_line(e)}); save it with numpy.save") from None
    if not isinstance(array, np.ndarray):  # an .npz archive
        raise DataError(f"{path}: expected one array saved with numpy.save, got an archive of arrays")
    if not np.issubdtype(array.dtype, np.integer) or array.ndim not in (1, 2):
        raise DataError(
            f"{path}: expected a 1-D or 2-D integer array of token ids, got {array.ndim}-D {array.dtype}; "
            "convert it with numpy.asarray(ids, dtype=numpy.int32)"
        )
    return array


def _npy_ids(row: np.ndarray, where: str, padded: bool) -> list[int]:
    """The ids of a 1-D array or of one row of a 2-D array, whose trailing -1 are padding (`padded`); any other
    negative value is refused with its index (dropping it would silently join the ids around it)."""
    end = len(row)
    if padded:
        kept = np.flatnonzero(row != -1)
        end = int(kept[-1]) + 1 if kept.size else 0
    negative = np.flatnonzero(row[:end] < 0)
    if negative.size:
        i = int(negative[0])
        pads = " (only trailing -1 pad a row)" if padded else ""
        raise DataError(f"{where}: index {i} holds {int(row[i])}, not a token id{pads}; fix the array")
    return row[:end].tolist()


def read_npy(cfg: NpySourceConfig, base_dir: Path) -> Iterator[Record]:
    """A 1-D array is one document; a 2-D array one per row, trailing -1 (padding) dropped."""
    for path in expand_paths(cfg.path, base_dir, "sources.path"):
        array = _load_npy(path)
        if array.ndim == 1:
            yield Record(data={"input_ids": _npy_ids(array, str(path), padded=False)}, where=str(path))
        else:
            rows = ({"input_ids": _npy_ids(row, f"{path}:row {n}", padded=True)} for n, row in enumerate(array, 1))
            yield from _numbered(rows, str(path))


# --------------------------------------------------------------------------------------------------
# hf_dataset


def _import_datasets() -> ModuleType:
    # never download: the variables are read when datasets / huggingface_hub are first imported
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(var, "1")
    return _require("datasets", "hf_dataset")


def _hf_data_files(cfg: HFDatasetSourceConfig, base_dir: Path) -> list[Path]:
    assert cfg.data_files is not None
    return [p for pattern in cfg.data_files for p in expand_paths(pattern, base_dir, "sources.data_files")]


def _hf_folder(cfg: HFDatasetSourceConfig, base_dir: Path) -> Path:
    folder = _resolve(cfg.path, base_dir)
    if not folder.is_dir():
        raise DataError(
            f"sources.path: {folder} is not a folder written by save_to_disk; "
            "to read files with a builder (json, parquet, csv, text) also give data_files"
        )
    return folder


def _hf_from_disk(cfg: HFDatasetSourceConfig, base_dir: Path) -> tuple[Any, str]:
    """The split of a save_to_disk folder (a Dataset is read whole) and the folder's name."""
    datasets = _import_datasets()
    folder = _hf_folder(cfg, base_dir)
    try:
        loaded = datasets.load_from_disk(str(folder))
    except FileNotFoundError as e:
        raise DataError(f"{folder}: not a dataset written by save_to_disk ({_first_line(e)})") from None
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:  # a damaged state.json or dataset_info.json
        raise DataError(
            f"{folder}: a damaged save_to_disk folder ({type(e).__name__}: {_first_line(e)}); save the dataset again"
        ) from None
    if not isinstance(loaded, datasets.DatasetDict):
        _check_single_split(loaded, cfg, folder)
        return loaded, str(folder)
    if cfg.split not in loaded:
        raise DataError(f"{folder}: no split {cfg.split!r}; set split to one of {', '.join(sorted(loaded))}")
    return loaded[cfg.split], str(folder)


def _check_single_split(dataset: Any, cfg: HFDatasetSourceConfig, folder: Path) -> None:
    """A folder of one Dataset holds the split it was saved from (or one without a name): another split is refused,
    not read as that one."""
    split = None if dataset.split is None else str(dataset.split)
    if split is not None and split != cfg.split:
        raise DataError(f"{folder}: no split {cfg.split!r}; it holds one dataset, split {split!r}: set split to it")
    if split is None and "split" in cfg.model_fields_set and cfg.split != "train":
        raise DataError(
            f"{folder}: no split {cfg.split!r}; the folder holds one dataset without split names: leave split unset"
        )


def _hf_from_files(cfg: HFDatasetSourceConfig, base_dir: Path) -> tuple[Any, str]:
    """The data_files as split `split` of builder `path`, streamed, and the builder's name."""
    datasets = _import_datasets()
    files = [str(p) for p in _hf_data_files(cfg, base_dir)]
    try:  # streaming: rows are read lazily from the files, no Arrow copy in the cache
        dataset = datasets.load_dataset(cfg.path, data_files={cfg.split: files}, split=cfg.split, streaming=True)
    except Exception as e:  # an unknown builder name, a missing builder dependency, ...
        raise DataError(
            f"sources.path: load_dataset({cfg.path!r}) failed ({_first_line(e)}); "
            "use a builder such as json, parquet, csv or text"
        ) from e
    return dataset, cfg.path


def read_hf_dataset(cfg: HFDatasetSourceConfig, base_dir: Path) -> Iterator[Record]:
    """Rows of a save_to_disk folder, or of local data_files through a `datasets` builder; never downloads."""
    dataset, name = _hf_from_disk(cfg, base_dir) if cfg.data_files is None else _hf_from_files(cfg, base_dir)
    yield from _numbered(dataset.with_format(None), f"{name}[{cfg.split}]")  # plain Python values, not tensors


# --------------------------------------------------------------------------------------------------
# provenance


def source_files(cfg: Any, base_dir: Path) -> list[Path]:
    """The files a source reads (for provenance hashes)."""
    if isinstance(cfg, HFDatasetSourceConfig):
        if cfg.data_files is not None:
            return _hf_data_files(cfg, base_dir)
        return sorted(p for p in _hf_folder(cfg, base_dir).rglob("*") if p.is_file())
    return expand_paths(cfg.path, base_dir, "sources.path")
