"""CheckpointManager: save/load model + optimizer (DCP, resharding-safe) and the trainer state.

Layout of a run folder:
  checkpoints/step_00000100/   DCP shards (tensors only) + .metadata + trainer_state.json (every
                               non-tensor state, the optimizer's hyper-parameters included) +
                               decode_profile.json + manifest.json (size and SHA-256 of each file)
  checkpoints/latest           text file naming the newest complete checkpoint (when it is missing, the
                               newest published step_N folder is the run's checkpoint: nothing starts over)

Publishing is atomic and durable: every rank writes into `step_X.tmp`; the main rank writes the JSON
files and the manifest, fsyncs every file and the folder, renames it to `step_X`, fsyncs the parent
and only then rewrites `latest` (a temp file fsynced + os.replace). A failed save (a full disk
included) removes its `.tmp` folder; a crash mid-save leaves one that nothing reads and the next
save removes. Loading unpickles nothing but DCP metadata, and that through a restricted unpickler
(safe_read.py); the manifest is checked first, and every count a checkpoint records is bounded before use.
Pruning (keep_last_n) only removes checkpoints of this run's history: those it wrote, and those at or
before the step it resumed from once it published a newer one; a folder it would overwrite and did not
write is set aside (`step_N.replaced-K`), never deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
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
    set_aside,
    verify_checkpoint,
    write_manifest,
    write_text_durably,
)
from dllm.checkpoint.layout import (
    LATEST,
    START_OVER,
    TRAINER_STATE,
    latest_checkpoint,
    pointer_target,
    published_checkpoints,
    read_trainer_state,
    step_name,
    step_of,
)
from dllm.checkpoint.safe_read import SafeLoadPlanner, SafeReader, check_tensors, read_metadata_file
from dllm.config.profile import DecodeProfile, write_profile
from dllm.config.training import CheckpointingConfig
from dllm.errors import CheckpointError, UserError
from dllm.parallel.dims import DistEnv, all_reduce_sum, barrier

METADATA = ".metadata"  # DCP's index of the shards (a pickle: read by safe_read only)
PARAM_GROUPS = "optim_param_groups"
"""Key of trainer_state.json holding the optimizer's param_groups (kept out of DCP: no pickle)."""
_RESUME_UNCHECKED = f"{VERIFY_OFF} (in the config, or launch with --set checkpointing.verify=false)"


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
        self.start_step = 0  # the step this run went on from (`load`): checkpoints up to it are its history
        self._written: set[str] = set()  # folders this run published: pruning may remove them

    def latest(self) -> Path | None:
        """The checkpoint to resume from (`latest_checkpoint`); when `latest` is missing and a published
        folder is found instead, the main rank says so."""
        path = latest_checkpoint(self.folder)
        if path is not None and self.env.is_main and not os.path.lexists(self.folder / LATEST):
            print(
                f"dllm: {self.folder / LATEST} is missing: resuming from {path.name}, the newest complete "
                f"checkpoint; {START_OVER}, or choose another run.name",
                file=sys.stderr,
            )
        return path

    def should_save(self, step: int, total_steps: int) -> bool:
        every = self.cfg.every_steps
        return (every is not None and step % every == 0) or (step == total_steps and self.cfg.save_final)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> Path:
        final = self.folder / step_name(step)
        tmp = self.folder / f"{step_name(step)}.tmp"
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
        if final.exists() and final.name in self._written:
            shutil.rmtree(final)
        elif final.exists():  # of another timeline (latest was pointed back past it): kept, not overwritten
            kept = set_aside(final)
            print(f"dllm: {final} was not written by this run: moved it to {kept.name}", file=sys.stderr)
        os.replace(tmp, final)
        self._written.add(final.name)
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
        if groups is not None:
            check_param_groups(groups, optim_sd["param_groups"], path / TRAINER_STATE)
        optim = optim_sd if groups is None else {"state": optim_sd["state"]}
        sd = {"model": model_sd, "optim": optim}
        _read(path, sd, "the model being resumed", self.env)
        if groups is not None:
            optim = {**sd["optim"], "param_groups": groups}
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=optim, options=options)
        self.start_step = state["step"]
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
        """Keep the newest `keep_last_n` checkpoints up to the one just published, removing only this run's
        history: folders it wrote, and those at or before the step it resumed from (the one just published is
        newer). Folders of later steps (left by an interrupted timeline), of steps after the start that this
        run did not write (a start over whose old checkpoints were not moved aside), and the target of
        `latest` are left alone."""
        newest = step_of(published.name)
        assert newest is not None
        pointed = pointer_target(self.folder)
        done = sorted((step, p) for step, p in published_checkpoints(self.folder) if step <= newest)
        for step, old in done[: -self.cfg.keep_last_n]:
            mine = old.name in self._written or step <= self.start_step
            if mine and old.name not in (pointed, published.name):
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


_HYPER = ("lr", "betas", "eps", "weight_decay")
"""The hyper-parameters AdamW needs in every group (torch fills in its newer flags itself)."""


def check_param_groups(saved: Any, current: list[dict[str, Any]], where: Path) -> None:
    """The optimizer's saved parameter groups are the model's: as many, each naming the same parameters and
    holding the hyper-parameters (torch would otherwise resume with a group missing them, a KeyError at the
    first step, or silently leave a parameter's moments behind)."""
    fix = "resume with the model section it was trained with, or start a new run (another run.name)"
    if not isinstance(saved, list) or len(saved) != len(current):
        n = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise CheckpointError(f"{where}: the optimizer state has {n} parameter groups where the model's optimizer "
                              f"has {len(current)}: it does not match the model; {fix}")  # fmt: skip
    for i, (old, new) in enumerate(zip(saved, current, strict=True)):
        names = old.get("params") if isinstance(old, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise CheckpointError(f"{where}: optimizer parameter group {i} is damaged; {fix}")
        extra, lacking = sorted(set(names) - set(new["params"])), sorted(set(new["params"]) - set(names))
        missing = [k for k in _HYPER if k in new and k not in old]
        if extra:
            what = f"names {extra[0][:120]!r}, which the model does not have"
        elif lacking:
            what = f"lacks the model's {lacking[0]!r}"
        elif missing:
            what = f"lacks the hyper-parameter {missing[0]!r}"
        else:
            continue
        raise CheckpointError(f"{where}: the optimizer state does not match the model (its parameter group {i} "
                              f"{what}); {fix}")  # fmt: skip


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
