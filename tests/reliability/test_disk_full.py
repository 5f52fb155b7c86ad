"""Reliability hardening, a full disk: a full disk while saving is one line, and leaves nothing half-written.

The disk is simulated, never filled: every file opened for writing under the run folder shares a
byte budget, and the write that exceeds it writes what fits and raises OSError(ENOSPC), as a real
full disk does (torch.save then reports `unexpected pos`, with the OSError only as its context).
"""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest

from dllm.checkpoint.manager import latest_checkpoint
from dllm.errors import CheckpointError
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir
from tests.helpers import PREPARE, load_spec, write_corpus, write_yaml
from tests.reliability.ckpt_runs import STEP2, cli, resume, trained_run

NO_SPACE = r"^no space left on \S+ \(needs about \d+ MB"


class _Disk:
    """A disk under `root` with `left` free bytes."""

    def __init__(self, root: Path, left: int) -> None:
        self.root, self.left = root, left

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open = Path.open
        disk = self

        def open_(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(path, mode, *args, **kwargs)
            writing = any(c in mode for c in "wax+") and path.resolve().is_relative_to(disk.root)
            return _Filling(f, disk) if writing else f

        monkeypatch.setattr(Path, "open", open_)


class _Filling:
    """A file whose writes fail with ENOSPC once its disk is full."""

    def __init__(self, f: Any, disk: _Disk) -> None:
        self._f, self._disk = f, disk

    def write(self, data: Any) -> int:
        size = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data.encode())
        if size > self._disk.left:
            self._f.write(data[: self._disk.left])
            self._disk.left = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.left -= size
        return self._f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp"))


def _checkpoint_bytes(ckpt: Path, *names: str) -> int:
    return sum((ckpt / n).stat().st_size for n in names)


@pytest.mark.parametrize("fills_at", ["shard", "json files"])
def test_a_full_disk_during_a_save_is_one_line_and_cleans_up(
    workdir: Path, fills_at: str, monkeypatch: pytest.MonkeyPatch
):
    run_dir = trained_run(workdir)
    ckpt = run_dir / "checkpoints" / STEP2
    shard = _checkpoint_bytes(ckpt, "__0_0.distcp")
    left = shard // 3 if fills_at == "shard" else shard + _checkpoint_bytes(ckpt, ".metadata") + 64
    _Disk(run_dir / "checkpoints", left).install(monkeypatch)
    with pytest.raises(CheckpointError) as e:
        resume(run_dir)
    message = str(e.value)
    assert re.match(NO_SPACE, message) and str(run_dir / "checkpoints") in message and "\n" not in message
    assert _leftovers(run_dir) == []
    assert latest_checkpoint(run_dir / "checkpoints").name == STEP2  # the last good one, untouched
    monkeypatch.undo()  # space freed: the run resumes from step 2 and publishes step 4
    assert len(resume(run_dir)) == 2
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000004"


def test_a_full_disk_writing_the_run_config_is_one_line(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    run_dir = trained_run(workdir)
    before = (run_dir / "config.yaml").read_text()
    _Disk(run_dir, 10).install(monkeypatch)
    spec, _ = resolve_run_spec(load_spec(run_dir.parent.parent / "train.yaml", "training.steps=8"))
    with pytest.raises(CheckpointError, match=NO_SPACE):
        prepare_run_dir(spec)
    assert _leftovers(run_dir) == [] and (run_dir / "config.yaml").read_text() == before


def test_launch_on_a_full_disk_exits_2_with_one_line(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    run_dir = trained_run(workdir)
    monkeypatch.chdir(workdir)
    _Disk(run_dir / "checkpoints", 1000).install(monkeypatch)
    code, err = cli(["launch", "--config", "train.yaml", "--set", "training.steps=4"], capsys)
    errors = [line for line in err if line.startswith("dllm: error:")]
    assert code == 2 and len(errors) == 1 and "no space left on" in errors[0] and "Traceback" not in "\n".join(err)
    assert _leftovers(run_dir) == []


def test_a_save_that_cannot_fit_is_refused_before_writing(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    """When the disk's free space is already below the checkpoint's size, nothing is written."""
    import shutil

    import dllm.checkpoint.files as files

    run_dir = trained_run(workdir)
    real = shutil.disk_usage
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(CheckpointError, match=NO_SPACE + r", 1 MB free\)"):
        resume(run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", STEP2]


@pytest.mark.parametrize("fills_at", ["arrays", "manifest"])
def test_a_full_disk_during_data_prepare_is_one_line_and_leaves_nothing(
    tmp_path: Path, fills_at: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    write_corpus(tmp_path / "data" / "train.jsonl", num_records=200)
    write_yaml(tmp_path / "prepare.yaml", PREPARE)
    args = ["data", "prepare", "--config", str(tmp_path / "prepare.yaml"), "-q"]
    assert cli([*args, "--output", str(tmp_path / "sized")], capsys)[0] == 0  # the sizes of a good artifact
    arrays = sum(p.stat().st_size for p in (tmp_path / "sized").glob("*.bin"))
    _Disk(tmp_path / "data", arrays // 2 if fills_at == "arrays" else arrays + 64).install(monkeypatch)
    code, err = cli(args, capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"dllm: error: {tmp_path / 'data' / 'prepared'}: no space left on the disk"), err[0]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["train.jsonl"]  # no stage, no artifact
    monkeypatch.undo()  # space freed: the same command prepares the artifact
    assert cli(args, capsys)[0] == 0 and (tmp_path / "data" / "prepared" / "manifest.json").is_file()


def _weights_fill_the_disk(tensors: dict, path: str, *args: Any, **kwargs: Any) -> None:
    """safetensors writes the file itself (not through Path.open): a full disk is its IoError, half a file."""
    from safetensors import SafetensorError

    Path(path).write_bytes(b"\0" * 100)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space'
                          ' left on device" })')  # fmt: skip


@pytest.mark.parametrize("fills_at", ["weights", "config.json"])
def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(
    workdir: Path, fills_at: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    run_dir = trained_run(workdir)
    exports = workdir / "exports"  # created for the output, so removed again
    if fills_at == "weights":
        monkeypatch.setattr("safetensors.torch.save_file", _weights_fill_the_disk)
    else:
        _Disk(exports, 10).install(monkeypatch)
    code, err = cli(["convert", "--to-hf", str(exports / "hf"), "--run", str(run_dir)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"dllm: error: {exports / 'hf'}: no space left on the disk"), err
    assert not exports.exists()
