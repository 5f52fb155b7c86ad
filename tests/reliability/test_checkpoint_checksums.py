"""Reliability hardening, checkpoints: checksummed checkpoints, damaged checkpoints as one line, and a NaN/Inf guard.

Every published checkpoint carries manifest.json (size + SHA-256 of each file); loading checks it, so
each kind of damage is one line naming the damaged file, on the inference path, on resume and from
the CLI. A checkpoint without a manifest that lists its files (written before manifests, or with the
manifest removed or emptied) is refused the same way until the user turns checkpointing.verify off;
it used to load with a warning, a flipped byte included. A step whose loss or gradient norm is not
finite stops the run with one line and publishes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from dllm.checkpoint.files import MANIFEST, write_manifest
from dllm.checkpoint.loading import load_for_inference
from dllm.checkpoint.manager import latest_checkpoint
from dllm.errors import CheckpointError, TrainingError
from dllm.training import trainer as trainer_mod
from tests.reliability.ckpt_runs import STEP2, cli, resume, trained_run

SHARD = "__0_0.distcp"


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 24):  # 24 bytes in the middle: tensor data
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))


def _cut(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _bigger_model(run_dir: Path) -> None:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["model"]["hidden_size"] *= 2
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


# damage -> (file the message must name, what it must say)
DAMAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "flipped shard bytes": (lambda c: _flip(c / SHARD), SHARD, "damaged"),
    "truncated shard": (lambda c: _cut(c / SHARD), SHARD, "truncated"),
    "missing shard": (lambda c: (c / SHARD).unlink(), SHARD, "missing"),
    "truncated metadata": (lambda c: _cut(c / ".metadata"), ".metadata", "truncated"),
    "bad trainer_state.json": (lambda c: (c / "trainer_state.json").write_text("{not json"), "trainer_state.json", ""),
    "edited trainer_state.json": (
        lambda c: (c / "trainer_state.json").write_text('{"step": 2, "loader": 5, "identity": []}'),
        "trainer_state.json",
        "",
    ),
    "bad manifest": (lambda c: (c / MANIFEST).write_text("[1, 2"), MANIFEST, "damaged"),
}


@pytest.fixture
def run_dir(workdir: Path) -> Path:
    return trained_run(workdir)


def _message(load: Callable[[], object]) -> str:
    with pytest.raises(CheckpointError) as e:
        load()
    return str(e.value)


def test_manifest_records_every_file(run_dir: Path):
    ckpt = run_dir / "checkpoints" / STEP2
    files = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert set(files) == {p.name for p in ckpt.iterdir()} - {MANIFEST}
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("path", ["inference", "resume"])
def test_damage_is_one_line_naming_the_file(run_dir: Path, damage: str, path: str):
    spoil, name, says = DAMAGE[damage]
    spoil(run_dir / "checkpoints" / STEP2)
    load = (lambda: load_for_inference(run_dir)) if path == "inference" else (lambda: resume(run_dir))
    message = _message(load)
    assert f"{STEP2}/{name}" in message and says in message and "\n" not in message, message


@pytest.mark.parametrize(
    "damage", ["truncated shard", "truncated metadata", "bad trainer_state.json", "edited trainer_state.json"]
)
def test_damage_without_a_manifest_is_still_one_line(run_dir: Path, damage: str):
    """An older checkpoint (no manifest) loaded unchecked: the readers themselves turn damage into one line."""
    ckpt = run_dir / "checkpoints" / STEP2
    (ckpt / MANIFEST).unlink()
    spoil, name, _ = DAMAGE[damage]
    spoil(ckpt)
    message = _message(lambda: resume(run_dir, "checkpointing.verify=false"))
    assert STEP2 in message and "\n" not in message and (name in message or "could not be read" in message), message


def test_a_config_edited_to_another_size_is_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    _bigger_model(run_dir)
    message = _message(lambda: load_for_inference(run_dir))
    assert re.search(r"step_00000002: \S+ is \[\d+, 64\] in the checkpoint but \[\d+, 128\]", message), message
    code, err = cli(["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("dllm: error:") and "config.yaml" in err[0]


def test_the_cli_reports_a_flipped_byte_in_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    _flip(run_dir / "checkpoints" / STEP2 / SHARD)
    code, err = cli(["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1 and f"{SHARD}: damaged" in err[0], err


def test_verify_false_skips_hashes_but_not_sizes(workdir: Path):
    run_dir = trained_run(workdir, "checkpointing.verify=false")
    ckpt = run_dir / "checkpoints" / STEP2
    _flip(ckpt / SHARD)
    load_for_inference(run_dir)  # the opt-out: no hashing (a flipped byte goes unseen)
    _cut(ckpt / SHARD)
    assert "truncated" in _message(lambda: load_for_inference(run_dir))


def _verify_off(run_dir: Path) -> None:
    """What the refusal tells a user who trusts the checkpoint: checkpointing.verify: false in the run's config."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg["checkpointing"]["verify"] = False
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))


def _empty_manifest(ckpt: Path) -> None:
    body = json.loads((ckpt / MANIFEST).read_text())
    (ckpt / MANIFEST).write_text(json.dumps({**body, "files": {}}))


STRIP: dict[str, Callable[[Path], None]] = {
    "manifest removed": lambda c: (c / MANIFEST).unlink(),
    "manifest emptied": _empty_manifest,
    "file added": lambda c: (c / "extra.distcp").write_bytes(b"\0" * 64),
}


@pytest.mark.parametrize("strip", list(STRIP))
def test_a_checkpoint_without_a_full_manifest_is_refused(run_dir: Path, strip: str,
                                                         capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """Removing or emptying the manifest used to turn the check off: a flipped byte then loaded with a warning."""
    ckpt = run_dir / "checkpoints" / STEP2
    _flip(ckpt / SHARD)
    STRIP[strip](ckpt)
    code, err = cli(["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("dllm: error: "), err
    assert f"set checkpointing.verify: false in {run_dir / 'config.yaml'}" in err[0], err
    assert "--set checkpointing.verify=false" in _message(lambda: resume(run_dir))


def test_an_older_checkpoint_loads_when_the_user_turns_verify_off(run_dir: Path):
    (run_dir / "checkpoints" / STEP2 / MANIFEST).unlink()  # as written before checkpoints carried one
    _verify_off(run_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user said so: no warning either
        load_for_inference(run_dir)
    assert len(resume(run_dir, "checkpointing.verify=false")) == 2


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_a_non_finite_step_stops_the_run_and_publishes_nothing(
    workdir: Path, poison: str, monkeypatch: pytest.MonkeyPatch
):
    """Steps 1-2 train and publish step 2; step 3 turns NaN (in its loss, or only in its gradients)."""
    every_step = "checkpointing.every_steps=1"
    run_dir = trained_run(workdir, every_step)
    real = trainer_mod.run_model

    def poisoned(model, inputs):
        out = real(model, inputs)
        if poison == "loss":
            return dataclasses.replace(out, hidden_BLE=out.hidden_BLE * float("nan"))
        out.hidden_BLE.register_hook(lambda g: g * float("inf"))  # a finite loss, an infinite gradient
        return out

    monkeypatch.setattr(trainer_mod, "run_model", poisoned)
    with pytest.raises(TrainingError, match=r"^step 3: the (loss|gradient norm) is (nan|inf)") as e:
        resume(run_dir, every_step, steps=5)
    assert "\n" not in str(e.value)
    assert latest_checkpoint(run_dir / "checkpoints").name == STEP2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000001", STEP2]
    assert all(torch.isfinite(p).all() for p in load_for_inference(run_dir).model.parameters())


def test_a_latest_pointer_that_is_not_text_is_one_line(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    (run_dir / "checkpoints" / "latest").write_bytes(b"\xff\xfestep")
    code, err = cli(["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1 and "checkpoints/latest: not text naming a step_N folder" in err[0], err
    assert "latest: not text" in _message(lambda: resume(run_dir))


@pytest.mark.parametrize(("key", "value"), [("mask_id", "vocab"), ("mask_id", 10**6), ("eos_id", -1),
                                            ("num_tokens", "vocab + 1")])  # fmt: skip
def test_a_profile_whose_ids_do_not_fit_the_model_is_one_line(run_dir: Path, key: str, value: object,
                                                              capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """An edited (or another model's) decode_profile.json, sealed in the manifest as if written so: sampling
    used to index the embedding with it (IndexError)."""
    ckpt = run_dir / "checkpoints" / STEP2
    vocab = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["vocab_size"]
    profile = json.loads((ckpt / "decode_profile.json").read_text())
    profile[key] = eval(value, {"vocab": vocab}) if isinstance(value, str) else value
    (ckpt / "decode_profile.json").write_text(json.dumps(profile))
    write_manifest(ckpt, 2)
    code, err = cli(["generate", "--run", str(run_dir), "-p", "hi", "--gen-length", "4"], capsys)
    assert code == 2 and len(err) == 1 and f"{STEP2}/decode_profile.json: " in err[0] and key in err[0], err
