"""Reliability hardening, data files: hostile or careless inputs to `dllm data prepare`.

A UTF-8 BOM is stripped; a chat with nothing to train on is a bad record; recursive globs do not
follow symlink loops; JSON booleans are not token ids; deep nesting, huge integers, an unwritable
output and an output under a file are one line each; an over-long record is rejected before it is
tokenized whole, so memory stays flat.
"""

from __future__ import annotations

import codecs
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dllm.cli.main import main
from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.data.artifact import open_artifact
from dllm.data.prepare import prepare
from dllm.errors import DataError
from dllm.tokenization import ByteTokenizer

TOK = ByteTokenizer()
BOM = codecs.BOM_UTF8


def _spec(root: Path, source: dict[str, Any], **values: Any) -> PrepareSpec:
    data = {"sources": [source], "output": "out", "seq_len": 64, **values}
    return validate_config(PrepareSpec, data, source="prepare.yaml", base_dir=root)


def _tokens(root: Path) -> list[int]:
    return np.asarray(open_artifact(root / "out").array("tokens")).tolist()


def _one_line(exc: pytest.ExceptionInfo[DataError], *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg and all(p in msg for p in parts), msg


# -- BOM ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source"),
    [
        ("a.jsonl", {"path": "a.jsonl"}),
        ("a.txt", {"path": "a.txt"}),
        ("a.txt", {"path": "a.txt", "per_line": True}),
    ],
    ids=["jsonl", "text-file", "text-per-line"],
)
def test_a_utf8_bom_is_stripped(tmp_path: Path, name: str, source: dict[str, Any]):
    body = json.dumps({"text": "héllo"}) + "\n" if name.endswith(".jsonl") else "héllo"
    (tmp_path / name).write_bytes(BOM + body.encode("utf-8"))
    manifest = prepare(_spec(tmp_path, source), tmp_path)
    assert manifest["stats"]["records_read"] == 1
    assert _tokens(tmp_path)[: len("héllo".encode()) + 1] == [*TOK.encode("héllo"), TOK.eos_id]


# -- a chat with no assistant turn -----------------------------------------------------------------

NO_ASSISTANT = {"messages": [{"role": "user", "content": "hi"}]}
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _chats(root: Path) -> None:
    (root / "c.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps(NO_ASSISTANT) + "\n")


def test_a_chat_without_assistant_turn_is_a_bad_record(tmp_path: Path):
    _chats(tmp_path)
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, {"path": "c.jsonl", "format": "messages"}, pad_to_multiple=8), tmp_path)
    _one_line(info, "c.jsonl:2:", "assistant")


def test_a_chat_without_assistant_turn_is_skipped_when_asked(tmp_path: Path):
    _chats(tmp_path)
    spec = _spec(tmp_path, {"path": "c.jsonl", "format": "messages"}, on_bad_record="skip", layout="indexed")
    manifest = prepare(spec, tmp_path)
    assert manifest["stats"]["records_skipped"] == 1 and manifest["num_sequences"] == 1
    assert manifest["stats"]["supervised_tokens"] == sum(TOK.apply_chat_template(CHAT["messages"]).assistant_mask)


# -- symlink loops ---------------------------------------------------------------------------------


def test_recursive_globs_do_not_follow_symlink_loops(tmp_path: Path):
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n")
    os.symlink(data, data / "sub" / "loop")  # a link back up: glob followed it ~40 levels deep
    os.symlink(data / "sub" / "a.jsonl", data / "same.jsonl")  # the same file under a second name
    manifest = prepare(_spec(tmp_path, {"path": "data/**/*.jsonl"}), tmp_path)
    assert manifest["stats"]["records_read"] == 1
    assert [s["file"] for s in manifest["provenance"]["sources"]] == ["data/sub/a.jsonl"]


# -- token ids, nesting, numbers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"input_ids": [true, false, 5]}', "must be a list of ids"),
        ('{"input_ids": [' + "9" * 5000 + "]}", "too large"),
        ('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ('{"text": 1, "x": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}", "nested too deeply"),
    ],
    ids=["booleans", "huge-integer", "deep-list", "deep-object"],
)
def test_bad_json_values_are_one_line(tmp_path: Path, line: str, expected: str):
    (tmp_path / "t.jsonl").write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + line + "\n")
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, {"path": "t.jsonl", "format": "tokens"}), tmp_path)
    _one_line(info, "t.jsonl:2:", expected)


# -- where the output goes -----------------------------------------------------------------------------


def _cli_error(root: Path, output: str, capsys: pytest.CaptureFixture[str]) -> str:
    (root / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (root / "prepare.yaml").write_text(f"sources: [{{path: a.jsonl}}]\noutput: {output}\nseq_len: 16\n")
    assert main(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("output", ["a.jsonl/out", "a.jsonl/deeper/out"])
def test_an_output_under_a_file_is_one_line(tmp_path: Path, output: str, capsys: pytest.CaptureFixture[str]):
    line = _cli_error(tmp_path, output, capsys)
    assert "a.jsonl is a file, not a folder" in line, line


def test_an_unwritable_output_folder_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:  # chmod does not stop root: deny like EACCES
        if self.parent == locked:
            raise PermissionError(13, "Permission denied", str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    line = _cli_error(tmp_path, "locked/out", capsys)
    assert "locked" in line and "permission denied" in line, line
    assert list(locked.iterdir()) == []


# -- counts from flags -----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["10000", str(2**63)])
def test_more_workers_than_cores_are_refused_before_anything_starts(
    tmp_path: Path, workers: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):  # fmt: skip
    """--workers 10000 started a pool of 10000 processes (and left its staging folder when the machine gave out)."""
    from dllm.parallel.threads import usable_cores

    def no_pool(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a worker pool was started")

    monkeypatch.setattr("multiprocessing.context.BaseContext.Pool", no_pool)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (tmp_path / "prepare.yaml").write_text("sources: [{path: a.jsonl}]\noutput: out\nseq_len: 16\n")
    capsys.readouterr()
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q", "--workers", workers]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--workers" in lines[0] and f"give at most {usable_cores()}" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "prepare.yaml"]


# -- an over-long record ---------------------------------------------------------------------------


def test_an_over_long_record_is_rejected_before_it_is_tokenized(tmp_path: Path):
    size = 3_000_000  # stands for the 50 MB line of the report; the limit below is 64 tokens
    with (tmp_path / "big.jsonl").open("w") as fh:
        fh.write(json.dumps({"text": "short one"}) + "\n")
        fh.write(json.dumps({"text": "word " * (size // 5)}) + "\n")
        fh.write(json.dumps({"text": "short two"}) + "\n")
    spec = _spec(tmp_path, {"path": "big.jsonl"}, max_length=64, overflow="reject")
    tracemalloc.start()
    try:
        manifest = prepare(spec, tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert manifest["stats"]["rejected"] == 1 and manifest["stats"]["documents"] == 2
    # the line itself is read, decoded and parsed (a few copies of it); tokenizing it whole took ~30x
    assert peak < 6 * size, f"peak {peak / 1e6:.0f} MB for a {size / 1e6:.0f} MB line"


def test_records_within_the_limit_are_kept(tmp_path: Path):
    """The bound only rejects what cannot fit: a record at the limit is kept, one token over is rejected."""
    texts = ["x" * 63, "y" * 64]  # + EOS: 64 and 65 tokens
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    manifest = prepare(_spec(tmp_path, {"path": "a.jsonl"}, max_length=64), tmp_path)
    assert (manifest["stats"]["documents"], manifest["stats"]["rejected"]) == (1, 1)


# -- token ids and masks that are not what they claim --------------------------------------------------
@pytest.mark.parametrize(
    ("array", "expected"),
    [
        (np.array([65, -3, 66]), "a.npy: index 1 holds -3"),
        (np.array([[65, 66, -1, -1], [65, -5, 66, -1]]), "a.npy:row 2: index 1 holds -5"),
        (np.array([[65, -1, 66, -1]]), "a.npy:row 1: index 1 holds -1, not a token id (only trailing -1 pad"),
        (np.array([[65, 66], [65, 999]]), "'input_ids' must be a list of ids in [0, 260) (index 1 is 999)"),
    ],
    ids=["1d-negative", "2d-negative", "2d-pad-inside", "2d-past-vocab"],
)
def test_npy_ids_that_are_no_tokens_are_refused_with_their_index(tmp_path: Path, array: np.ndarray, expected: str):
    np.save(tmp_path / "a.npy", array)
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, {"path": "a.npy"}), tmp_path)
    _one_line(info, expected)


def test_npy_trailing_padding_is_dropped(tmp_path: Path):
    np.save(tmp_path / "a.npy", np.array([[65, 66, -1, -1], [67, 68, 69, -1]], dtype=np.int32))
    prepare(_spec(tmp_path, {"path": "a.npy"}, append_eos=False), tmp_path)
    assert _tokens(tmp_path)[:5] == [65, 66, 67, 68, 69]


@pytest.mark.parametrize(
    ("field", "values", "expected"),
    [
        ("loss_mask_field", [0, 2, 1], "'mask' must hold 0 or 1 per token (index 1 is 2)"),
        ("loss_mask_field", [0, 1, 0.5], "(index 2 is 0.5)"),
        ("loss_mask_field", [0, "1", 1], "(index 1 is '1')"),
        ("labels_field", [-100, 66, -1], "'mask' must hold -100 (not trained) or token ids in [0, 260) (index 2"),
        ("labels_field", [-100, True, 67], "(index 1 is True)"),
    ],
    ids=["mask-2", "mask-half", "mask-string", "labels-negative", "labels-bool"],
)
def test_supervision_values_are_checked_not_coerced(tmp_path: Path, field: str, values: list, expected: str):
    (tmp_path / "t.jsonl").write_text(json.dumps({"input_ids": [65, 66, 67], "mask": values}) + "\n")
    source = {"path": "t.jsonl", "format": "tokens", field: "mask"}
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, source), tmp_path)
    _one_line(info, "t.jsonl:1:", expected)


def test_a_boolean_loss_mask_is_read_as_0_and_1(tmp_path: Path):
    (tmp_path / "t.jsonl").write_text(json.dumps({"input_ids": [65, 66, 67], "mask": [False, True, 1]}) + "\n")
    manifest = prepare(_spec(tmp_path, {"path": "t.jsonl", "format": "tokens", "loss_mask_field": "mask"}), tmp_path)
    assert manifest["stats"]["supervised_tokens"] == 3  # two of the record, and its EOS


# -- on_bad_record: skip ------------------------------------------------------------------------------------
NOT_JSON = [b"not json at all", b"[1, 2]", b'{"text": "unterminated', b"\xff\xfe{}", b'"a string"']


@pytest.mark.parametrize("workers", [1, 2])
def test_skip_skips_and_counts_lines_that_are_not_json_objects(tmp_path: Path, workers: int):
    good = [json.dumps({"text": f"line {i}"}).encode() for i in range(3)]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join([good[0], *NOT_JSON, good[1], b"", good[2]]) + b"\n")
    manifest = prepare(_spec(tmp_path, {"path": "a.jsonl"}, on_bad_record="skip"), tmp_path, workers=workers)
    stats = manifest["stats"]
    assert (stats["records_read"], stats["records_skipped"], stats["documents"]) == (8, 5, 3)
    assert "a.jsonl:2: invalid JSON" in stats["skip_examples"][0]


def test_fail_still_stops_at_the_first_line_that_is_not_json(tmp_path: Path):
    (tmp_path / "a.jsonl").write_bytes(json.dumps({"text": "ok"}).encode() + b"\n[1, 2]\n")
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, {"path": "a.jsonl"}), tmp_path)
    _one_line(info, "a.jsonl:2: expected a JSON object per line, got list")


# -- sizes ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["seq_len", "pad_to_multiple"])
def test_a_row_size_beyond_memory_is_refused_with_its_field(tmp_path: Path, field: str,
                                                            capsys: pytest.CaptureFixture[str]):  # fmt: skip
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    sizes = {"seq_len": 16, field: 10**12}
    body = "".join(f"{k}: {v}\n" for k, v in sizes.items())
    (tmp_path / "prepare.yaml").write_text(f"sources: [{{path: a.jsonl}}]\noutput: out\n{body}")
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"]) == 2
    line = capsys.readouterr().err.strip()
    line_no = 3 + list(sizes).index(field)
    assert line.startswith(f"dllm: error: {tmp_path / 'prepare.yaml'}:{line_no}: {field}: Input should be less than or")
    assert not (tmp_path / "out").exists()


# -- hf_dataset splits ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_datasets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """save_to_disk folders: one split of a builder (its split named), one without a split name, a DatasetDict."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf")
    (root / "a.json").write_text(json.dumps([{"text": "from train"}]))
    datasets.load_dataset("json", data_files=str(root / "a.json"), split="train").save_to_disk(str(root / "train"))
    plain = datasets.Dataset.from_dict({"text": ["no split"]})
    plain.save_to_disk(str(root / "plain"))
    datasets.DatasetDict({"train": plain, "validation": plain}).save_to_disk(str(root / "dict"))
    return root


@pytest.mark.parametrize(
    ("folder", "split", "expected"),
    [
        ("train", "test", "no split 'test'; it holds one dataset, split 'train'"),
        ("plain", "validation", "no split 'validation'; the folder holds one dataset without split names"),
        ("dict", "test", "no split 'test'; set split to one of train, validation"),
    ],
)
def test_a_split_that_does_not_exist_is_refused(saved_datasets: Path, tmp_path: Path, folder: str, split: str,
                                                expected: str):  # fmt: skip
    source = {"kind": "hf_dataset", "path": str(saved_datasets / folder), "split": split}
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, source), tmp_path)
    _one_line(info, expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("folder", "split"), [("train", "train"), ("plain", None), ("dict", "validation")])
def test_a_split_that_exists_is_read(saved_datasets: Path, tmp_path: Path, folder: str, split: str | None):
    source = {"kind": "hf_dataset", "path": str(saved_datasets / folder), **({"split": split} if split else {})}
    assert prepare(_spec(tmp_path, source), tmp_path)["stats"]["records_read"] == 1


@pytest.mark.parametrize("damage", ["not json", "a list", "no files"])
def test_a_damaged_save_to_disk_folder_is_one_line(saved_datasets: Path, tmp_path: Path, damage: str):
    import shutil

    folder = tmp_path / "saved"
    shutil.copytree(saved_datasets / "plain", folder)
    state = {"not json": "{oops", "a list": "[1, 2]", "no files": json.dumps({"_data_files": [{"x": 1}]})}[damage]
    (folder / "state.json").write_text(state)
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, {"kind": "hf_dataset", "path": str(folder)}), tmp_path)
    _one_line(info, f"{folder}: a damaged save_to_disk folder")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("output", ["/", "/proc/out", "/sys/out", "/dev/out"])
def test_a_system_folder_is_no_output(tmp_path: Path, output: str, capsys: pytest.CaptureFixture[str]):
    """The filesystem root (root could write its artifact files there) and the kernel's folders are refused
    in the config and on the command line, before anything is read or written."""
    line = _cli_error(tmp_path, output, capsys)
    assert "output" in line and ("filesystem root" in line if output == "/" else output[:4] in line), line
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "--output", output, "-q"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.count("\n") == 0 and ("choose another folder" in line or "give a folder" in line), line
    assert not (tmp_path / "out").exists()


# -- empty records -------------------------------------------------------------------------------------------
EMPTY_INPUTS = {
    "jsonl-text": ("e.jsonl", {"path": "e.jsonl"}, lambda p: p.write_text('{"text": ""}\n{"text": ""}\n')),
    "jsonl-ids": ("e.jsonl", {"path": "e.jsonl", "format": "tokens"},
                  lambda p: p.write_text('{"input_ids": []}\n{"input_ids": []}\n')),
    "npy": ("e.npy", {"path": "e.npy"}, lambda p: np.save(p, np.zeros(0, dtype=np.int32))),
    "npy-rows": ("e.npy", {"path": "e.npy"}, lambda p: np.save(p, np.full((2, 3), -1, dtype=np.int32))),
    "text-file": ("e.txt", {"path": "e.txt"}, lambda p: p.write_text("")),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EMPTY_INPUTS))
def test_only_empty_records_are_refused_and_nothing_is_written(tmp_path: Path, case: str,
                                                               capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """Empty records became an artifact of EOS tokens without a word."""
    name, source, write = EMPTY_INPUTS[case]
    write(tmp_path / name)
    with pytest.raises(DataError) as info:
        prepare(_spec(tmp_path, source), tmp_path)
    _one_line(info, name, "are empty", "nothing written")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    (tmp_path / "prepare.yaml").write_text(f"sources: [{json.dumps(source)}]\noutput: out\nseq_len: 16\n")
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm: error: ") and "are empty" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_some_empty_records_are_kept_with_a_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n{"text": ""}\n{"text": "yo"}\n{"text": ""}\n')
    (tmp_path / "prepare.yaml").write_text("sources: [{path: a.jsonl}]\noutput: out\nseq_len: 16\n")
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "a.jsonl:2" in warnings[0] and "2 of 4 records are empty" in warnings[0], warnings
    stats = json.loads((tmp_path / "out" / "manifest.json").read_text())["stats"]
    assert stats["records_empty"] == 2 and stats["empty_examples"] == [f"{tmp_path / 'a.jsonl'}:2",
                                                                       f"{tmp_path / 'a.jsonl'}:4"]  # fmt: skip
    (tmp_path / "a.jsonl").write_text('{"text": "hi"}\n')
    out = str(tmp_path / "o2")
    assert main(["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q", "--output", out]) == 0
    assert "warning" not in capsys.readouterr().err
