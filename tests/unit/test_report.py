"""Data reports: one sample by supervision (both layouts), the statistics table, the length plot."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from rich.text import Text

from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import FORMAT, FORMAT_VERSION, ArrayWriter, Artifact, open_artifact, token_dtype, write_manifest
from dllm.data.prepare import prepare
from dllm.data.report import (
    SPECIAL_STYLE,
    SUPERVISED_STYLE,
    UNSUPERVISED_STYLE,
    histogram_bins,
    num_samples,
    plot_lengths,
    render_sample,
    sample_tokens,
    stats_rows,
    stats_table,
)
from dllm.errors import ConfigError, DataError
from dllm.tokenization import ByteTokenizer
from tests.helpers import write_yaml

TOK = ByteTokenizer()
SUP_SPECIAL = f"{SUPERVISED_STYLE} {SPECIAL_STYLE}"
UNSUP_SPECIAL = f"{UNSUPERVISED_STYLE} {SPECIAL_STYLE}"

# --------------------------------------------------------------------------------------------------
# helpers


def _prompt_completion_artifact(
    root: Path, records: list[dict[str, str]], seq_len: int = 64, layout: str = "packed"
) -> Artifact:
    """An artifact from a prompt_completion JSONL source, built by the real pipeline."""
    data = root / "data" / "pc.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    values = {
        "sources": [{"path": "data/pc.jsonl", "format": "prompt_completion"}],
        "output": "data/pc",
        "seq_len": seq_len,
        "layout": layout,
    }
    prepare(load_config(PrepareSpec, write_yaml(root / "pc.yaml", values)), root)
    return open_artifact(root / "data" / "pc")


def _indexed_artifact(folder: Path, samples: list[tuple[list[int], list[int]]], seq_len: int = 16) -> Artifact:
    """A tiny hand-written artifact in layout indexed: sample i is tokens[doc_starts[i]:doc_starts[i+1]]."""
    folder.mkdir(parents=True)
    tokens = ArrayWriter(folder, "tokens", token_dtype(TOK.vocab_size))
    mask = ArrayWriter(folder, "loss_mask", np.dtype("u1"))
    starts = ArrayWriter(folder, "doc_starts", np.dtype("<u8"))
    for ids, sup in samples:
        starts.write([tokens.count])
        tokens.write(ids)
        mask.write(sup)
    files = {w.name: w.close() for w in (tokens, mask, starts)}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": "indexed",
        "seq_len": seq_len,
        "num_sequences": len(samples),
        "files": files,
        "tokenizer": TOK.identity(),
        "fingerprint": "synthetic",
        "stats": {},
    }
    write_manifest(folder, manifest)
    return open_artifact(folder)


def _enc(text: str, supervised: int) -> tuple[list[int], list[int]]:
    ids = TOK.encode(text)
    return ids, [supervised] * len(ids)


def _pieces(text: Text) -> list[tuple[str, str]]:
    return [(text.plain[s.start : s.end], str(s.style)) for s in text.spans]


def _render_to_str(renderable: Any) -> str:
    buf = io.StringIO()
    Console(file=buf, width=120, color_system=None, force_terminal=False).print(renderable)
    return buf.getvalue()


def _manifest(**stats: Any) -> dict[str, Any]:
    base = {
        "records_read": 1234,
        "records_skipped": 5,
        "documents": 1229,
        "tokens": 40000,
        "supervised_tokens": 30000,
        "padding_tokens": 960,
        "doc_length": {"min": 3, "max": 700, "mean": 32.547},
        "doc_length_histogram": {
            "edges": [0, 16, 32, 64, 128, 256, 512, 1024],
            "counts": [0, 400, 700, 0, 100, 0, 29, 0],
        },
    }
    return {
        "layout": "packed",
        "packing": "split",
        "seq_len": 256,
        "num_sequences": 160,
        "tokenizer": TOK.identity(),
        "stats": base | stats,
    }


# --------------------------------------------------------------------------------------------------
# sample_tokens


def test_sample_tokens_matches_packed_rows(workdir: Path):
    art = open_artifact(workdir / "data" / "prepared")
    tokens, mask = np.asarray(art.array("tokens")), np.asarray(art.array("loss_mask"))
    assert num_samples(art) == art.num_sequences > 1
    for i in (0, 1, art.num_sequences - 1):
        ids, sup = sample_tokens(art, i)
        assert ids.shape == sup.shape == (art.seq_len,)
        np.testing.assert_array_equal(ids, tokens[i * art.seq_len : (i + 1) * art.seq_len])
        np.testing.assert_array_equal(sup, mask[i * art.seq_len : (i + 1) * art.seq_len])
        assert not isinstance(ids, np.memmap)


def test_sample_tokens_indexed_gives_each_sample_unpadded(tmp_path: Path):
    samples = [_enc("ab", 0), _enc("hello!", 1), ([*TOK.encode("日本"), TOK.eos_id], [1] * 7)]
    art = _indexed_artifact(tmp_path / "idx", samples)
    assert num_samples(art) == 3
    for i, (ids, sup) in enumerate(samples):
        got_ids, got_sup = sample_tokens(art, i)
        assert got_ids.tolist() == ids and got_sup.tolist() == sup
    assert render_sample(*sample_tokens(art, 2), TOK).plain == "日本<|eos|>"


def test_sample_tokens_indexed_from_the_pipeline(tmp_path: Path):
    records = [{"prompt": "2+3=", "completion": "5"}, {"prompt": "Übersetze: ", "completion": "日本 café"}]
    try:
        art = _prompt_completion_artifact(tmp_path, records, seq_len=32, layout="indexed")
    except ConfigError:
        pytest.skip("this dllm's prepare does not write layout indexed yet")
    assert num_samples(art) == 2
    texts = [render_sample(*sample_tokens(art, i), TOK) for i in range(2)]
    assert [t.plain for t in texts] == ["2+3=5<|eos|>", "Übersetze: 日本 café<|eos|>"]
    assert [t for t, s in _pieces(texts[1]) if s == SUPERVISED_STYLE] == ["日本 café"]


@pytest.mark.parametrize("index", [-1, 2, 99])
def test_sample_tokens_out_of_range_names_the_valid_range(tmp_path: Path, index: int):
    art = _indexed_artifact(tmp_path / "idx", [_enc("a", 1), _enc("b", 1)])
    with pytest.raises(DataError, match=r"sample -?\d+ is out of range; valid indices are 0\.\.1$") as e:
        sample_tokens(art, index)
    assert "\n" not in str(e.value)


def test_sample_tokens_out_of_range_packed(workdir: Path):
    art = open_artifact(workdir / "data" / "prepared")
    with pytest.raises(DataError, match=rf"valid indices are 0\.\.{art.num_sequences - 1}"):
        sample_tokens(art, art.num_sequences)


def test_sample_tokens_unknown_layout(tmp_path: Path):
    art = _indexed_artifact(tmp_path / "idx", [_enc("a", 1)])
    odd = Artifact(path=art.path, manifest={**art.manifest, "layout": "ragged"})
    with pytest.raises(DataError, match="unknown layout 'ragged'"):
        sample_tokens(odd, 0)


# --------------------------------------------------------------------------------------------------
# render_sample


def test_render_sample_styles_runs_by_supervision_and_names_specials():
    parts = [_enc("Q: café?", 0), _enc("A: ü 日本", 1), ([TOK.eos_id], [1]), ([TOK.pad_id] * 2, [0, 0])]
    ids = np.array([i for p, _ in parts for i in p], dtype=np.uint16)
    sup = np.array([m for _, ms in parts for m in ms], dtype=np.uint8)
    text = render_sample(ids, sup, TOK)
    assert text.plain == TOK.decode(ids.tolist(), skip_special=False) == "Q: café?A: ü 日本<|eos|><|pad|><|pad|>"
    assert _pieces(text) == [
        ("Q: café?", UNSUPERVISED_STYLE),
        ("A: ü 日本", SUPERVISED_STYLE),
        ("<|eos|>", SUP_SPECIAL),
        ("<|pad|><|pad|>", UNSUP_SPECIAL),
    ]


def test_render_sample_decodes_runs_not_tokens():
    calls: list[list[int]] = []

    class Counting(ByteTokenizer):
        def decode(self, ids: list[int], skip_special: bool = True) -> str:
            calls.append(list(ids))
            return super().decode(ids, skip_special)

    ids, sup = _enc("日本日本", 1)
    render_sample(np.array(ids + TOK.encode("x")), np.array(sup + [0]), Counting())
    assert calls == [TOK.encode("日本日本"), TOK.encode("x")]


def test_render_sample_empty():
    assert render_sample(np.array([], dtype=np.uint16), np.array([], dtype=np.uint8), TOK).plain == ""


def test_render_prepared_prompt_completion_row(tmp_path: Path):
    records = [{"prompt": "Übersetze: café ", "completion": "日本 ü"}, {"prompt": "2+3=", "completion": "5"}]
    art = _prompt_completion_artifact(tmp_path, records)
    ids, sup = sample_tokens(art, 0)
    text = render_sample(ids, sup, TOK)
    assert text.plain == TOK.decode(ids.tolist(), skip_special=False)
    assert text.plain.startswith("Übersetze: café 日本 ü<|eos|>2+3=5<|eos|>")
    pieces = _pieces(text)
    assert [t for t, s in pieces if s == UNSUPERVISED_STYLE] == ["Übersetze: café ", "2+3="]
    assert [t for t, s in pieces if s == SUPERVISED_STYLE] == ["日本 ü", "5"]
    assert [t for t, s in pieces if s == SUP_SPECIAL] == ["<|eos|>", "<|eos|>"]
    assert "\ufffd" not in text.plain


# --------------------------------------------------------------------------------------------------
# statistics


def test_stats_table_shows_the_manifest_numbers():
    out = _render_to_str(stats_table(_manifest(rejected=7, truncated=11, split=2)))
    for needle in ("1,234", "1,229", "40,000", "30,000 (75.0% of tokens)", "960 (2.3% of row slots)"):
        assert needle in out
    assert "160 × 256" in out and "3 / 32.547 / 700" in out
    rows = dict(stats_rows(_manifest(rejected=7, truncated=11, split=2)))
    assert (rows["records rejected"], rows["documents truncated"], rows["split by overflow"]) == (
        "7",
        "11",
        "2",
    )
    assert rows["records skipped"] == "5" and rows["layout"] == "packed" and rows["tokenizer"] == "byte (vocab 260)"
    rows = dict(stats_rows(_manifest(split_across_rows=300, split_supervised_tokens=6000)))
    assert (rows["packing"], rows["split across rows"]) == ("split", "300")
    assert rows["supervised after a cut"] == "6,000 (20.0% of supervised)"
    for label, count in (("16–31", "400"), ("32–63", "700"), ("512–1023", "29")):
        line = next(ln for ln in out.splitlines() if f"doc length {label}" in ln)
        assert count in line and "█" in line


def test_stats_rows_tolerate_missing_keys():
    rows = dict(stats_rows({"layout": "packed", "stats": {"records_read": 3}}))
    assert rows["records read"] == "3"
    assert rows["records rejected"] == rows["documents truncated"] == rows["supervised tokens"] == "—"
    assert rows["packing"] == rows["split across rows"] == "—"  # a manifest from before packing modes
    _render_to_str(stats_table({"stats": {}}))  # renders without a histogram


def test_histogram_bins_trim_empty_ends_and_open_last_bin():
    assert histogram_bins(_manifest()) == [("16–31", 400), ("32–63", 700), ("64–127", 0), ("128–255", 100),
                                           ("256–511", 0), ("512–1023", 29)]  # fmt: skip
    tail = _manifest(doc_length_histogram={"edges": [0, 16, 32], "counts": [1, 0, 4]})
    assert histogram_bins(tail) == [("0–15", 1), ("16–31", 0), ("≥ 32", 4)]


def test_stats_table_for_a_prepared_artifact(workdir: Path):
    manifest = open_artifact(workdir / "data" / "prepared").manifest
    out = _render_to_str(stats_table(manifest))
    stats = manifest["stats"]
    assert f"{stats['records_read']:,}" in out and f"{stats['tokens']:,}" in out
    assert f"{manifest['num_sequences']:,} × {manifest['seq_len']}" in out


def test_plot_lengths_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plots" / "lengths.png"
    plot_lengths(_manifest(), out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_lengths_without_a_histogram(tmp_path: Path):
    pytest.importorskip("matplotlib")
    with pytest.raises(DataError, match="no document-length histogram"):
        plot_lengths({"stats": {}}, tmp_path / "x.png")


def test_plot_lengths_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(DataError, match="pip install matplotlib"):
        plot_lengths(_manifest(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
