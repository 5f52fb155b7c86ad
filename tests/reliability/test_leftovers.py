"""Reliability hardening, leftovers: what a failed or killed command leaves behind, and checking before working.

- a killed prepare left `.NAME.tmp-PID` staging folders forever: the next prepare of that output
  removes those of dead processes (only our name pattern, only a dead PID, only our files);
- a failed prepare left the empty parent folders it had created: it removes those it created;
- `dllm generate -o DIR` with a folder failed only after generating: the output is checked first.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.data.prepare import prepare
from dllm.errors import DataError
from tests.helpers import PREPARE, write_corpus, write_yaml


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _spec(root: Path, output: str = "data/prepared") -> PrepareSpec:
    write_corpus(root / "data" / "train.jsonl", num_records=20)
    return load_config(PrepareSpec, write_yaml(root / "prepare.yaml", {**PREPARE, "output": output}))


def _stage(parent: Path, suffix: str, files: tuple[str, ...] = ("tokens.bin", "manifest.json")) -> Path:
    folder = parent / f".prepared.{suffix}"
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"x" * 64)
    return folder


def test_stale_staging_folders_of_dead_processes_are_removed(tmp_path: Path):
    spec = _spec(tmp_path)
    parent = tmp_path / "data"
    dead = _stage(parent, f"tmp-{_dead_pid()}")
    alive = _stage(parent, f"tmp-{os.getppid()}")  # a prepare still running elsewhere
    foreign = _stage(parent, f"tmp-{_dead_pid()}", files=("my-notes.txt",))  # not what we write
    other_name = _stage(parent, "tmp-x1")  # not our pattern
    other_output = parent / f".other.tmp-{_dead_pid()}"  # the staging of another output
    other_output.mkdir()
    prepare(spec, tmp_path)
    assert not dead.exists()
    assert alive.exists() and foreign.exists() and other_name.exists() and other_output.exists()


def test_stale_staging_is_cleaned_even_when_prepare_then_fails(tmp_path: Path):
    spec = _spec(tmp_path)
    dead = _stage(tmp_path / "data", f"tmp-{_dead_pid()}")
    with (tmp_path / "data" / "train.jsonl").open("a") as fh:
        fh.write("{oops\n")
    with pytest.raises(DataError):
        prepare(spec, tmp_path)
    assert not dead.exists()


@pytest.mark.parametrize("existing", ["", "kept"])
def test_failed_prepare_removes_the_parent_folders_it_created(tmp_path: Path, existing: str):
    spec = _spec(tmp_path, output=f"{existing}/new/deeper/prepared".lstrip("/"))
    if existing:
        (tmp_path / existing).mkdir()  # the user's (empty) folder: never removed
    with (tmp_path / "data" / "train.jsonl").open("a") as fh:
        fh.write("{oops\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(DataError, match="invalid JSON"):
        prepare(spec, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if existing:
        assert list((tmp_path / existing).iterdir()) == []


def test_generate_checks_the_output_before_loading_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    import dllm.cli.generate_cmd as generate_cmd

    def no_sampling(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(generate_cmd, "setup_sampling", no_sampling)
    (tmp_path / "a-file").write_text("x")
    for output, expected in [
        (tmp_path, "is a folder"),
        (tmp_path / "missing" / "out.jsonl", "does not exist"),
        (tmp_path / "a-file" / "out.jsonl", "is not a folder"),
    ]:
        code = main(["generate", "--run", str(tmp_path), "-p", "hi", "-o", str(output)])
        err = capsys.readouterr().err
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "--output" in lines[0] and expected in lines[0], err
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == '["a-file"]'
