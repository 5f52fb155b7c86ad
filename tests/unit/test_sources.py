"""Sources: every kind yields its records in a fixed order with file:line / file:row locations, reads
.gz transparently, names the file in its errors, and lists the files it reads (provenance)."""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dllm.config.prepare import (
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    NpySourceConfig,
    ParquetSourceConfig,
    TextSourceConfig,
)
from dllm.config.registries import SOURCES
from dllm.data.prepare.sources import Record, jsonl_records, source_files
from dllm.errors import DataError


def _read(cfg: Any, base_dir: Path) -> list[Record]:
    return list(SOURCES.resolve(cfg.kind)(cfg, base_dir))


def _jsonl_bytes(rows: list[Any]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)
    return path


@pytest.fixture
def pq():
    return pytest.importorskip("pyarrow.parquet")


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # no network, whatever the caller's environment
        monkeypatch.setenv(var, "1")
    return pytest.importorskip("datasets")


def test_every_kind_is_registered():
    assert sorted(SOURCES.names()) == ["hf_dataset", "jsonl", "npy", "parquet", "text"]


# --------------------------------------------------------------------------------------------------
# jsonl


def test_jsonl_reads_plain_and_gz_in_sorted_order(tmp_path: Path):
    b = _write(tmp_path / "d" / "b.jsonl.gz", _jsonl_bytes([{"text": "b0"}]) + b"\n" + _jsonl_bytes([{"text": "b1"}]))
    a = _write(tmp_path / "d" / "a.jsonl", _jsonl_bytes([{"text": "a0", "meta": {"n": 1}}]))
    records = _read(JsonlSourceConfig(path="d/*"), tmp_path)
    assert [r.data for r in records] == [{"text": "a0", "meta": {"n": 1}}, {"text": "b0"}, {"text": "b1"}]
    assert [r.where for r in records] == [f"{a}:1", f"{b}:1", f"{b}:3"]  # the blank line 2 is skipped
    assert [r.data for r in jsonl_records(b)] == [{"text": "b0"}, {"text": "b1"}]
    assert source_files(JsonlSourceConfig(path="d/*"), tmp_path) == [a, b]


def test_jsonl_gz_streams_and_bad_json_names_file_line(tmp_path: Path):
    path = _write(tmp_path / "c.jsonl.gz", _jsonl_bytes([{"text": "ok"}]) + b'{"text": \n')
    records = jsonl_records(path)
    assert next(records).data == {"text": "ok"}  # read before the bad line is reached
    with pytest.raises(DataError, match=rf"^{path}:2: invalid JSON \(.*\); fix or remove the line$"):
        next(records)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"text": "\xff"}\n', r":1: not valid UTF-8 \(byte 10\)"),
        (b"[1, 2]\n", r":1: expected a JSON object per line, got list"),
    ],
)
def test_jsonl_bad_lines_name_file_line(tmp_path: Path, data: bytes, message: str):
    path = _write(tmp_path / "x.jsonl.gz", data)
    with pytest.raises(DataError, match=f"^{path}{message}"):
        list(jsonl_records(path))


def test_jsonl_corrupt_gz_is_a_data_error(tmp_path: Path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(_jsonl_bytes([{"text": "x" * 100}] * 50), mtime=0)[:-30])  # truncated
    with pytest.raises(DataError, match=rf"^{path}:\d+: cannot read \(EOFError: .*\); check or re-create"):
        list(jsonl_records(path))


@pytest.mark.parametrize(
    "cfg",
    [
        JsonlSourceConfig(path="none/*.jsonl"),
        ParquetSourceConfig(path="none/*.jsonl"),
        TextSourceConfig(path="none/*.jsonl"),
        NpySourceConfig(path="none/*.jsonl", format="tokens"),
    ],
)
def test_glob_without_match_names_the_field(tmp_path: Path, cfg: Any):
    message = rf"^sources.path: no file matches 'none/\*.jsonl' \(looked in {tmp_path}\)$"
    with pytest.raises(DataError, match=message):
        _read(cfg, tmp_path)
    with pytest.raises(DataError, match=message):
        source_files(cfg, tmp_path)


# --------------------------------------------------------------------------------------------------
# text


def test_text_one_record_per_file(tmp_path: Path):
    b = _write(tmp_path / "b.txt", b"second\n\nfile")
    a = _write(tmp_path / "a.txt", b"first file\n")
    records = _read(TextSourceConfig(path="*.txt"), tmp_path)
    assert [(r.data, r.where) for r in records] == [
        ({"text": "first file\n"}, str(a)),
        ({"text": "second\n\nfile"}, str(b)),
    ]
    assert source_files(TextSourceConfig(path="*.txt"), tmp_path) == [a, b]


def test_text_per_line_skips_blank_lines(tmp_path: Path):
    path = _write(tmp_path / "lines.txt", b"one\r\n\n  \n two \nlast")
    records = _read(TextSourceConfig(path="lines.txt", per_line=True), tmp_path)
    assert [r.data["text"] for r in records] == ["one", " two ", "last"]
    assert [r.where for r in records] == [f"{path}:1", f"{path}:4", f"{path}:5"]


@pytest.mark.parametrize("per_line", [False, True])
def test_text_invalid_utf8_names_file_line(tmp_path: Path, per_line: bool):
    path = _write(tmp_path / "bad.txt", b"fine\nstill fine\nbad \xc3\x28 here\n")
    with pytest.raises(DataError, match=rf"^{path}:3: not valid UTF-8 \(byte \d+\); re-encode the file as UTF-8$"):
        _read(TextSourceConfig(path="bad.txt", per_line=per_line), tmp_path)


# --------------------------------------------------------------------------------------------------
# parquet


def test_parquet_rows_across_row_groups_and_files(tmp_path: Path, pq):
    import pyarrow as pa

    rows = [{"text": f"t{i}", "meta": {"n": i, "tags": ["x"] * i}} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=2)  # 3 row groups
    pq.write_table(pa.Table.from_pylist([{"text": "b0", "meta": None}]), tmp_path / "b.parquet")
    records = _read(ParquetSourceConfig(path="*.parquet"), tmp_path)
    assert [r.data for r in records] == [*rows, {"text": "b0", "meta": None}]
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert [r.where for r in records] == [f"{a}:row {n}" for n in range(1, 6)] + [f"{b}:row 1"]
    assert source_files(ParquetSourceConfig(path="*.parquet"), tmp_path) == [a, b]


def test_parquet_unreadable_file_is_a_data_error(tmp_path: Path, pq):
    path = _write(tmp_path / "x.parquet", b"not parquet at all")
    with pytest.raises(DataError, match=rf"^{path}:row 1: cannot read \(ArrowInvalid: .*\); check or re-create it$"):
        _read(ParquetSourceConfig(path="x.parquet"), tmp_path)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    _write(tmp_path / "x.parquet", b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if pyarrow were missing
    with pytest.raises(DataError, match=r"^sources: kind parquet needs the pyarrow package; pip install pyarrow$"):
        _read(ParquetSourceConfig(path="x.parquet"), tmp_path)


# --------------------------------------------------------------------------------------------------
# npy


def _npy_cfg(path: str) -> NpySourceConfig:
    return NpySourceConfig(path=path, format="tokens")


def test_npy_1d_is_one_record_2d_one_per_row_without_padding(tmp_path: Path):
    np.save(tmp_path / "b.npy", np.array([[5, 6, -1, -1], [7, 8, 9, 10], [11, -1, -1, -1]], dtype=np.int64))
    np.save(tmp_path / "a.npy", np.array([1, 2, 3], dtype=np.uint16))
    records = _read(_npy_cfg("*.npy"), tmp_path)
    assert [r.data for r in records] == [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [5, 6]},
        {"input_ids": [7, 8, 9, 10]},
        {"input_ids": [11]},
    ]
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    assert [r.where for r in records] == [str(a), f"{b}:row 1", f"{b}:row 2", f"{b}:row 3"]
    assert all(type(i) is int for r in records for i in r.data["input_ids"])
    assert source_files(_npy_cfg("*.npy"), tmp_path) == [a, b]


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros(3, dtype=np.float32), "1-D float32"),
        (np.zeros((2, 2, 2), dtype=np.int32), "3-D int32"),
        (np.array(7, dtype=np.int32), "0-D int32"),
        (np.array([True, False]), "1-D bool"),
    ],
)
def test_npy_wrong_dtype_or_ndim_is_a_data_error(tmp_path: Path, array: np.ndarray, message: str):
    np.save(tmp_path / "x.npy", array)
    expected = rf"^{tmp_path / 'x.npy'}: expected a 1-D or 2-D integer array of token ids, got {message}; convert"
    with pytest.raises(DataError, match=expected):
        _read(_npy_cfg("x.npy"), tmp_path)


def test_npy_pickled_or_garbage_file_is_a_data_error(tmp_path: Path):
    np.save(tmp_path / "obj.npy", np.array([[1], [2, 3]], dtype=object), allow_pickle=True)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'obj.npy'}: not a readable .npy array \(ValueError: "):
        _read(_npy_cfg("obj.npy"), tmp_path)
    _write(tmp_path / "junk.npy", b"junk")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'junk.npy'}: not a readable .npy array"):
        _read(_npy_cfg("junk.npy"), tmp_path)


# --------------------------------------------------------------------------------------------------
# hf_dataset


def test_hf_dataset_from_saved_dataset(tmp_path: Path, hf):
    hf.Dataset.from_dict({"text": ["x", "y"], "n": [1, 2]}).with_format("numpy").save_to_disk(tmp_path / "ds")
    records = _read(HFDatasetSourceConfig(path="ds"), tmp_path)
    assert [r.data for r in records] == [{"text": "x", "n": 1}, {"text": "y", "n": 2}]  # plain values, not numpy
    assert type(records[0].data["n"]) is int
    assert [r.where for r in records] == [f"{tmp_path / 'ds'}[train]:row 1", f"{tmp_path / 'ds'}[train]:row 2"]
    files = source_files(HFDatasetSourceConfig(path="ds"), tmp_path)
    assert files == sorted(files) and {p.name for p in files} >= {"state.json", "dataset_info.json"}
    assert any(p.suffix == ".arrow" for p in files)


def test_hf_dataset_from_saved_dataset_dict_picks_the_split(tmp_path: Path, hf):
    splits = {"train": hf.Dataset.from_dict({"text": ["a"]}), "test": hf.Dataset.from_dict({"text": ["b", "c"]})}
    hf.DatasetDict(splits).save_to_disk(tmp_path / "dd")
    records = _read(HFDatasetSourceConfig(path="dd", split="test"), tmp_path)
    assert [r.data["text"] for r in records] == ["b", "c"]
    assert records[1].where == f"{tmp_path / 'dd'}[test]:row 2"
    with pytest.raises(DataError, match=rf"^{tmp_path / 'dd'}: no split 'dev'; set split to one of test, train$"):
        _read(HFDatasetSourceConfig(path="dd", split="dev"), tmp_path)
    files = source_files(HFDatasetSourceConfig(path="dd"), tmp_path)
    assert files == sorted(files) and tmp_path / "dd" / "dataset_dict.json" in files
    assert {p.parent.name for p in files if p.suffix == ".arrow"} == {"test", "train"}


def test_hf_dataset_from_data_files_offline(tmp_path: Path, hf, monkeypatch: pytest.MonkeyPatch):
    b = _write(tmp_path / "data" / "b.jsonl", _jsonl_bytes([{"text": "b0", "meta": {"n": 0}}]))
    a = _write(tmp_path / "data" / "a.jsonl", _jsonl_bytes([{"text": f"a{i}", "meta": {"n": i}} for i in range(2)]))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    cfg = HFDatasetSourceConfig(path="json", data_files=["data/*.jsonl"], split="validation")
    records = _read(cfg, tmp_path)
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the reader never lets datasets reach the network
    assert [r.data for r in records] == [
        {"text": "a0", "meta": {"n": 0}},
        {"text": "a1", "meta": {"n": 1}},
        {"text": "b0", "meta": {"n": 0}},
    ]
    assert [r.where for r in records] == [f"json[validation]:row {n}" for n in (1, 2, 3)]
    assert source_files(cfg, tmp_path) == [a, b]


def test_hf_dataset_errors(tmp_path: Path, hf):
    no_match = HFDatasetSourceConfig(path="json", data_files=["data/*.jsonl"])
    with pytest.raises(DataError, match=r"^sources.data_files: no file matches 'data/\*.jsonl'"):
        _read(no_match, tmp_path)
    with pytest.raises(DataError, match=r"^sources.data_files: no file matches 'data/\*.jsonl'"):
        source_files(no_match, tmp_path)
    with pytest.raises(DataError, match=r"is not a folder written by save_to_disk; .* also give data_files$"):
        _read(HFDatasetSourceConfig(path="missing"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=rf"^{tmp_path / 'empty'}: not a dataset written by save_to_disk"):
        _read(HFDatasetSourceConfig(path="empty"), tmp_path)
    _write(tmp_path / "bad.jsonl", _jsonl_bytes([{"text": "ok"}]) + b"{bad\n")
    with pytest.raises(DataError, match=r"^json\[train\]:row \d: cannot read \(.*\); check or re-create it$"):
        _read(HFDatasetSourceConfig(path="json", data_files=["bad.jsonl"]), tmp_path)


def test_hf_dataset_without_datasets_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError, match=r"^sources: kind hf_dataset needs the datasets package; pip install datasets"):
        _read(HFDatasetSourceConfig(path="json", data_files=["x.jsonl"]), tmp_path)
