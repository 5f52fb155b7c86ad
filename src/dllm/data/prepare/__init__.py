"""`dllm data prepare`: sources -> records -> documents (ids + supervision) -> packing -> artifact."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dllm import __version__
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import (
    FORMAT,
    FORMAT_VERSION,
    ArrayWriter,
    fingerprint,
    sha256_file,
    staged_folder,
    token_dtype,
    write_manifest,
)
from dllm.data.prepare.packing import Packer
from dllm.data.prepare.render import render
from dllm.data.prepare.sources import SOURCES, source_files
from dllm.tokenization import build_tokenizer

ProgressFn = Callable[[int, int], None]


def _portable_config(spec: PrepareSpec) -> dict[str, Any]:
    """The preparation config without machine-specific paths (part of the fingerprint)."""
    cfg = spec.model_dump(mode="json")
    cfg.pop("output", None)
    if cfg["tokenizer"].get("path"):
        cfg["tokenizer"]["path"] = Path(cfg["tokenizer"]["path"]).name
    for src in cfg["sources"]:
        src["path"] = Path(src["path"]).name
    return cfg


def prepare(
    spec: PrepareSpec,
    base_dir: Path,
    *,
    output: Path | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> dict[str, Any]:
    """Build the artifact described by `spec`; returns its manifest."""
    tok = build_tokenizer(spec.tokenizer)
    out = Path(output) if output is not None else spec.output
    dtype = token_dtype(tok.vocab_size)
    lengths = LengthStats()
    num_records = num_supervised = 0
    with staged_folder(out, overwrite) as stage:
        writers = {
            "tokens": ArrayWriter(stage, "tokens", dtype),
            "loss_mask": ArrayWriter(stage, "loss_mask", np.dtype("u1")),
            "doc_starts": ArrayWriter(stage, "doc_starts", np.dtype("<u8")),
        }
        packer = Packer(spec.seq_len, tok.pad_id, writers["tokens"], writers["loss_mask"], writers["doc_starts"])
        for src in spec.sources:
            for record in SOURCES.get(src.kind)(src, base_dir):
                doc = render(record, src, tok, spec.add_bos, spec.append_eos, spec.pad_to_multiple)
                packer.add(doc)
                num_records += 1
                num_supervised += sum(doc.loss_mask)
                lengths.add(len(doc.ids))
                if progress is not None:
                    progress(num_records, len(doc.ids))
        packer.finish()
        files = {name: w.close() for name, w in writers.items()}
        portable = _portable_config(spec)
        identity = tok.identity()
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "layout": spec.layout,
            "seq_len": spec.seq_len,
            "num_sequences": packer.num_sequences,
            "files": files,
            "tokenizer": identity,
            "fingerprint": fingerprint(portable, identity, files),
            "prepare_config": portable,
            "provenance": {
                "dllm_version": __version__,
                "sources": [
                    {"file": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                    for src in spec.sources
                    for p in source_files(src, base_dir)
                ],
            },
            "stats": _stats(num_records, lengths, num_supervised, packer.num_padding),
        }
        write_manifest(stage, manifest)
    return manifest


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


def _stats(num_records: int, lengths: LengthStats, num_supervised: int, num_padding: int) -> dict[str, Any]:
    mean = lengths.total / lengths.count if lengths.count else 0.0
    return {
        "records_read": num_records,
        "records_skipped": 0,
        "documents": lengths.count,
        "tokens": lengths.total,
        "supervised_tokens": int(num_supervised),
        "padding_tokens": int(num_padding),
        "doc_length": {"min": lengths.min, "max": lengths.max, "mean": round(mean, 3)},
        "doc_length_histogram": {"edges": list(LengthStats.EDGES), "counts": lengths.hist},
    }
