"""CheckpointManager: save/load model + optimizer (DCP, resharding-safe) and the trainer state.

Layout of a run folder:
  checkpoints/step_00000100/   DCP shards + .metadata + trainer_state.json + decode_profile.json
  checkpoints/latest           text file naming the newest complete checkpoint

Publishing is atomic: every rank writes into `step_X.tmp`, then the main rank renames it to
`step_X` and only then rewrites `latest` (write to a temp file + os.replace). A crash mid-save leaves
a `.tmp` folder that nothing reads and the next save removes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from dllm.config.profile import DecodeProfile, write_profile
from dllm.config.training import CheckpointingConfig
from dllm.errors import CheckpointError
from dllm.parallel.dims import DistEnv, barrier

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(name: str) -> int | None:
    """The step of a published checkpoint folder name (None for `.tmp` folders and anything else)."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def _options(model: nn.Module) -> StateDictOptions:
    """Checkpoints hold what trains: frozen parameters (a LoRA base) are rebuilt from the config,
    not saved, and are then absent when loading (hence strict only without them)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def _dcp_kwargs(env: DistEnv) -> dict[str, Any]:
    return {} if env.distributed else {"no_dist": True}


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns when used without a process group, which is how one process is meant to use it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed\..*")
        yield


class CheckpointManager:
    def __init__(
        self, folder: Path, cfg: CheckpointingConfig, env: DistEnv, profile: DecodeProfile | None = None
    ) -> None:
        self.folder = Path(folder)
        self.cfg = cfg
        self.env = env
        self.profile = profile  # written into every checkpoint: how its model decodes

    def latest(self) -> Path | None:
        return latest_checkpoint(self.folder)

    def should_save(self, step: int, total_steps: int) -> bool:
        every = self.cfg.every_steps
        return (every is not None and step % every == 0) or (step == total_steps and self.cfg.save_final)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
        final = self.folder / _step_name(step)
        tmp = self.folder / f"{_step_name(step)}.tmp"
        if self.env.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
        barrier(self.env)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        with _quiet_dcp():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), **_dcp_kwargs(self.env))
        barrier(self.env)
        if self.env.is_main:
            (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, **state}, indent=2, sort_keys=True))
            if self.profile is not None:
                write_profile(self.profile, tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_latest(self.folder, final.name)
            self._prune(final)
        barrier(self.env)
        return final

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place; returns the trainer state (step, loader, ...)."""
        options = _options(model)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        sd = {"model": model_sd, "optim": optim_sd}
        with _quiet_dcp():
            dcp.load(sd, checkpoint_id=str(path), **_dcp_kwargs(self.env))
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
        return read_trainer_state(path)

    def _prune(self, published: Path) -> None:
        """Keep the newest `keep_last_n` checkpoints up to the one just published. Folders of later
        steps (left by an interrupted timeline) are not this run's history and are left alone, and
        the target of `latest` is never removed."""
        newest = _step_of(published.name)
        assert newest is not None
        pointed = _pointer_target(self.folder)
        done = sorted(
            (step, p)
            for p in self.folder.iterdir()
            if (step := _step_of(p.name)) is not None and step <= newest and p.is_dir()
        )
        for _, old in done[: -self.cfg.keep_last_n]:
            if old.name not in (pointed, published.name):
                shutil.rmtree(old, ignore_errors=True)


def _write_latest(folder: Path, name: str) -> None:
    tmp = folder / f"{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, folder / LATEST)


def _pointer_target(folder: Path) -> str | None:
    pointer = folder / LATEST
    return pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest published checkpoint of a checkpoints folder, or None."""
    pointer = Path(folder) / LATEST
    name = _pointer_target(Path(folder))
    if name is None:
        return None
    if _step_of(name) is None:  # only a folder of this one: nothing elsewhere on disk
        raise CheckpointError(f"{pointer}: names {name[:80]!r}, not a step_N folder; delete {pointer} to start over")
    path = Path(folder) / name
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete; delete {pointer} to start over")
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    f = Path(path) / TRAINER_STATE
    if not f.is_file():
        raise CheckpointError(f"{path}: not a dllm checkpoint (no {TRAINER_STATE})")
    return json.loads(f.read_text())


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Load the saved (trainable) weights of a checkpoint into a single-process model, whatever world
    size saved it; frozen base weights must already be in place (see models.factory)."""
    options = _options(model)
    sd = {"model": get_model_state_dict(model, options=options)}
    with _quiet_dcp():
        dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    set_model_state_dict(model, sd["model"], options=options)
