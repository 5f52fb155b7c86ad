"""What `dllm data inspect` and `dllm data stats` show: one sample, coloured by supervision, and the
manifest statistics as a table or a PNG histogram.

A sample is decoded in runs of tokens with the same supervision (never token by token), so that
multi-byte UTF-8 characters and BPE merges come out as the tokenizer would write them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table
from rich.text import Text

from dllm.data.artifact import Artifact
from dllm.errors import DataError
from dllm.tokenization import Tokenizer

SUPERVISED_STYLE = "bold green"
"""Tokens that are trained on (and noised)."""
UNSUPERVISED_STYLE = "dim"
"""Context tokens: prompts, chat headers, padding."""
SPECIAL_STYLE = "magenta"
"""Special tokens (pad, bos, eos, mask), shown by name; combined with the supervision style."""

_BAR_WIDTH = 24


# --------------------------------------------------------------------------------------------------
# one sample


def num_samples(artifact: Artifact) -> int:
    """Rows of a packed artifact, samples (documents) of an indexed one."""
    layout = artifact.manifest.get("layout", "packed")
    if layout == "packed":
        return artifact.num_sequences
    if layout == "indexed":
        return int(artifact.manifest["files"]["doc_starts"]["count"])
    raise DataError(f"{artifact.path}: unknown layout {layout!r}; this dllm reads packed and indexed")


def _bounds(artifact: Artifact, index: int) -> tuple[int, int]:
    """Offsets [start, end) of sample `index` in the flat `tokens` array."""
    if artifact.manifest.get("layout", "packed") == "packed":
        return index * artifact.seq_len, (index + 1) * artifact.seq_len
    starts = artifact.array("doc_starts")
    end = int(starts[index + 1]) if index + 1 < starts.size else int(artifact.manifest["files"]["tokens"]["count"])
    return int(starts[index]), end


def sample_tokens(artifact: Artifact, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask of row (packed) or sample (indexed) `index`, as in-memory copies."""
    count = num_samples(artifact)
    if not 0 <= index < count:
        valid = f"valid indices are 0..{count - 1}" if count else "the artifact holds no samples"
        raise DataError(f"{artifact.path}: sample {index} is out of range; {valid}")
    start, end = _bounds(artifact, index)
    return np.array(artifact.array("tokens")[start:end]), np.array(artifact.array("loss_mask")[start:end])


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    ids = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.mask_id)
    return sorted({int(i) for i in ids if i is not None})


def _style(supervised: bool, special: bool) -> str:
    base = SUPERVISED_STYLE if supervised else UNSUPERVISED_STYLE
    return f"{base} {SPECIAL_STYLE}" if special else base


def render_sample(tokens: np.ndarray, loss_mask: np.ndarray, tokenizer: Tokenizer) -> Text:
    """The decoded sample: supervised spans in SUPERVISED_STYLE, the rest dim, special tokens by name.

    Each run of tokens with the same (supervised, special) kind is decoded in one call.
    """
    ids = np.asarray(tokens, dtype=np.int64)
    supervised = np.asarray(loss_mask).astype(bool)
    special = np.isin(ids, _special_ids(tokenizer))
    kind = supervised.astype(np.int8) * 2 + special
    cuts = [0, *(np.flatnonzero(np.diff(kind)) + 1).tolist(), ids.size]
    text = Text()
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        if hi > lo:
            piece = tokenizer.decode(ids[lo:hi].tolist(), skip_special=False)
            text.append(piece, style=_style(bool(supervised[lo]), bool(special[lo])))
    return text


# --------------------------------------------------------------------------------------------------
# statistics


def _count(stats: dict[str, Any], key: str) -> str:
    value = stats.get(key)
    return f"{int(value):,}" if value is not None else "—"


def _share(part: Any, whole: Any, of: str) -> str:
    if part is None:
        return "—"
    pct = f" ({100 * part / whole:.1f}% of {of})" if whole else ""
    return f"{int(part):,}{pct}"


def stats_rows(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows of the manifest's statistics; a key an older manifest lacks shows as —."""
    stats = manifest.get("stats", {})
    slots = int(manifest.get("num_sequences", 0)) * int(manifest.get("seq_len", 0))
    lengths = stats.get("doc_length", {})
    tok = manifest.get("tokenizer", {})
    return [
        ("layout", str(manifest.get("layout", "—"))),
        ("packing", str(manifest.get("packing", "—"))),
        ("tokenizer", f"{tok.get('kind', '—')} (vocab {tok.get('vocab_size', '—')})"),
        ("records read", _count(stats, "records_read")),
        ("records skipped", _count(stats, "records_skipped")),
        ("records rejected", _count(stats, "rejected")),
        ("documents truncated", _count(stats, "truncated")),
        ("split by overflow", _count(stats, "split")),
        ("split across rows", _count(stats, "split_across_rows")),
        (
            "supervised after a cut",
            _share(stats.get("split_supervised_tokens"), stats.get("supervised_tokens"), "supervised"),
        ),
        ("documents", _count(stats, "documents")),
        ("tokens", _count(stats, "tokens")),
        ("supervised tokens", _share(stats.get("supervised_tokens"), stats.get("tokens"), "tokens")),
        ("padding tokens", _share(stats.get("padding_tokens"), slots, "row slots")),
        ("rows × seq_len", f"{_count(manifest, 'num_sequences')} × {_count(manifest, 'seq_len')}"),
        ("doc length min / mean / max", " / ".join(str(lengths.get(k, "—")) for k in ("min", "mean", "max"))),
    ]


def histogram_bins(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    """(length range, documents) per histogram bin, without the empty bins at either end.

    Bin i holds lengths in [edges[i], edges[i+1]); a last bin without an upper edge is open.
    """
    hist = manifest.get("stats", {}).get("doc_length_histogram")
    if not hist or not hist.get("counts"):
        return []
    edges, counts = [int(e) for e in hist["edges"]], [int(c) for c in hist["counts"]]
    labels = [f"{lo}–{edges[i + 1] - 1}" if i + 1 < len(edges) else f"≥ {lo}" for i, lo in enumerate(edges)]
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return []
    return [(labels[i], counts[i]) for i in range(used[0], used[-1] + 1)]


def _bar(count: int, largest: int) -> str:
    if not count:
        return ""
    return "█" * max(1, round(_BAR_WIDTH * count / largest))


def stats_table(manifest: dict[str, Any]) -> Table:
    """The statistics, then the document-length histogram as rows with a text bar."""
    table = Table(title="artifact statistics", show_header=False, title_justify="left")
    table.add_column("statistic", style="bold")
    table.add_column("value", justify="right")
    table.add_column("bar", style="cyan")
    for label, value in stats_rows(manifest):
        table.add_row(label, value, "")
    bins = histogram_bins(manifest)
    if bins:
        table.add_section()
        largest = max(c for _, c in bins)
        for label, count in bins:
            table.add_row(f"doc length {label}", f"{count:,}", _bar(count, largest))
    return table


def plot_lengths(manifest: dict[str, Any], path: Path) -> None:
    """Write a PNG bar chart of the document-length histogram (needs matplotlib)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DataError("plotting document lengths needs matplotlib: pip install matplotlib") from None
    bins = histogram_bins(manifest)
    if not bins:
        raise DataError("the manifest has no document-length histogram; re-run `dllm data prepare --overwrite`")
    # the object API with an explicit Agg canvas: no pyplot, no global backend switch
    fig = Figure(figsize=(8, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.bar([label for label, _ in bins], [count for _, count in bins], color="tab:green")
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("documents")
    ax.set_title(f"document lengths ({sum(c for _, c in bins):,} documents)")
    ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(Path(path), format="png")
