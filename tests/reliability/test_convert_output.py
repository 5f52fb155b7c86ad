"""Reliability hardening, convert's output: `dllm convert` writes only folders it created, whole or not at all.

`--overwrite` used to write into any folder: a user's folder (their config.json replaced), the working
folder, a run folder, the `--from-hf` source itself. Now every output is staged next to its place and
renamed into place with a marker listing its files; only such a folder, holding nothing else, is
replaced, never one the command reads, and a failed convert leaves nothing (an older output intact).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dllm.cli.convert_cmd import MARKER
from tests.reliability.ckpt_runs import STEP2, cli, trained_run


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Every path under root: a file's bytes, a link's target, None for a folder."""

    def state(p: Path) -> bytes | str | None:
        return os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()

    return {str(p.relative_to(root)): state(p) for p in sorted(root.rglob("*"))}


def _refused(args: list[str], capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    code, err = cli(["convert", *args], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("dllm: error: "), err
    assert all(text in err[0] for text in expected), err[0]
    return err[0]


@pytest.fixture
def run_dir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(workdir)
    return trained_run(workdir)


def _mine(workdir: Path) -> Path:
    (workdir / "mine").mkdir()
    (workdir / "mine" / "config.json").write_text('{"my": "settings"}')
    return workdir / "mine"


TARGETS = {  # --to-hf OUT --overwrite -> what the message says
    "a user's folder": (lambda w: _mine(w), "is not an output of dllm convert"),
    "an empty folder": (lambda w: (w / "empty").mkdir() or w / "empty", "is not an output of dllm convert"),
    "the working folder": (lambda w: Path("."), "overlaps"),
    "the run folder": (lambda w: w / "runs" / "t", "overlaps"),
    "inside the run folder": (lambda w: w / "runs" / "t" / "hf", "overlaps"),
    "the checkpoint": (lambda w: w / "runs" / "t" / "checkpoints" / STEP2, "overlaps"),
    "a link to the run folder": (lambda w: (w / "link").symlink_to(w / "runs" / "t") or w / "link", "overlaps"),
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_overwrite_writes_into_no_folder_it_did_not_create(run_dir: Path, workdir: Path, target: str,
                                                           capsys: pytest.CaptureFixture[str]):  # fmt: skip
    make, expected = TARGETS[target]
    out = make(workdir)
    before = _tree(workdir)
    _refused(["--to-hf", str(out), "--run", str(run_dir), "--overwrite"], capsys, expected, "choose")
    assert _tree(workdir) == before


def test_from_hf_never_writes_into_its_source(run_dir: Path, workdir: Path, capsys: pytest.CaptureFixture[str]):
    hf = workdir / "hf"
    assert cli(["convert", "--to-hf", str(hf), "--run", str(run_dir)], capsys)[0] == 0
    (workdir / "hf-link").symlink_to(hf)
    before = _tree(workdir)
    for source, out in [(hf, hf), (workdir / "hf-link", hf), (hf, workdir / "hf-link"), (hf, hf / "dllm")]:
        _refused(["--from-hf", str(source), "--to", str(out), "--overwrite"], capsys, "overlaps")
    assert _tree(workdir) == before


def test_overwrite_replaces_an_earlier_output_as_a_unit(run_dir: Path, workdir: Path,
                                                        capsys: pytest.CaptureFixture[str]):  # fmt: skip
    out = workdir / "exported"
    for _ in range(2):
        assert cli(["convert", "--to-hf", str(out), "--run", str(run_dir), "--overwrite"], capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "config.json", "decode_profile.json",
                                                             "model.safetensors"])  # fmt: skip
    (out / "NOTES.md").write_text("my notes on this export")
    before = _tree(workdir)
    _refused(["--to-hf", str(out), "--run", str(run_dir), "--overwrite"], capsys, "holds NOTES.md", "move them out")
    assert _tree(workdir) == before
    assert not [p for p in workdir.iterdir() if p.name.startswith(".exported")]  # no staging left


def test_a_failed_convert_leaves_nothing_and_keeps_the_earlier_output(run_dir: Path, workdir: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    out = workdir / "exported"
    assert cli(["convert", "--to-hf", str(out), "--run", str(run_dir)], capsys)[0] == 0
    before = _tree(workdir)

    def fails_halfway(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("dllm.config.profile.write_profile", fails_halfway)  # after the weights were written
    for args in (["--to-hf", str(out), "--overwrite"], ["--to-hf", str(workdir / "new" / "out")]):
        with pytest.raises(OSError):
            cli(["convert", *args, "--run", str(run_dir)], capsys)
        assert _tree(workdir) == before
