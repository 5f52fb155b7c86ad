"""Preparation frontend: record formats, supervision, length policies, layouts, workers, bad records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.data import prepare as prepare_pkg
from dllm.data.artifact import open_artifact, validate_artifact
from dllm.data.loader import StepLoader
from dllm.data.prepare import prepare
from dllm.errors import ConfigError, DataError
from dllm.tokenization import ByteTokenizer

TOK = ByteTokenizer()
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3 + 3?"},
    {"role": "assistant", "content": "6"},
]


def _jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path.name


def _spec(root: Path, sources: list[dict[str, Any]], **values: Any) -> PrepareSpec:
    data = {"sources": sources, "output": "out", "seq_len": 64, **values}
    return validate_config(PrepareSpec, data, source="prepare.yaml", base_dir=root)


def _docs(root: Path, folder: str = "out") -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every document / sample of an artifact, in order (the padding that ends a row of
    whole packing is a segment of its own: left out)."""
    art = open_artifact(root / folder)
    tokens, mask = np.asarray(art.array("tokens")), np.asarray(art.array("loss_mask"))
    starts = np.asarray(art.array("doc_starts")).tolist() + [len(tokens)]
    docs = [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, starts[1:], strict=False)]
    return [(ids, m) for ids, m in docs if any(m) or set(ids) != {TOK.pad_id}]


def _strip_padding(doc: tuple[list[int], list[int]]) -> tuple[list[int], list[int]]:
    ids, mask = doc
    n = len(ids)
    while n and ids[n - 1] == TOK.pad_id:
        n -= 1
    return ids[:n], mask[:n]


# -- record formats and supervision -----------------------------------------------------------------


@pytest.mark.parametrize("supervision", ["auto", "full"])
def test_messages_assistant_spans_from_the_template(tmp_path: Path, supervision: str):
    name = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])  # 73 tokens: kept whole in a row of 128
    source = {"path": name, "format": "messages", "supervision": supervision}
    prepare(_spec(tmp_path, [source], seq_len=128), tmp_path)
    ids, mask = _strip_padding(_docs(tmp_path)[0])
    enc = TOK.apply_chat_template(CHAT)
    assert ids == enc.ids  # the template already ends with EOS: no second one is appended
    assert mask == (enc.assistant_mask if supervision == "auto" else [1] * len(ids))
    supervised = TOK.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special=False)
    assert supervised == ("4<|eos|>6<|eos|>" if supervision == "auto" else TOK.decode(ids, skip_special=False))


def test_prompt_completion_with_chat_turns(tmp_path: Path):
    prompt, completion = CHAT[:2], [CHAT[2]]
    name = _jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}])
    prepare(_spec(tmp_path, [{"path": name, "format": "prompt_completion"}]), tmp_path)
    ids, mask = _strip_padding(_docs(tmp_path)[0])
    p_ids = TOK.apply_chat_template(prompt, add_generation_prompt=True).ids
    assert ids == TOK.apply_chat_template(prompt + completion).ids
    assert mask == [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))
    assert TOK.decode(ids[len(p_ids) :], skip_special=False) == "4<|eos|>"


def test_tokens_with_labels_and_loss_mask(tmp_path: Path):
    records = [
        {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
        {"input_ids": [9, 10], "labels": [9, -100]},
    ]
    a = _jsonl(tmp_path / "a.jsonl", records)
    b = _jsonl(tmp_path / "b.jsonl", [{"ids": [1, 2, 3], "m": [1, 0, 1]}])
    sources = [
        {"path": a, "format": "tokens", "labels_field": "labels"},
        {"path": b, "format": "tokens", "input_ids_field": "ids", "loss_mask_field": "m"},
    ]
    m = prepare(_spec(tmp_path, sources, append_eos=False), tmp_path)
    docs = [_strip_padding(d) for d in _docs(tmp_path)]
    assert docs == [([5, 6, 7, 8], [0, 0, 1, 1]), ([9, 10], [1, 0]), ([1, 2, 3], [1, 0, 1])]
    assert m["stats"]["supervised_tokens"] == 5


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"input_ids": [1, 999]}, r"must be a list of ids in \[0, 260\)"),
        ({"input_ids": [1, 2], "labels": [1]}, "must be a list as long as"),
        ({"input_ids": "abc", "labels": [1]}, "must be a list of ids"),
    ],
)
def test_bad_token_records_name_the_line(tmp_path: Path, record: dict, message: str):
    name = _jsonl(tmp_path / "t.jsonl", [{"input_ids": [1], "labels": [1]}, record])
    spec = _spec(tmp_path, [{"path": name, "format": "tokens", "labels_field": "labels"}])
    with pytest.raises(DataError, match=rf"t\.jsonl:2: .*{message}"):
        prepare(spec, tmp_path)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ({"format": "text", "supervision": "assistant_only"}, "does not apply to format text"),
        ({"format": "messages", "supervision": "completion_only"}, "use assistant_only or full"),
        ({"format": "tokens", "supervision": "provided"}, "provided needs labels_field or loss_mask_field"),
        ({"format": "tokens", "labels_field": "l", "loss_mask_field": "m"}, "not both"),
        ({"kind": "text", "format": "messages"}, "a text source has format text"),
    ],
)
def test_supervision_rules(tmp_path: Path, source: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        _spec(tmp_path, [{"path": "x.jsonl", **source}])


def test_source_kind_is_inferred_from_the_suffix(tmp_path: Path):
    spec = _spec(tmp_path, [{"path": "a.parquet"}, {"path": "b.txt"}, {"path": "c.npy", "format": "tokens"},
                            {"path": "d.jsonl.gz"}, {"path": "e"}])  # fmt: skip
    assert [s.kind for s in spec.sources] == ["parquet", "text", "npy", "jsonl", "jsonl"]


# -- length policies ---------------------------------------------------------------------------------

LONG = "abcdefghijklmnopqrstuvwxyz"  # 26 bytes + EOS = 27 tokens


@pytest.mark.parametrize("overflow", ["reject", "truncate_left", "truncate_right", "split"])
def test_overflow_policies(tmp_path: Path, overflow: str):
    name = _jsonl(tmp_path / "t.jsonl", [{"text": "short"}, {"text": LONG}])
    m = prepare(_spec(tmp_path, [{"path": name}], max_length=10, overflow=overflow), tmp_path)
    docs = [TOK.decode(_strip_padding(d)[0], skip_special=False) for d in _docs(tmp_path)]
    long_ids = [*TOK.encode(LONG), TOK.eos_id]
    expected = {
        "reject": [],
        "truncate_right": [TOK.decode(long_ids[:10], skip_special=False)],
        "truncate_left": [TOK.decode(long_ids[-10:], skip_special=False)],
        "split": [TOK.decode(long_ids[i : i + 10], skip_special=False) for i in range(0, 27, 10)],
    }[overflow]
    assert docs == ["short<|eos|>", *expected]
    stats = m["stats"]
    assert stats["records_read"] == 2
    assert stats["rejected"] == (overflow == "reject")
    assert stats["truncated"] == overflow.startswith("truncate")
    assert stats["split"] == (overflow == "split")
    assert stats["doc_length"]["max"] <= 10


def test_pad_to_multiple_must_divide_the_limit(tmp_path: Path):
    with pytest.raises(ConfigError, match="pad_to_multiple 16 must divide the length limit 40"):
        _spec(tmp_path, [{"path": "x.jsonl"}], max_length=40, pad_to_multiple=16)


# -- layouts -----------------------------------------------------------------------------------------


def test_indexed_layout_and_its_loader(tmp_path: Path):
    pairs = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(12)]
    pairs.append({"prompt": "x" * 40, "completion": "y"})  # longer than seq_len: rejected
    name = _jsonl(tmp_path / "pc.jsonl", pairs)
    spec = _spec(tmp_path, [{"path": name, "format": "prompt_completion"}], seq_len=16, layout="indexed")
    m = prepare(spec, tmp_path)
    assert m["layout"] == "indexed" and m["num_sequences"] == 12 and m["stats"]["rejected"] == 1
    lengths = [len(ids) for ids, _ in _docs(tmp_path)]
    assert m["stats"]["padding_tokens"] == sum(16 - n for n in lengths)
    art = validate_artifact(tmp_path / "out")
    loader = StepLoader(art, global_batch_size=4, micro_batch_size=4, shuffle=False)
    batch = loader.next_step()[0]
    for row, (ids, mask) in enumerate(_docs(tmp_path)[:4]):
        n = len(ids)
        assert batch.tokens_BL[row, :n].tolist() == ids and batch.loss_mask_BL[row, :n].long().tolist() == mask
        assert (batch.tokens_BL[row, n:] == TOK.pad_id).all() and not batch.loss_mask_BL[row, n:].any()
        # padding is its own "document": no attention between the sample and its padding
        assert (batch.doc_ids_BL[row, :n] == 0).all() and (batch.doc_ids_BL[row, n:] == 1).all()


def test_indexed_rules(tmp_path: Path):
    with pytest.raises(ConfigError, match="max_length 32 exceeds seq_len 16"):
        _spec(tmp_path, [{"path": "x.jsonl"}], seq_len=16, layout="indexed", max_length=32)
    with pytest.raises(ConfigError, match="overflow split does not apply to layout indexed"):
        _spec(tmp_path, [{"path": "x.jsonl"}], layout="indexed", overflow="split")


def test_nothing_left_is_an_error(tmp_path: Path):
    name = _jsonl(tmp_path / "t.jsonl", [{"text": LONG}])
    with pytest.raises(DataError, match="no document survived"):
        prepare(_spec(tmp_path, [{"path": name}], max_length=8), tmp_path)
    assert not (tmp_path / "out").exists()


# -- workers, bad records ----------------------------------------------------------------------------


def test_workers_give_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(prepare_pkg, "CHUNK", 7)  # many chunks in flight even for a small input
    records = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(150)]
    name = _jsonl(tmp_path / "pc.jsonl", records)
    spec = _spec(tmp_path, [{"path": name, "format": "prompt_completion"}], seq_len=32)
    prepare(spec, tmp_path, output=tmp_path / "one", workers=1)
    prepare(spec, tmp_path, output=tmp_path / "three", workers=3)
    for f in ("tokens.bin", "loss_mask.bin", "doc_starts.bin", "manifest.json"):
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "three" / f).read_bytes(), f


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_records_skip_or_fail(tmp_path: Path, workers: int):
    records = [{"text": "good"}, {"body": "no text field"}, {"text": 7}, {"text": "also good"}]
    name = _jsonl(tmp_path / "t.jsonl", records)
    skip = _spec(tmp_path, [{"path": name}], on_bad_record="skip")
    m = prepare(skip, tmp_path, workers=workers)
    assert m["stats"]["records_read"] == 4 and m["stats"]["records_skipped"] == 2
    assert m["stats"]["documents"] == 2
    assert "t.jsonl:2: record has no field 'text'" in m["stats"]["skip_examples"][0]
    fail = _spec(tmp_path, [{"path": name}], output="out2")
    with pytest.raises(DataError, match=r"t\.jsonl:2: record has no field 'text'; set text_field"):
        prepare(fail, tmp_path, workers=workers)
    assert not (tmp_path / "out2").exists()
