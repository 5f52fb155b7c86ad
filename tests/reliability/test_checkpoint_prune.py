"""Reliability hardening, pruning: pruning must never delete the checkpoint just published or `latest`'s target.

Pruning used to sort every `step_*` folder and keep the last `keep_last_n`: an orphan folder of a
later step (left by an interrupted timeline or copied in) made it delete the checkpoint it had just
published, leaving `latest` naming a deleted folder, and folders a user named `step_..._keep` were
deleted too. It now keeps the newest `keep_last_n` up to the published step and touches nothing else. A generate
that reads a checkpoint while its run prunes it says so (and to retry) instead of describing the
half-deleted folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dllm.checkpoint.loading import load_for_inference
from dllm.checkpoint.manager import latest_checkpoint
from dllm.models import factory
from tests.reliability.ckpt_runs import STEP2, cli, resume, trained_run

ORPHAN = "step_00000010"


def test_an_orphan_later_step_does_not_make_pruning_delete_the_new_checkpoint(workdir: Path):
    run_dir = trained_run(workdir, "checkpointing.keep_last_n=1")
    folder = run_dir / "checkpoints"
    shutil.copytree(folder / STEP2, folder / ORPHAN)  # a later step that `latest` does not name
    resume(run_dir, "checkpointing.keep_last_n=1")
    assert latest_checkpoint(folder).name == "step_00000004"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step_00000004", ORPHAN]
    assert load_for_inference(run_dir).source.name == "step_00000004"


def test_pruning_leaves_folders_it_did_not_write(workdir: Path):
    run_dir = trained_run(workdir, "checkpointing.keep_last_n=1")
    folder = run_dir / "checkpoints"
    shutil.copytree(folder / STEP2, folder / f"{STEP2}_keep")  # a user's copy, kept on purpose
    (folder / "step_notes").mkdir()
    resume(run_dir, "checkpointing.keep_last_n=1")
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [f"{STEP2}_keep", "step_00000004", "step_notes"]


def _publish_and_prune(folder: Path, how: str) -> None:
    """What the training does meanwhile: publish step 4 (`latest` moves), then prune step 2 (rmtree)."""
    shutil.copytree(folder / STEP2, folder / "step_00000004")
    (folder / "latest").write_text("step_00000004\n")
    if how == "half-deleted":  # the rmtree is under way
        (folder / STEP2 / "manifest.json").unlink()
        (folder / STEP2 / "__0_0.distcp").unlink()
    else:
        shutil.rmtree(folder / STEP2)


@pytest.mark.parametrize("how", ["half-deleted", "gone"])
@pytest.mark.parametrize("by", ["--run", "--checkpoint"])
def test_a_generate_that_races_a_prune_says_so(workdir: Path, how: str, by: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    run_dir = trained_run(workdir, "checkpointing.keep_last_n=1")
    folder = run_dir / "checkpoints"
    build = factory.build_model

    def build_while_training_goes_on(*args, **kwargs):
        _publish_and_prune(folder, how)  # after the checkpoint was chosen, before it is read
        return build(*args, **kwargs)

    monkeypatch.setattr(factory, "build_model", build_while_training_goes_on)
    source = str(run_dir) if by == "--run" else str(folder / STEP2)
    code, err = cli(["generate", by, source, "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1, err
    assert f"{STEP2}: the checkpoint disappeared or changed while it was being loaded" in err[0], err
    assert "run the command again" in err[0] and "unchecked" not in err[0]
