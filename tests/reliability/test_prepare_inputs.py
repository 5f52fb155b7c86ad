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
