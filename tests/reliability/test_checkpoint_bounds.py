"""Reliability hardening, hostile checkpoint files: what a checkpoint folder holds is read bounded, from
regular files only, and every refusal is one line naming the file.

A manifest of 100k nested brackets was a RecursionError traceback; `latest` naming `step_` and 100,000
digits a ValueError traceback; with verification off, a shard linked to a FIFO made `dllm generate` hang
for good; a decode profile's max_length of 1e12 was accepted.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from dllm.checkpoint.files import MANIFEST, write_manifest
from dllm.config.untrusted import count, read_json
from dllm.errors import CheckpointError
from tests.reliability.ckpt_runs import STEP2, cli, resume, trained_run

GENERATE = ["generate", "-p", "hi", "--gen-length", "4"]
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture
def run_dir(workdir: Path) -> Path:
    return trained_run(workdir)


def _verify_off(run_dir: Path) -> None:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["checkpointing"]["verify"] = False
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


@contextmanager
def _within(seconds: int) -> Iterator[None]:
    """Fail instead of hanging the suite (a reader blocked on a FIFO)."""

    def hung(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _one_line(err: list[str], *parts: str) -> str:
    assert len(err) == 1 and err[0].startswith("dllm: error: "), err
    assert all(p in err[0] for p in parts), err
    return err[0]


@pytest.mark.parametrize("verify", [True, False])
def test_a_manifest_nested_too_deeply_is_one_line(run_dir: Path, verify: bool, capsys: pytest.CaptureFixture[str]):
    (run_dir / "checkpoints" / STEP2 / MANIFEST).write_text(DEEP)
    if not verify:
        _verify_off(run_dir)
    code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
    assert code == 2
    _one_line(err, f"{STEP2}/{MANIFEST}: nested too deeply")
    with pytest.raises(CheckpointError, match="nested too deeply"):
        resume(run_dir, f"checkpointing.verify={str(verify).lower()}")


@pytest.mark.parametrize("name", ["trainer_state.json", "decode_profile.json"])
def test_a_json_file_nested_too_deeply_is_one_line(run_dir: Path, name: str, capsys: pytest.CaptureFixture[str]):
    ckpt = run_dir / "checkpoints" / STEP2
    (ckpt / name).write_text(DEEP)
    write_manifest(ckpt, 2)  # sealed as if written so
    if name == "trainer_state.json":
        with pytest.raises(CheckpointError, match=f"{name}: nested too deeply") as e:
            resume(run_dir)
        assert "\n" not in str(e.value)
    else:
        code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
        assert code == 2
        _one_line(err, f"{name}: nested too deeply")


@pytest.mark.parametrize("target", ["step_" + "1" * 100_000, "step_" + "1" * 14, "step_\u0660" * 2 + "0" * 6,
                                    "step_000000002", "step_2"])  # fmt: skip
def test_a_latest_naming_no_step_folder_is_one_line(run_dir: Path, target: str, capsys: pytest.CaptureFixture[str]):
    (run_dir / "checkpoints" / "latest").write_text(target + "\n")
    code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
    assert code == 2
    line = _one_line(err, "checkpoints/latest")
    assert "not a step_N folder" in line or "not text naming a step_N folder" in line, line
    assert len(line) < 1000 and "to resume from the newest complete checkpoint" in line, line
    with pytest.raises(CheckpointError, match="checkpoints/latest"):
        resume(run_dir)


def test_a_latest_that_is_a_fifo_does_not_block(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    os.mkfifo(run_dir / "checkpoints" / "latest.fifo")
    (run_dir / "checkpoints" / "latest").unlink()
    (run_dir / "checkpoints" / "latest").symlink_to("latest.fifo")
    with _within(60):
        code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
    assert code == 2
    _one_line(err, "checkpoints/latest: not a regular file")


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "trainer_state.json"])
@pytest.mark.parametrize("manifest", ["kept", "removed"])
def test_a_file_linked_to_a_fifo_is_refused_without_verification(
    run_dir: Path, name: str, manifest: str, capsys: pytest.CaptureFixture[str]
):
    ckpt = run_dir / "checkpoints" / STEP2
    os.mkfifo(run_dir / "fifo")
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(run_dir / "fifo")
    if manifest == "removed":
        (ckpt / MANIFEST).unlink()
    _verify_off(run_dir)
    with _within(60):
        if name != "trainer_state.json" or manifest == "kept":  # generate reads no trainer state
            code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
            assert code == 2
            _one_line(err, f"{STEP2}/{name}: not a regular file")
        with pytest.raises(CheckpointError, match=f"{name}: not a regular file"):
            resume(run_dir, "checkpointing.verify=false")


@pytest.mark.parametrize(("key", "value"), [("max_length", 1e12), ("max_length", 2**24 + 1)])
def test_a_profile_length_past_the_cap_is_one_line(
    run_dir: Path, key: str, value: object, capsys: pytest.CaptureFixture[str]
):
    ckpt = run_dir / "checkpoints" / STEP2
    profile = json.loads((ckpt / "decode_profile.json").read_text())
    profile[key] = value
    (ckpt / "decode_profile.json").write_text(json.dumps(profile))
    write_manifest(ckpt, 2)
    code, err = cli([*GENERATE, "--run", str(run_dir)], capsys)
    assert code == 2
    _one_line(err, f"{STEP2}/decode_profile.json: not a valid decode profile ({key}")


def test_json_past_its_size_bound_is_refused_unread(tmp_path: Path):
    (tmp_path / "big.json").write_text("[" + "0," * 1000 + "0]")
    with pytest.raises(CheckpointError, match=r"big.json: over 1000 bytes, too large for a record; fix it"):
        read_json(tmp_path / "big.json", "a record", "fix it", max_bytes=1000)
    assert read_json(tmp_path / "big.json", "a record", "fix it")[-1] == 0


@pytest.mark.parametrize("value", [-1, True, 2.0, "3", None, 11, 10**40])
def test_count_refuses_what_is_not_a_bounded_integer(value: object):
    with pytest.raises(ValueError, match=r"^n is .*, not a whole number in \[0, 10\]$"):
        count(value, "n", 10)
    assert count(10, "n", 10) == 10 and count(0, "n", 10) == 0
