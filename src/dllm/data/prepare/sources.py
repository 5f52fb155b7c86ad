"""Sources: where records come from. Each yields (record, location) pairs in a fixed order."""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dllm.config.prepare import JsonlSourceConfig
from dllm.errors import DataError
from dllm.registry import Registry


@dataclass(frozen=True)
class Record:
    """One input record and where it came from (for error messages and provenance)."""

    data: dict[str, Any]
    where: str


SourceReader = Callable[[Any, Path], Iterator[Record]]
SOURCES: Registry[SourceReader] = Registry("source")


def expand_paths(pattern: str, base_dir: Path, field: str) -> list[Path]:
    """Sorted files matching a path or glob relative to `base_dir`; an empty match is an error."""
    full = pattern if Path(pattern).is_absolute() else str(base_dir / pattern)
    matches = sorted(Path(p) for p in glob.glob(full, recursive=True) if Path(p).is_file())
    if not matches:
        raise DataError(f"{field}: no file matches {pattern!r} (looked in {base_dir})")
    return matches


def jsonl_records(path: Path) -> Iterator[Record]:
    """JSON objects of a JSON Lines file, streamed; blank lines skipped; errors name file:line."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg}); fix or remove the line") from None
            if not isinstance(data, dict):
                raise DataError(f"{where}: expected a JSON object per line, got {type(data).__name__}")
            yield Record(data=data, where=where)


@SOURCES.register("jsonl")
def read_jsonl(cfg: JsonlSourceConfig, base_dir: Path) -> Iterator[Record]:
    for path in expand_paths(cfg.path, base_dir, "sources.path"):
        yield from jsonl_records(path)


def source_files(cfg: Any, base_dir: Path) -> list[Path]:
    """The files a source reads (for provenance hashes)."""
    return expand_paths(cfg.path, base_dir, "sources.path")
