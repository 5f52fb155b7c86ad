"""CheckpointManager: save/load model + optimizer (DCP, resharding-safe) and the trainer state.

Layout of a run folder:
  checkpoints/step_00000100/   DCP shards (tensors only) + .metadata + trainer_state.json (every
                               non-tensor state, the optimizer's hyper-parameters included) +
                               decode_profile.json + manifest.json (size and SHA-256 of each file)
  checkpoints/latest           text file naming the newest complete checkpoint

Publishing is atomic and durable: every rank writes into `step_X.tmp`; the main rank writes the JSON
files and the manifest, fsyncs every file and the folder, renames it to `step_X`, fsyncs the parent
and only then rewrites `latest` (a temp file fsynced + os.replace). A failed save (a full disk
included) removes its `.tmp` folder; a crash mid-save leaves one that nothing reads and the next
save removes. Loading unpickles nothing but DCP metadata, and that through a restricted unpickler
(safe_read.py); the manifest is checked first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from dllm.checkpoint.files import (
    VERIFY_OFF,
    check_free_space,
    disk_full_error,
    fsync_dir,
    verify_checkpoint,
    write_manifest,
    write_text_durably,
)
from dllm.checkpoint.safe_read import SafeLoadPlanner, SafeReader, check_tensors, read_metadata_file
from dllm.config.profile import DecodeProfile, write_profile
from dllm.config.training import CheckpointingConfig
from dllm.errors import CheckpointError, UserError
from dllm.parallel.dims import DistEnv, all_reduce_sum, barrier

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
METADATA = ".metadata"  # DCP's index of the shards (a pickle: read by safe_read only)
PARAM_GROUPS = "optim_param_groups"
"""Key of trainer_state.json holding the optimizer's param_groups (kept out of DCP: no pickle)."""
_STEP_DIR = re.compile(r"step_(\d+)")
_RESUME_UNCHECKED = f"{VERIFY_OFF} (in the config, or launch with --set checkpointing.verify=false)"


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
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
        tensors = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
        trainer_state = {"step": step, **state, PARAM_GROUPS: optim_sd["param_groups"]}
        needed = _num_bytes(tensors)
        device = next(model.parameters()).device
        self._guarded(lambda: self._begin(tmp, needed), tmp, needed, device)
        barrier(self.env)
        with _quiet_dcp():
            save = partial(dcp.save, tensors, checkpoint_id=str(tmp), **_dcp_kwargs(self.env))
            self._guarded(save, tmp, needed, device, main_only=False)
        barrier(self.env)
        self._guarded(lambda: self._publish(tmp, final, trainer_state), tmp, needed, device)
        return final

    def _begin(self, tmp: Path, needed_bytes: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        check_free_space(self.folder, needed_bytes)

    def _publish(self, tmp: Path, final: Path, trainer_state: dict[str, Any]) -> None:
        """JSON files + manifest (every file fsynced) -> rename -> fsync the parent -> `latest`."""
        write_text_durably(tmp / TRAINER_STATE, json.dumps(trainer_state, indent=2, sort_keys=True))
        if self.profile is not None:
            write_profile(self.profile, tmp)
        write_manifest(tmp, trainer_state["step"])
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(self.folder)
        write_text_durably(self.folder / LATEST, final.name + "\n")
        self._prune(final)

    def _guarded(
        self, fn: Callable[[], Any], tmp: Path, needed_bytes: int, device: torch.device, main_only: bool = True
    ) -> None:
        """Run one part of a save (on the main rank only, or on all ranks for the collective DCP save);
        if it fails on any rank, every rank stops: the partial `tmp` folder is removed and a full disk
        is reported in one line."""
        err: BaseException | None = None
        if self.env.is_main or not main_only:
            try:
                fn()
            except BaseException as e:  # cleaned up and re-raised below
                err = e
        failed = _any_rank(err is not None, self.env, device) if main_only else err is not None
        if not failed:
            return
        if self.env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if err is None:
            raise CheckpointError(f"{tmp}: the main rank could not write this checkpoint (see its error)")
        stop = _interruption(err)
        if stop is not None:  # Ctrl-C / SIGTERM during the save: the stop goes on, not a save failure
            raise stop from None
        full = None if isinstance(err, UserError) else disk_full_error(err, self.folder, needed_bytes)
        if full is not None:
            raise full from None
        raise err

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore model and optimizer in place; returns the trainer state (step, loader, ...)."""
        path = Path(path)
        self._verify(path, next(model.parameters()).device)
        state = read_trainer_state(path)
        groups = state.pop(PARAM_GROUPS, None)  # None: written before they moved out of DCP
        options = _options(model)
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        optim = optim_sd if groups is None else {"state": optim_sd["state"]}
        sd = {"model": model_sd, "optim": optim}
        _read(path, sd, "the model being resumed", self.env)
        if groups is not None:
            optim = {**sd["optim"], "param_groups": groups}
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=optim, options=options)
        return state

    def _verify(self, path: Path, device: torch.device) -> None:
        """Check the files against the manifest: sizes on every rank, SHA-256 on the main rank only
        (each rank reading the whole checkpoint would multiply the I/O by the world size)."""
        err: CheckpointError | None = None
        try:
            verify_checkpoint(path, self.cfg.verify, hashes=self.env.is_main, opt_out=_RESUME_UNCHECKED)
        except CheckpointError as e:
            err = e
        if _any_rank(err is not None, self.env, device):
            raise err or CheckpointError(f"{path}: the main rank found a damaged file (see its error)")

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


def _num_bytes(tree: Any) -> int:
    """Bytes of the tensors in a nested state dict (a DTensor counts its global size)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_num_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_num_bytes(v) for v in tree)
    return 0


def _any_rank(flag: bool, env: DistEnv, device: torch.device) -> bool:
    """Whether `flag` is set on any rank (every rank must call this)."""
    if not env.distributed:
        return flag
    return bool(all_reduce_sum(torch.tensor([float(flag)], device=device), env).item() > 0)


def _read(path: Path, sd: dict[str, Any], what: str, env: DistEnv | None) -> None:
    """DCP-load `sd` in place from `path` through the safe reader, after checking that the model's
    tensors are in the checkpoint with their shapes; failures are one line."""
    check_tensors(read_metadata_file(path / METADATA), "model", sd["model"], path, what)
    kwargs = _dcp_kwargs(env) if env is not None else {"no_dist": True}
    try:
        with _quiet_dcp():
            dcp.load(sd, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), **kwargs)
    except CheckpointException as e:
        raise _one_line(e, path) from None


def _one_line(e: CheckpointException, path: Path) -> UserError:
    """The first rank's failure of a DCP load as a user error (a shard that is truncated or garbled)."""
    first = next(iter(e.failures.values()))[0]
    if isinstance(first, UserError):
        return first
    lines = str(first).strip().splitlines() or [""]
    return CheckpointError(f"{path}: could not be read ({type(first).__name__}: {lines[0]}); use another checkpoint")


def _pointer_target(folder: Path) -> str | None:
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer}: not text naming a step_N folder; delete {pointer} to start over") from None


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
    try:
        state = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{f}: damaged (not the JSON trainer state dllm writes); use another checkpoint")
    return state


def load_model_weights(path: Path, model: nn.Module, verify: bool = True, opt_out: str = VERIFY_OFF) -> None:
    """Load the saved (trainable) weights of a checkpoint into a single-process model, whatever world
    size saved it; frozen base weights must already be in place (see models.factory). `verify` checks
    the folder against its manifest first (files.verify_checkpoint; `opt_out`: how to turn it off)."""
    path = Path(path)
    verify_checkpoint(path, verify, opt_out=opt_out)
    options = _options(model)
    sd = {"model": get_model_state_dict(model, options=options)}
    _read(path, sd, "the model built from the run's config.yaml", None)
    set_model_state_dict(model, sd["model"], options=options)


def _interruption(err: BaseException, seen: set[int] | None = None) -> BaseException | None:
    """The stop request (KeyboardInterrupt or the launcher's Stopped: a BaseException that is not an
    Exception) behind a failed save, also when DCP wrapped it into a CheckpointException, or when it was
    raised inside a writer whose cleanup then failed (torch.save's zip writer, interrupted mid-file, raises
    its own RuntimeError on exit: the stop is that error's __context__)."""
    seen = set() if seen is None else seen
    if id(err) in seen:
        return None
    seen.add(id(err))
    if not isinstance(err, Exception) and not isinstance(err, CheckpointException):
        return err
    inner = [e for e, _trace in err.failures.values()] if isinstance(err, CheckpointException) else []
    for linked in [*inner, err.__cause__, err.__context__]:
        found = None if linked is None else _interruption(linked, seen)
        if found is not None:
            return found
    return None
