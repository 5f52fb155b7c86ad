"""Reliability hardening, leftovers: what a failed or killed command leaves behind, and checking before working.

- a killed prepare left `.NAME.tmp-PID` staging folders forever: the next prepare of that output
  removes those of dead processes (only our name pattern, only a dead PID, only our files);
- a failed prepare left the empty parent folders it had created: it removes those it created;
- `dllm generate -o DIR` with a folder failed only after generating: the output is checked first;
- a refused resume rewrote the run's config.yaml and added files (run.lock, a TensorBoard events
  file): a launch that trains nothing puts the run folder back as it found it.
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
from tests.helpers import PREPARE, tiny_train_values, write_corpus, write_yaml


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


def test_an_empty_staging_folder_of_a_killed_convert_is_removed(tmp_path: Path):
    """A convert killed while it reads the weights leaves its staging folder empty: the rerun removes it (an
    empty folder of a dead process, whatever kind of output), and leaves one that holds files it cannot vouch for."""
    import torch

    from dllm.config.model import ModelConfig
    from dllm.models.hf_io import export_hf
    from dllm.models.transformer import Transformer

    cfg = ModelConfig(family="llama", preset="tiny", vocab_size=320)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    src = export_hf(model.state_dict(), cfg, tmp_path / "hf")
    empty = tmp_path / f".out.tmp-{_dead_pid()}"
    empty.mkdir()
    held = _stage(tmp_path, f"tmp-{_dead_pid()}", files=("model.safetensors",))  # `.prepared.tmp-PID`: another output
    kept = tmp_path / f".out.tmp-{_dead_pid()}"
    kept.mkdir()
    (kept / "my-notes.txt").write_text("mine")
    assert main(["convert", "--from-hf", str(src), "--to", str(tmp_path / "out")]) == 0
    assert not empty.exists() and held.exists() and (kept / "my-notes.txt").exists()


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


def _run_tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root: a file's bytes, a link's target, None for a folder."""

    def state(p: Path) -> bytes | str | None:
        return os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(root)): state(p) for p in sorted(root.rglob("*"))}


def _shard(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step_00000002" / "__0_0.distcp"


REFUSALS = {  # how the resume is refused -> (what spoils it, extra launch arguments)
    "another model": (None, ["--set", "model.hidden_size=128"]),  # by the launcher, before writing
    "no manifest": (lambda run: (run / "checkpoints" / "step_00000002" / "manifest.json").unlink(), []),  # worker
    "damaged shard": (lambda run: _shard(run).write_bytes(_shard(run).read_bytes()[:-8] + b"\0" * 8), []),
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_resume_changes_nothing_in_the_run_folder(workdir: Path, refusal: str,
                                                            capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    values = tiny_train_values(training={"steps": 2}, logging={"every_steps": 1, "progress": "off"})
    write_yaml(workdir / "train.yaml", values)  # TensorBoard on (auto): its events file would show up
    monkeypatch.chdir(workdir)
    assert main(["launch", "--config", "train.yaml"]) == 0
    run_dir = workdir / "runs" / "t"
    spoil, args = REFUSALS[refusal]
    if spoil is not None:
        spoil(run_dir)
    (workdir / "runs" / "other").mkdir()
    (workdir / "runs" / "latest").unlink()
    (workdir / "runs" / "latest").symlink_to("other")  # the link names another run meanwhile
    before = _run_tree(workdir / "runs")
    capsys.readouterr()
    code = main(["launch", "--config", "train.yaml", "--set", "training.steps=4", *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dllm: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert _run_tree(workdir / "runs") == before
