"""Packing: prompt/completion and chat records kept whole in one row by default (best fit), text split
across rows as it comes, the explicit split choice and what preparation reports of both."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import ArrayWriter, open_artifact, token_dtype, validate_artifact
from dllm.data.loader import StepLoader
from dllm.data.prepare import packing, prepare
from dllm.data.prepare.render import Document
from dllm.data.report import stats_rows
from dllm.errors import ConfigError
from dllm.tokenization import ByteTokenizer

TOK = ByteTokenizer()
L = 64


def _digits_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    """Sort or reverse 2-12 digits: records of 13-55 tokens, so that many do not fit a row's remainder."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(2, 12))]
        op = rng.choice(["sort", "reverse"])
        answer = sorted(digits) if op == "sort" else digits[::-1]
        records.append({"prompt": f"{op} {' '.join(digits)} =", "completion": " " + " ".join(answer)})
    return records


def _prepare(root: Path, records: list[dict[str, Any]], fmt: str = "prompt_completion", **values: Any) -> dict:
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    source = {"path": "data.jsonl", "format": fmt}
    if fmt == "prompt_completion":
        source["supervision"] = "completion_only"
    spec_values = {"sources": [source], "output": values.pop("output", "out"), "seq_len": L, **values}
    return prepare(validate_config(PrepareSpec, spec_values, source="prepare.yaml", base_dir=root), root)


def _segments(folder: Path) -> list[tuple[int, int]]:
    """[start, end) of every segment doc_starts marks, in token offsets."""
    art = open_artifact(folder)
    starts = np.asarray(art.array("doc_starts"), dtype=np.int64).tolist()
    return list(zip(starts, [*starts[1:], int(art.manifest["files"]["tokens"]["count"])], strict=True))


def _rendered(record: dict[str, str]) -> tuple[list[int], list[int]]:
    p, c = TOK.encode(record["prompt"]), TOK.encode(record["completion"])
    return [*p, *c, TOK.eos_id], [0] * len(p) + [1] * (len(c) + 1)


def test_default_keeps_completion_only_records_whole_and_split_cuts_them(tmp_path: Path):
    """The default packs every prompt/completion record inside one row and reports 0 split; the explicit
    split choice cuts records at row ends and reports how many, and the supervised tokens it moved."""
    records = _digits_records(300)
    m = _prepare(tmp_path, records)
    assert (m["layout"], m["packing"]) == ("packed", "whole")
    assert m["stats"]["split_across_rows"] == 0 and m["stats"]["split_supervised_tokens"] == 0
    art = validate_artifact(tmp_path / "out")
    tokens, mask = np.asarray(art.array("tokens")).tolist(), np.asarray(art.array("loss_mask")).tolist()
    found = []
    for a, b in _segments(tmp_path / "out"):
        assert a // L == (b - 1) // L, "a segment crosses a row boundary"
        if any(mask[a:b]):
            found.append((tokens[a:b], mask[a:b]))
        else:  # a row's unused tail: padding only, a segment of its own
            assert set(tokens[a:b]) == {TOK.pad_id} and b % L == 0
    assert sorted(found) == sorted(_rendered(r) for r in records)  # every record, whole, exactly once
    padding = sum(b - a for a, b in _segments(tmp_path / "out") if not any(mask[a:b]))
    assert m["stats"]["padding_tokens"] == padding == m["num_sequences"] * L - m["stats"]["tokens"]

    s = _prepare(tmp_path, records, packing="split", output="split")
    assert s["packing"] == "split"
    split_mask = np.asarray(open_artifact(tmp_path / "split").array("loss_mask")).tolist()
    cut = [(a, b) for a, b in _segments(tmp_path / "split") if a // L != (b - 1) // L]
    # the last row's padding joins the last record: a segment ending after the last record is not a cut
    cut = [(a, b) for a, b in cut if any(split_mask[(a // L + 1) * L : b])]
    assert s["stats"]["split_across_rows"] == len(cut) > 0
    moved = sum(sum(split_mask[(a // L + 1) * L : b]) for a, b in cut)
    assert s["stats"]["split_supervised_tokens"] == moved > 0
    assert s["num_sequences"] < m["num_sequences"]  # split packing pads less: what keeping records whole costs
    rows = dict(stats_rows(s))
    assert (rows["packing"], rows["split across rows"]) == ("split", f"{len(cut):,}")


def _layout(tmp_path: Path, seq_len: int) -> packing.Packed:
    writers = [
        ArrayWriter(tmp_path, "tokens", token_dtype(TOK.vocab_size)),
        ArrayWriter(tmp_path, "loss_mask", np.dtype("u1")),
        ArrayWriter(tmp_path, "doc_starts", np.dtype("<u8")),
    ]
    return packing.Packed(seq_len, TOK.pad_id, *writers)


def _doc(n: int, token: int) -> Document:
    return Document([token] * n, [1] * n)


def test_best_fit_puts_a_document_in_the_tightest_open_row(tmp_path: Path):
    """Rows of 10: 6 -> A; 5 -> B (A has 4 left); 4 -> A (tightest; A is full and written); 3 -> B;
    5 -> C; 1 -> B (2 left beats C's 5). Finish writes B then C, each tail a padding segment."""
    lay = _layout(tmp_path, 10)
    for n, t in ((6, 1), (5, 2), (4, 3), (3, 4), (5, 5), (1, 6)):
        assert lay.add(_doc(n, t), whole=True) is False
    lay.finish()
    files = {w: getattr(lay, f"_{w}").close() for w in ("tokens", "mask", "starts")}
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype="<u2").reshape(-1, 10).tolist()
    starts = np.fromfile(tmp_path / "doc_starts.bin", dtype="<u8").tolist()
    P = TOK.pad_id
    assert tokens == [[1] * 6 + [3] * 4, [2] * 5 + [4] * 3 + [6, P], [5] * 5 + [P] * 5]
    assert starts == [0, 6, 10, 15, 18, 19, 20, 25]
    assert (lay.num_sequences, lay.num_padding, lay.num_split_supervised) == (3, 6, 0)
    assert files["tokens"]["count"] == 30


def test_best_fit_window_writes_the_fullest_row_when_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(packing, "MAX_OPEN_ROWS", 2)
    lay = _layout(tmp_path, 10)
    assert lay.open_rows == 2
    for n, t in ((7, 1), (8, 2), (6, 3), (2, 4)):  # the third row closes the fullest (8), the 2 fits the 7's
        lay.add(_doc(n, t), whole=True)
    lay.finish()
    for w in ("tokens", "mask", "starts"):
        getattr(lay, f"_{w}").close()
    P = TOK.pad_id
    tokens = np.fromfile(tmp_path / "tokens.bin", dtype="<u2").reshape(-1, 10).tolist()
    assert tokens == [[2] * 8 + [P] * 2, [1] * 7 + [4] * 2 + [P], [3] * 6 + [P] * 4]


def test_padding_of_a_whole_row_is_its_own_document_in_the_loader(tmp_path: Path):
    _prepare(tmp_path, _digits_records(40))
    art = open_artifact(tmp_path / "out")
    batch = StepLoader(art, global_batch_size=4, micro_batch_size=4, shuffle=False, document_ids=True).next_step()[0]
    for tokens, mask, doc in zip(batch.tokens_BL, batch.loss_mask_BL, batch.doc_ids_BL, strict=True):
        pad = (tokens == TOK.pad_id) & ~mask
        if pad.any():
            first = int(pad.nonzero()[0])
            assert pad[first:].all() and (doc[first:] == doc[first]).all() and doc[first - 1] != doc[first]


def test_text_keeps_being_split_and_a_mixed_artifact_packs_both(tmp_path: Path):
    texts = [{"text": "the cat sees a red ball in the park " * (1 + i % 3)} for i in range(60)]
    t = _prepare(tmp_path, texts, fmt="text", output="text")
    assert t["packing"] == "split" and t["stats"]["split_across_rows"] > 0 and t["stats"]["padding_tokens"] < L
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _digits_records(80)))
    values = {"sources": [{"path": "data.jsonl"}, {"path": "pairs.jsonl", "format": "prompt_completion"}],
              "output": "mixed", "seq_len": L}  # fmt: skip
    spec = validate_config(PrepareSpec, values, source="prepare.yaml", base_dir=tmp_path)
    assert [spec.keeps_whole(s) for s in spec.sources] == [False, True]
    m = prepare(spec, tmp_path)
    assert m["packing"] == "mixed" and m["stats"]["split_across_rows"] == t["stats"]["split_across_rows"]
    mask = np.asarray(open_artifact(tmp_path / "mixed").array("loss_mask")).tolist()
    tokens = np.asarray(open_artifact(tmp_path / "mixed").array("tokens")).tolist()
    prompts = [(a, b) for a, b in _segments(tmp_path / "mixed") if not mask[a] and tokens[a] != TOK.pad_id]
    assert len(prompts) == 80 and all(a // L == (b - 1) // L for a, b in prompts)  # every pair inside one row


def test_packing_rules(tmp_path: Path):
    def spec(**values: Any) -> PrepareSpec:
        data = {"sources": [{"path": "x.jsonl", "format": "prompt_completion"}], "output": "o", "seq_len": 32}
        return validate_config(PrepareSpec, {**data, **values}, source="prepare.yaml", base_dir=tmp_path)

    assert spec().length_limit_of(spec().sources[0]) == 32  # kept whole: a longer record follows overflow
    assert spec(packing="split").length_limit_of(spec().sources[0]) is None
    with pytest.raises(ConfigError, match="max_length 64 exceeds seq_len 32: packing auto keeps each prompt_comp"):
        spec(max_length=64)
    assert spec(max_length=64, packing="split").max_length == 64
    with pytest.raises(ConfigError, match="packing split does not apply to layout indexed"):
        spec(layout="indexed", packing="split")
    with pytest.raises(ConfigError, match=r"must divide the length limit 32 \(seq_len: the longest record kept whole"):
        spec(pad_to_multiple=24)  # a padded record could outgrow its row
    assert spec(pad_to_multiple=24, packing="split").pad_to_multiple == 24
    text = {"sources": [{"path": "x.jsonl"}], "output": "o", "seq_len": 32, "max_length": 64}
    assert validate_config(PrepareSpec, text, source="prepare.yaml", base_dir=tmp_path).packing_mode == "split"


def test_a_record_longer_than_a_row_follows_overflow(tmp_path: Path):
    records = [*_digits_records(5), {"prompt": "sort " + "9 " * 40 + "=", "completion": " 9" * 40}]
    m = _prepare(tmp_path, records)
    assert m["stats"]["rejected"] == 1 and m["stats"]["split_across_rows"] == 0
    m = _prepare(tmp_path, records, overflow="truncate_left", output="cut")
    assert m["stats"]["truncated"] == 1 and m["stats"]["doc_length"]["max"] == L
