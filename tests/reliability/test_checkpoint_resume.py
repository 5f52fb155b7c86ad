"""Reliability hardening, resume: a run never starts over beside its checkpoints, never prunes what it did
not write, and refuses a trainer state whose counts or optimizer groups do not fit before writing anything.

Deleting `checkpoints/latest` (as the tool's own errors once advised for starting over) made `resume: auto`
train from step 0 and, with keep_last_n 1, prune the complete checkpoint. Now the newest published folder
is resumed with a one-line notice, `resume: never` moves such folders aside as it does with `latest`, and
pruning only removes this run's history. A negative step used to be trained and published as
`step_-0000004` (then an AssertionError), a huge loader position was accepted, and an optimizer state of
renamed parameters either trained silently without their moments or failed with KeyError 'betas'.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dllm.checkpoint.files import write_manifest
from dllm.checkpoint.manager import latest_checkpoint
from dllm.config.loading import dump_config
from dllm.errors import CheckpointError
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import train_from_run_dir
from tests.helpers import load_spec
from tests.reliability.ckpt_runs import STEP2, resume, trained_run

STEP4 = "step_00000004"
KEEP1 = "checkpointing.keep_last_n=1"


def _folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())


def test_a_run_whose_latest_was_deleted_resumes_from_its_newest_checkpoint(
    workdir: Path, capsys: pytest.CaptureFixture[str]
):
    run_dir = trained_run(workdir, KEEP1)
    (run_dir / "checkpoints" / "latest").unlink()
    capsys.readouterr()
    assert len(resume(run_dir, KEEP1)) == 2  # steps 3 and 4: not from step 0
    err = capsys.readouterr().err
    assert f"checkpoints/latest is missing: resuming from {STEP2}, the newest complete checkpoint" in err, err
    assert "checkpointing.resume: never" in err and "starting at step 0" not in err, err
    assert latest_checkpoint(run_dir / "checkpoints").name == STEP4
    assert not (run_dir / "metrics.jsonl.1").exists()


def test_resume_never_moves_aside_checkpoints_without_latest(workdir: Path):
    run_dir = trained_run(workdir, KEEP1)
    (run_dir / "checkpoints" / "latest").unlink()
    assert len(resume(run_dir, KEEP1, "checkpointing.resume=never")) == 4
    assert (run_dir / "checkpoints.replaced-1" / STEP2 / "trainer_state.json").is_file()


def _start_over_by_hand(run_dir: Path, *overrides: str) -> None:
    """A worker started on the run folder with `resume: never` and no launcher (nothing moved aside)."""
    yaml_path = run_dir.parent.parent / "train.yaml"
    spec, _ = resolve_run_spec(load_spec(yaml_path, "checkpointing.resume=never", *overrides))
    (run_dir / "config.yaml").write_text(dump_config(spec))
    train_from_run_dir(run_dir)


def test_a_run_started_over_beside_checkpoints_neither_prunes_nor_overwrites_them(workdir: Path):
    run_dir = trained_run(workdir, KEEP1)
    folder = run_dir / "checkpoints"
    shutil.copytree(folder / STEP2, folder / "step_00000003")  # an older timeline's checkpoint
    old = (folder / STEP2 / "trainer_state.json").read_text()
    _start_over_by_hand(run_dir, KEEP1, "training.steps=4")  # publishes steps 2 and 4, prunes after each
    assert _folders(run_dir) == [f"{STEP2}.replaced-1", "step_00000003", STEP4]  # its own step 2 pruned
    assert (folder / f"{STEP2}.replaced-1" / "trainer_state.json").read_text() == old


def test_a_checkpoint_latest_was_pointed_back_past_is_set_aside_not_overwritten(workdir: Path):
    """The errors' advice for a damaged checkpoint: name an older one in `latest`; the newer is kept aside."""
    run_dir = trained_run(workdir, "training.steps=4")
    (run_dir / "checkpoints" / "latest").write_text(STEP2 + "\n")
    assert len(resume(run_dir, steps=4)) == 2
    assert _folders(run_dir) == [STEP2, STEP4, f"{STEP4}.replaced-1"]
    assert latest_checkpoint(run_dir / "checkpoints").name == STEP4


def _edit_state(run_dir: Path, edit, manifest_step: int = 2) -> None:
    """Change trainer_state.json and seal it in the manifest, as if the checkpoint had been written so."""
    ckpt = run_dir / "checkpoints" / STEP2
    state = json.loads((ckpt / "trainer_state.json").read_text())
    edit(state)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt, manifest_step)


def _set(path: str, value: object):
    def edit(state: dict) -> None:
        *parents, key = path.split(".")
        for p in parents:
            state = state[p]
        state[key] = value

    return edit


@pytest.mark.parametrize(
    ("path", "value"),
    [("step", -5), ("step", True), ("step", 10**15), ("step", 3), ("lr_schedule.step", -1), ("loader.position", 10**15),
     ("loader.position", 2.5), ("loader.seed", -1), ("noise.group_size", 0), ("noise.seed", "7")],
)  # fmt: skip
def test_a_count_out_of_range_is_refused_before_anything_is_written(workdir: Path, path: str, value: object):
    run_dir = trained_run(workdir)
    _edit_state(run_dir, _set(path, value))
    metrics = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError) as e:
        resume(run_dir)
    msg = str(e.value)
    assert "\n" not in msg and f"{STEP2}/trainer_state.json: " in msg and path.split(".")[-1] in msg, msg
    assert _folders(run_dir) == [STEP2] and latest_checkpoint(run_dir / "checkpoints").name == STEP2
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_a_manifest_recording_a_negative_step_is_refused(workdir: Path):
    run_dir = trained_run(workdir)
    _edit_state(run_dir, _set("step", -5), manifest_step=-5)
    with pytest.raises(CheckpointError, match=r"manifest.json: damaged or not a dllm checkpoint manifest"):
        resume(run_dir)
    assert _folders(run_dir) == [STEP2]


def _rename_group(index: int, prefix: str):
    def edit(state: dict) -> None:
        group = state["optim_param_groups"][index]
        group["params"] = [prefix + n for n in group["params"]]

    return edit


@pytest.mark.parametrize(
    ("edit", "says"),
    [(_rename_group(1, "renamed."), "names 'renamed."),
     (lambda s: s["optim_param_groups"][0]["params"].pop(), "lacks the model's"),
     (lambda s: s["optim_param_groups"][0].pop("betas"), "lacks the hyper-parameter 'betas'"),
     (lambda s: s["optim_param_groups"].pop(), "1 parameter groups where the model's optimizer has 2")],
)  # fmt: skip
def test_an_optimizer_state_of_other_parameters_is_one_line(workdir: Path, edit, says: str):
    run_dir = trained_run(workdir)
    _edit_state(run_dir, edit)
    with pytest.raises(CheckpointError) as e:
        resume(run_dir)
    msg = str(e.value)
    assert "\n" not in msg and "the optimizer state" in msg and says in msg, msg
    assert "does not match the model" in msg and "start a new run" in msg, msg
    assert _folders(run_dir) == [STEP2]
