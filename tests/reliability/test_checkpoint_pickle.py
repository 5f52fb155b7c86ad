"""Security hardening: loading a checkpoint must not run code planted in it.

A payload is a harmless reduce that creates a file (and then hands back the real object, so that a
vulnerable loader carries on normally). It is planted in `.metadata` (DCP unpickles it) and in a
non-tensor item of an older-format checkpoint (DCP reads those with torch.load(weights_only=False)).
Every load path must refuse it with one line naming the file, and the file must never appear.
"""

from __future__ import annotations

import io
import json
import operator
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dllm.checkpoint.files import write_manifest
from dllm.checkpoint.loading import load_for_inference
from dllm.checkpoint.manager import PARAM_GROUPS, TRAINER_STATE
from dllm.errors import CheckpointError
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir
from tests.helpers import load_spec
from tests.reliability.ckpt_runs import STEP2, cli, resume, trained_run

# a checkpoint someone hands you comes with a manifest that matches it: no checksum stops the payload first
pytestmark = [pytest.mark.filterwarnings("ignore:.*distributed")]


class _Touch:
    """Unpickling this creates `path`."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


class _Planted:
    """Unpickling this runs the payload, then returns `real` (the load goes on as if nothing happened)."""

    def __init__(self, marker: Path, real: Any) -> None:
        self.marker, self.real = marker, real

    def __reduce__(self) -> tuple[Any, ...]:
        return (operator.getitem, ((_Touch(self.marker), self.real), 1))


@pytest.fixture
def planted(workdir: Path) -> tuple[Path, Path]:
    """(run folder whose step-2 `.metadata` carries a payload, the file the payload would create)."""
    run_dir = trained_run(workdir)
    meta_file = run_dir / "checkpoints" / STEP2 / ".metadata"
    real = pickle.loads(meta_file.read_bytes())  # our own file, written a moment ago
    marker = workdir / "PAYLOAD_RAN"
    meta_file.write_bytes(pickle.dumps(_Planted(marker, real)))
    write_manifest(run_dir / "checkpoints" / STEP2, 2)
    return run_dir, marker


def _refusal(load: Callable[[], object]) -> str:
    """The CheckpointError message of `load()`, or "" when it loaded."""
    try:
        load()
    except CheckpointError as e:
        return str(e)
    return ""


def test_inference_load_refuses_planted_metadata(planted: tuple[Path, Path]):
    run_dir, marker = planted
    message = _refusal(lambda: load_for_inference(run_dir))
    assert not marker.exists(), "the payload ran"
    assert re.search(r"step_00000002/\.metadata: refused.*operator\.getitem", message), message


def test_resume_refuses_planted_metadata(planted: tuple[Path, Path]):
    run_dir, marker = planted
    message = _refusal(lambda: resume(run_dir))
    assert not marker.exists(), "the payload ran"
    assert re.search(r"step_00000002/\.metadata: refused", message), message


@pytest.mark.parametrize("command", ["generate-run", "generate-checkpoint", "convert", "eval", "launch"])
def test_every_command_refuses_it_in_one_line(
    planted: tuple[Path, Path], command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    run_dir, marker = planted
    monkeypatch.chdir(run_dir.parent.parent)
    ckpt = str(run_dir / "checkpoints" / STEP2)
    args = {
        "generate-run": ["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"],
        "generate-checkpoint": ["generate", "--checkpoint", ckpt, "-p", "hi", "--gen-length", "4"],
        "convert": ["convert", "--to-hf", "exported", "--run", str(run_dir)],
        "eval": ["eval", "likelihood", "--run", str(run_dir), "--data", "data/prepared", "--limit", "2"],
        "launch": ["launch", "--config", "train.yaml", "--set", "training.steps=4"],
    }[command]
    code, err = cli(args, capsys)
    assert not marker.exists(), "the payload ran"
    errors = [line for line in err if line.startswith("dllm: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in "\n".join(err)
    assert ".metadata: refused" in errors[0]
    assert not marker.exists()


def test_a_pickled_optimizer_item_of_an_older_checkpoint_does_not_run(workdir: Path):
    """Before this change the optimizer's hyper-parameters were DCP byte items (pickles): a checkpoint
    in that layout still resumes, but only plain data is unpickled from it."""
    run_dir = trained_run(workdir)
    ckpt = run_dir / "checkpoints" / STEP2
    spec, _ = resolve_run_spec(load_spec(run_dir.parent.parent / "train.yaml"))
    trainer = build_trainer(spec, prepare_run_dir(spec))
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    marker = workdir / "PAYLOAD_RAN"
    optim_sd["param_groups"][0]["lr"] = _Planted(marker, 1e-3)
    for f in ckpt.iterdir():  # rewrite step 2 in the older layout: groups in DCP, no manifest
        f.unlink()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt), no_dist=True)
    _write_old_trainer_state(ckpt, trainer.state_dict())
    message = _refusal(lambda: resume(run_dir, "checkpointing.verify=false"))  # an older checkpoint, trusted
    assert not marker.exists(), "the payload ran"
    assert "optim.param_groups.0.lr" in message, message


def _write_old_trainer_state(ckpt: Path, state: dict[str, Any]) -> None:
    body = {"step": 2, **state}
    body.pop(PARAM_GROUPS, None)
    (ckpt / TRAINER_STATE).write_text(json.dumps(body))


def test_a_refused_item_is_one_line_without_a_torch_warning(tmp_path: Path):
    """A non-tensor item that is a plain pickle (protocol 4, not torch's 2): torch's unpickler printed a warning
    about the protocol before the refusal's one line."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from dllm.checkpoint.safe_read import SafeLoadPlanner

    fqn = "optim.param_groups.0.lr"
    at, size = torch.Size([0]), torch.Size([0])
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex(fqn), at, MetadataIndex(fqn), at, size)
    payload = io.BytesIO(pickle.dumps(_Planted(tmp_path / "PAYLOAD_RAN", 1e-3), protocol=4))
    with warnings.catch_warnings(record=True) as printed:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=f"refused to unpickle the checkpoint item {fqn}"):
            SafeLoadPlanner().load_bytes(item, payload)
    assert not printed, [str(w.message) for w in printed]
    assert not (tmp_path / "PAYLOAD_RAN").exists()
