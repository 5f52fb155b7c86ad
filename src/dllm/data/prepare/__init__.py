"""`dllm data prepare`: sources -> records -> documents (ids + supervision) -> length -> layout -> artifact.

Records are read in order in this process; rendering (tokenization) runs here or in N worker
processes, with results consumed in input order, so the artifact is the same bytes whatever N is.
At most a few chunks are in flight, so memory stays flat however large the input is.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dllm import __version__
from dllm.config.base import output_folder_problem
from dllm.config.prepare import PrepareSpec
from dllm.config.registries import LAYOUTS, SOURCES
from dllm.data.artifact import (
    ARTIFACT,
    FORMAT,
    FORMAT_VERSION,
    ArrayWriter,
    fingerprint,
    sha256_file,
    token_dtype,
    write_manifest,
)
from dllm.data.prepare.packing import Layout
from dllm.data.prepare.render import Document, fit_length, pad_to_multiple, render, text_chars
from dllm.data.prepare.sources import Record, SourceReader, source_files
from dllm.errors import DataError
from dllm.staging import staged_folder
from dllm.tokenization import Tokenizer, build_tokenizer, max_chars_per_token

ProgressFn = Callable[[int, int], None]
CHUNK = 256  # records per task sent to a worker


@dataclass
class Outcome:
    """What became of one record."""

    pieces: list[Document]
    status: str  # ok | truncated | split | rejected | skipped
    length: int = 0
    error: str = ""
    whole: bool = False  # each piece is kept in one row (PrepareSpec.keeps_whole)
    empty_at: str = ""  # where the record was, when it held no token of its own (its document: BOS/EOS only)


def process_record(record: Record, src: Any, spec: PrepareSpec, tok: Tokenizer, max_chars: int | None) -> Outcome:
    whole = spec.keeps_whole(src)
    if max_chars is not None and record.error is None and text_chars(record, src) > max_chars:
        return Outcome([], "rejected", whole=whole)  # cannot fit the limit: never tokenized (a 50 MB line took 3 GB)
    try:
        if record.error is not None:  # a line that is not a JSON object
            raise DataError(record.error)
        doc = render(record, src, tok, spec.add_bos, spec.append_eos)
    except DataError as e:
        if spec.on_bad_record == "fail":
            raise
        return Outcome([], "skipped", error=str(e), whole=whole)
    specials = {tok.bos_id, tok.eos_id}
    empty_at = record.where if all(t in specials for t in doc.ids) else ""  # no text, no ids: BOS/EOS only
    pieces = fit_length(doc, spec.length_limit_of(src), spec.overflow)
    if not pieces:
        status = "rejected"
    elif len(pieces) > 1:
        status = "split"
    else:
        status = "ok" if len(pieces[0]) == len(doc) else "truncated"
    pieces = [pad_to_multiple(p, spec.pad_to_multiple, tok.eos_id) for p in pieces]
    return Outcome(pieces, status, len(doc), whole=whole, empty_at=empty_at)


# -- worker processes: each builds its tokenizer once ------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(spec: PrepareSpec, max_chars: list[int | None]) -> None:
    _WORKER["spec"] = spec
    _WORKER["tok"] = build_tokenizer(spec.tokenizer)
    _WORKER["max_chars"] = max_chars


def _process_chunk(chunk: list[tuple[int, Record]]) -> list[Outcome]:
    spec, tok, max_chars = _WORKER["spec"], _WORKER["tok"], _WORKER["max_chars"]
    return [process_record(rec, spec.sources[i], spec, tok, max_chars[i]) for i, rec in chunk]


def max_text_chars(spec: PrepareSpec, tok: Tokenizer) -> list[int | None]:
    """Per source, the most characters a record may hold and still fit its length limit, when overflow
    is reject (None: no limit): tokenization.max_chars_per_token per token of the limit."""
    limits = [spec.length_limit_of(src) if spec.overflow == "reject" else None for src in spec.sources]
    if all(limit is None for limit in limits):
        return limits
    per_token = max_chars_per_token(tok)
    return [None if limit is None else limit * per_token for limit in limits]


def _chunks(spec: PrepareSpec, base_dir: Path) -> Iterator[list[tuple[int, Record]]]:
    chunk: list[tuple[int, Record]] = []
    for i, src in enumerate(spec.sources):
        read: SourceReader = SOURCES.resolve(src.kind)
        for record in read(src, base_dir):
            chunk.append((i, record))
            if len(chunk) == CHUNK:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _ordered_map(fn: Callable, items: Iterable, pool: Any, ahead: int) -> Iterator:
    """pool.imap with at most `ahead` tasks in flight (imap itself reads its input eagerly)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def outcomes(spec: PrepareSpec, base_dir: Path, tok: Tokenizer, workers: int) -> Iterator[Outcome]:
    chunks = _chunks(spec, base_dir)
    max_chars = max_text_chars(spec, tok)
    if workers <= 1:
        for chunk in chunks:
            yield from (process_record(rec, spec.sources[i], spec, tok, max_chars[i]) for i, rec in chunk)
        return
    ctx = mp.get_context("spawn" if os.name == "nt" else "fork")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(spec, max_chars)) as pool:
        for results in _ordered_map(_process_chunk, chunks, pool, ahead=4 * workers):
            yield from results


# -- statistics --------------------------------------------------------------------------------------
class LengthStats:
    """Running document-length statistics (constant memory)."""

    EDGES = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

    def __init__(self) -> None:
        self.count = self.total = 0
        self.min = self.max = 0
        self.hist = [0] * len(self.EDGES)

    def add(self, n: int) -> None:
        self.min = n if self.count == 0 else min(self.min, n)
        self.max = max(self.max, n)
        self.count += 1
        self.total += n
        self.hist[bisect.bisect_right(self.EDGES, n) - 1] += 1


@dataclass
class PrepareStats:
    counts: collections.Counter = field(default_factory=collections.Counter)
    lengths: LengthStats = field(default_factory=LengthStats)
    supervised: int = 0
    skip_examples: list[str] = field(default_factory=list)
    empty_examples: list[str] = field(default_factory=list)

    def add(self, out: Outcome, cut: bool) -> None:
        """One record's outcome; `cut`: a row boundary fell inside one of its pieces."""
        self.counts["records_read"] += 1
        self.counts[out.status] += 1
        self.counts["split_across_rows"] += cut
        if out.error and len(self.skip_examples) < 5:
            self.skip_examples.append(out.error)
        self.counts["empty"] += bool(out.empty_at)
        self.counts["documents_with_tokens"] += 0 if out.empty_at else len(out.pieces)
        if out.empty_at and len(self.empty_examples) < 5:
            self.empty_examples.append(out.empty_at)
        for piece in out.pieces:
            self.lengths.add(len(piece))
            self.supervised += sum(piece.loss_mask)

    def to_dict(self, layout: Layout) -> dict[str, Any]:
        L = self.lengths
        return {
            "records_read": self.counts["records_read"],
            "records_skipped": self.counts["skipped"],
            "rejected": self.counts["rejected"],
            "truncated": self.counts["truncated"],
            "split": self.counts["split"],
            "split_across_rows": self.counts["split_across_rows"],
            "split_supervised_tokens": layout.num_split_supervised,
            "skip_examples": self.skip_examples,
            "records_empty": self.counts["empty"],
            "empty_examples": self.empty_examples,
            "documents": L.count,
            "tokens": L.total,
            "supervised_tokens": self.supervised,
            "padding_tokens": layout.num_padding,
            "rows": layout.num_sequences,
            "doc_length": {"min": L.min, "max": L.max, "mean": round(L.total / L.count, 3) if L.count else 0.0},
            "doc_length_histogram": {"edges": list(LengthStats.EDGES), "counts": L.hist},
        }


# -- the artifact ------------------------------------------------------------------------------------
def _check_not_all_empty(stats: PrepareStats, out: Path) -> None:
    """Empty records (no text, `input_ids: []`, an empty file) become EOS-only documents, which `dllm data prepare`
    warns of; an artifact of nothing else would train a model to write EOS and nothing: refused, nothing written."""
    empty = stats.counts["empty"]
    if empty and not stats.counts["documents_with_tokens"]:
        raise DataError(f"{stats.empty_examples[0]}: all {empty:,} records kept are empty (no text or token ids), so "
                        f"{out} would hold only EOS; nothing written: check the sources and their fields")  # fmt: skip


def _portable_config(spec: PrepareSpec) -> dict[str, Any]:
    """The preparation config without machine-specific paths (part of the fingerprint)."""
    cfg = spec.model_dump(mode="json")
    cfg.pop("output", None)
    if cfg["tokenizer"].get("path"):
        cfg["tokenizer"]["path"] = Path(cfg["tokenizer"]["path"]).name
    for src in cfg["sources"]:
        src["path"] = Path(src["path"]).name
        if src.get("data_files"):
            src["data_files"] = [Path(p).name for p in src["data_files"]]
    return cfg


def _relative(path: Path, base_dir: Path) -> str:
    try:
        return path.resolve().relative_to(base_dir.resolve()).as_posix()
    except ValueError:  # outside the config folder: the name is all that is portable
        return path.name


def _provenance(spec: PrepareSpec, base_dir: Path) -> dict[str, Any]:
    files = [
        {"file": _relative(p, base_dir), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for src in spec.sources
        for p in source_files(src, base_dir)
    ]
    return {"dllm_version": __version__, "sources": files}


def _inputs(spec: PrepareSpec, base_dir: Path) -> list[Path]:
    """What replacing the output must never delete: the config's folder, the tokenizer and every source file."""
    paths = [base_dir, *(p for src in spec.sources for p in source_files(src, base_dir))]
    return [*paths, spec.tokenizer.path] if isinstance(spec.tokenizer.path, Path) else paths  # a hub id: none


def prepare(
    spec: PrepareSpec,
    base_dir: Path,
    *,
    output: Path | None = None,
    overwrite: bool = False,
    workers: int = 1,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Build the artifact described by `spec`; returns its manifest."""
    out = Path(output) if output is not None else spec.output
    problem = output_folder_problem(out)  # the config's output was checked when read, --output is checked here
    if problem is not None:
        raise DataError(f"--output: {problem}")
    tok = build_tokenizer(spec.tokenizer)
    stats = PrepareStats()
    with (
        staged_folder(out, ARTIFACT, overwrite, keep=_inputs(spec, base_dir)) as stage,
        contextlib.ExitStack() as closing,
    ):
        writers = {
            "tokens": ArrayWriter(stage, "tokens", token_dtype(tok.vocab_size)),
            "loss_mask": ArrayWriter(stage, "loss_mask", np.dtype("u1")),
            "doc_starts": ArrayWriter(stage, "doc_starts", np.dtype("<u8")),
        }
        for w in writers.values():  # closed before the stage is removed or published, whatever happens
            closing.callback(w.discard)
        layout_cls: type[Layout] = LAYOUTS.resolve(spec.layout)
        layout = layout_cls(spec.seq_len, tok.pad_id, *writers.values())
        for outcome in outcomes(spec, base_dir, tok, workers):
            cuts = [layout.add(piece, outcome.whole) for piece in outcome.pieces]
            stats.add(outcome, any(cuts))
            if progress is not None:
                progress(stats.counts["records_read"], sum(len(p) for p in outcome.pieces))
        _check_not_all_empty(stats, out)
        layout.finish()
        if layout.num_sequences == 0:
            raise DataError(f"{out}: no document survived preparation; check the sources, max_length and overflow")
        files = {name: w.close() for name, w in writers.items()}
        portable = _portable_config(spec)
        identity = tok.identity()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": spec.layout,
            "packing": spec.packing_mode,
            "seq_len": spec.seq_len,
            "num_sequences": layout.num_sequences,
            "files": files,
            "tokenizer": identity,
            "fingerprint": fingerprint(portable, identity, files),
            "prepare_config": portable,
            "provenance": _provenance(spec, base_dir),
            "stats": stats.to_dict(layout),
        }
        if isinstance(spec.tokenizer.path, Path):  # not a hub id
            # relative, so that the artifact and its tokenizer can move together
            manifest["tokenizer_path"] = os.path.relpath(spec.tokenizer.path, out.absolute())
        write_manifest(stage, manifest)
    return manifest
