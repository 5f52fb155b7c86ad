"""Reliability hardening, pruning: pruning must never delete the checkpoint just published or `latest`'s target.

Pruning used to sort every `step_*` folder and keep the last `keep_last_n`: an orphan folder of a
later step (left by an interrupted timeline or copied in) made it delete the checkpoint it had just
published, leaving `latest` naming a deleted folder, and folders a user named `step_..._keep` were
deleted too. It now keeps the newest `keep_last_n` up to the published step and touches nothing else.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dllm.checkpoint.inference import load_for_inference
from dllm.checkpoint.manager import latest_checkpoint
from tests.reliability.ckpt_runs import STEP2, resume, trained_run

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
