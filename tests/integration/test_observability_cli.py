"""`dllm plot`, `dllm runs` and `dllm doctor --config` on tiny runs (in process, through the CLI entry)."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.cli.plot_cmd import moving_average
from dllm.training.metrics import read_metrics
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import load_spec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(train_yaml: Path, *overrides: str, train: bool = True) -> Path:
    spec, _ = resolve_run_spec(load_spec(train_yaml, *overrides))
    run_dir = prepare_run_dir(spec)
    if train:
        train_from_run_dir(run_dir)
    return run_dir


@pytest.fixture
def two_runs(train_yaml: Path) -> tuple[Path, Path]:
    """runs/a: mdlm, 4 of 4 steps; runs/b: bd3lm, trained 2 steps, then extended to 6 (not resumed yet)."""
    a = _run(train_yaml, "run.name=a")
    bd3lm = ("run.name=b", "objective.name=bd3lm", "objective.block_size=8", "checkpointing.every_steps=1")
    b = _run(train_yaml, *bd3lm, "training.steps=2")
    _run(train_yaml, *bd3lm, "training.steps=6", train=False)
    return a, b


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dllm: error: "), lines
    return lines[0]


def test_plot_renders_a_png_panel_per_metric(two_runs: tuple[Path, Path], tmp_path: Path):
    a, b = two_runs
    one, three = tmp_path / "one.png", tmp_path / "plots" / "three.png"
    assert main(["plot", str(a), str(b), "-o", str(one)]) == 0
    assert main(["plot", str(a), str(b), "-o", str(three), "--metric", "loss,lr,tokens_per_s", "--smooth", "2"]) == 0
    (w1, h1), (w3, h3) = _png_size(one), _png_size(three)
    assert one.stat().st_size > 1000 and w1 == w3 and h3 == pytest.approx(3 * h1, rel=0.02)


def test_plot_refuses_a_missing_run_or_metric_in_one_line(two_runs: tuple[Path, Path], tmp_path: Path, capsys):
    a, _ = two_runs
    assert main(["plot", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.png")]) == 2
    assert "nowhere: not a run folder (no metrics.jsonl)" in _one_error_line(capsys)
    assert main(["plot", str(a), "--metric", "loss,bogus", "-o", str(tmp_path / "x.png")]) == 2
    line = _one_error_line(capsys)
    assert "--metric bogus: not in these runs' metrics" in line and "tokens_per_s" in line
    assert not (tmp_path / "x.png").exists()


def test_moving_average_is_trailing():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]


def test_runs_lists_each_run(two_runs: tuple[Path, Path], capsys: pytest.CaptureFixture):
    a, b = two_runs
    assert main(["runs", str(a.parent)]) == 0
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]] for line in _table(capsys)}
    assert set(rows) == {"a", "b"}  # the `latest` link is not a run of its own
    loss_a = read_metrics(a)[-1]["loss"]
    assert rows["a"][1:] == ["mdlm", "4/4", f"{loss_a:.4f}", "1.02k", "step_00000004", rows["a"][-1]]
    assert rows["b"][1:5] == ["bd3lm", "2/6", f"{read_metrics(b)[-1]['loss']:.4f}", "512"]
    assert rows["b"][5] == "step_00000002" and rows["b"][6].endswith(("kB", "MB"))


def _table(capsys: pytest.CaptureFixture) -> list[str]:
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith("│") and "objective" not in line]


def test_runs_takes_a_project_folder_or_one_run(two_runs: tuple[Path, Path], tmp_path: Path, capsys):
    """Besides a runs folder: a project folder (its runs/, or the run.output_dir its configs name, relative to
    them) and a single run folder (runs/latest included)."""
    a, b = two_runs
    names = lambda: sorted(line.split("│")[1].strip() for line in _table(capsys))  # noqa: E731
    assert main(["runs", str(a.parent.parent)]) == 0 and names() == ["a", "b"]  # the project that holds runs/
    project = tmp_path / "elsewhere"
    project.mkdir()
    (project / "train.yaml").write_text(f"run:\n  output_dir: {os.path.relpath(a.parent, project)}\n")
    assert main(["runs", str(project)]) == 0 and names() == ["a", "b"]
    assert main(["runs", str(a)]) == 0 and names() == ["a"]
    assert main(["runs", str(a.parent / "latest")]) == 0 and names() == ["b"]
    (tmp_path / "empty").mkdir()
    assert main(["runs", str(tmp_path / "empty")]) == 0 and "no runs in" in capsys.readouterr().err


def test_runs_on_a_missing_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert main(["runs", str(tmp_path / "nope")]) == 2
    assert "nope: no such folder" in _one_error_line(capsys)


def test_doctor_config_passes_on_the_demo_config_and_names_missing_wandb(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    assert main(["init", str(tmp_path / "proj"), "--num-records", "20"]) == 0
    config = str(tmp_path / "proj" / "train.yaml")
    capsys.readouterr()
    assert main(["doctor", "--config", config]) == 0
    out = capsys.readouterr().out
    assert "device" in out and "attention" in out and "disk" in out and "MISSING" not in out
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    wandb = ["--set", "logging.wandb.mode=offline"]
    assert main(["doctor", "--config", config, *wandb]) == 1
    res = capsys.readouterr()
    assert "wandb" in res.err and "MISSING" in res.out
    assert main(["doctor", "--config", config, *wandb, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["missing"] == ["wandb"]
    assert main(["doctor", "--config", config, "--set", "logging.wandb.mode=disabled", "--json"]) == 0


def test_doctor_config_names_disk_space_it_lacks(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    import shutil

    from dllm.training import needs

    assert main(["init", str(tmp_path / "proj"), "--num-records", "20"]) == 0
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(needs.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    capsys.readouterr()
    assert main(["doctor", "--config", str(tmp_path / "proj" / "train.yaml"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["missing"] == ["disk"]
    disk = next(n for n in report["needs"] if n["name"] == "disk")
    assert "3 checkpoints of" in disk["detail"] and "1.0 kB free" in disk["detail"]
