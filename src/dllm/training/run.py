"""Run folders and the worker entry point.

`prepare_run_dir` (in the launching process) creates output_dir/name, writes the resolved config
there, points output_dir/latest at it and refuses to mix a different model into a folder that
already holds checkpoints; `launching` puts config.yaml and the link back when the launch then trains
nothing (the workers refused the resume: a damaged checkpoint, another tokenizer). Workers
(`python -m dllm.training.worker RUN_DIR/config.yaml`) read that resolved config. In a multi-node
run only node rank 0 prepares the folder; the workers of every node read its config.yaml and check
it against the digest of what their own launch resolved.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from dllm.checkpoint.files import disk_full_error, set_aside, write_text_durably
from dllm.checkpoint.layout import has_checkpoints
from dllm.config.loading import dump_config, load_config
from dllm.config.spec import LATEST_RUN_LINK, RunSpec
from dllm.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from dllm.training.loop import TrainLoop

CONFIG_NAME = "config.yaml"


def run_dir_of(spec: RunSpec) -> Path:
    return Path(spec.run.output_dir) / spec.run.name


def prepare_run_dir(spec: RunSpec) -> Path:
    run_dir = run_dir_of(spec)
    cfg_path = run_dir / CONFIG_NAME
    has_ckpt = has_checkpoints(run_dir / "checkpoints")  # `latest`, or published folders without it
    if has_ckpt and spec.checkpointing.resume == "auto" and cfg_path.is_file():
        _check_same_model(spec, cfg_path)
    if has_ckpt and spec.checkpointing.resume == "never":
        _set_aside(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    text = dump_config(spec)
    try:
        write_text_durably(cfg_path, text)
    except OSError as e:
        full = disk_full_error(e, run_dir, len(text.encode()))
        if full is None:
            raise
        raise full from None
    _point_latest(run_dir)
    return run_dir


@contextmanager
def launching(spec: RunSpec) -> Iterator[Path]:
    """`prepare_run_dir` for a launch whose workers run in the block. When the block fails before the run
    logged or saved anything (the workers refused to resume it, or could not start), an existing run folder
    is put back as the launch found it: its config.yaml and the output_dir/latest link."""
    run_dir = run_dir_of(spec)
    found = _Found.of(run_dir) if run_dir.is_dir() else None
    run_dir = prepare_run_dir(spec)
    progress = _progress(run_dir)
    try:
        yield run_dir
    except BaseException:
        if found is not None and _progress(run_dir) == progress:
            found.put_back(run_dir)
        raise


@dataclass(frozen=True)
class _Found:
    """What `prepare_run_dir` rewrites, as it was before."""

    config: str | None
    latest: str | None
    """Where output_dir/latest pointed (None: no such link)."""

    @classmethod
    def of(cls, run_dir: Path) -> _Found:
        cfg_path, link = run_dir / CONFIG_NAME, run_dir.parent / LATEST_RUN_LINK
        config = cfg_path.read_text(encoding="utf-8") if cfg_path.is_file() else None
        return cls(config, os.readlink(link) if link.is_symlink() else None)

    def put_back(self, run_dir: Path) -> None:
        cfg_path = run_dir / CONFIG_NAME
        if self.config is None:
            cfg_path.unlink(missing_ok=True)
        else:
            write_text_durably(cfg_path, self.config)
        if self.latest is not None:
            _point_latest(run_dir, self.latest)


def _progress(run_dir: Path) -> tuple[object, ...]:
    """What training changes first: the metrics log (opened once a resume is accepted) and the checkpoints."""
    metrics, pointer = run_dir / "metrics.jsonl", run_dir / "checkpoints" / "latest"
    logged = (metrics.stat().st_size, metrics.stat().st_mtime_ns) if metrics.is_file() else None
    return logged, pointer.read_bytes() if pointer.is_file() else None


# how attention is computed, not what: every backend is exact, so a resumed run may change them
_KERNEL_FIELDS = ("attention_backend", "flex_compile")


def _with_new_defaults(saved: dict | None, section: BaseModel) -> dict | None:
    """A saved section with the fields this version added since filled in with their defaults: a run
    saved before a field existed behaved as its default, so it resumes."""
    if not isinstance(saved, dict) or saved.get("name", None) != getattr(section, "name", None):
        return saved
    filled = dict(saved)
    for key, field in type(section).model_fields.items():
        if key not in filled and not field.is_required():
            filled[key] = to_jsonable_python(field.get_default(call_default_factory=True))
    return filled


def _check_same_model(spec: RunSpec, cfg_path: Path) -> None:
    saved = yaml.safe_load(cfg_path.read_text(encoding="utf-8")) or {}
    new = spec.model_dump(mode="json")
    old = {s: _with_new_defaults(saved.get(s), getattr(spec, s)) for s in ("model", "tokenizer", "objective")}
    for cfg in (old.get("model") or {}, new["model"]):
        for key in _KERNEL_FIELDS:
            cfg.pop(key, None)
    for section in ("model", "tokenizer", "objective"):
        before = old[section]
        if before != new[section]:
            diff = sorted(k for k in new[section] if (before or {}).get(k) != new[section][k])
            where = ", ".join(f"{section}.{k}" for k in diff) or section
            raise CheckpointError(
                f"{cfg_path.parent} holds checkpoints of a different {section} ({where} changed); "
                "use another run.name, or set checkpointing.resume: never to start over"
            )


def _set_aside(folder: Path) -> None:
    """Starting over in a folder with checkpoints: keep the old ones, renamed, so that nothing
    resumes from them by accident and nothing is deleted."""
    target = set_aside(folder)
    print(f"dllm: checkpointing.resume is never: moved the old checkpoints to {target}", file=sys.stderr)


def _point_latest(run_dir: Path, target: str | None = None) -> None:
    """output_dir/latest -> `target` (default: `run_dir`'s name, a relative link), replaced atomically."""
    link = run_dir.parent / LATEST_RUN_LINK
    tmp = run_dir.parent / f".{LATEST_RUN_LINK}.tmp-{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target or run_dir.name)
    os.replace(tmp, link)


def resume_notes(spec: RunSpec) -> list[str]:
    """What a launch of `spec` over an existing run does, said before `prepare_run_dir` rewrites its config.yaml:
    the step it resumes at and, when the new config changes the learning-rate plan, what the LR does. The LR
    schedule is a function of the step and the config (training/lr.py): a checkpoint keeps only its step, so
    a resumed run follows the schedule of the config it is launched with, over that config's training.steps."""
    from dllm.checkpoint.layout import latest_checkpoint, read_trainer_state

    run_dir = run_dir_of(spec)
    try:
        latest = latest_checkpoint(run_dir / "checkpoints") if spec.checkpointing.resume == "auto" else None
        step = int(read_trainer_state(latest)["step"]) if latest is not None else None
    except (CheckpointError, KeyError, TypeError, ValueError):
        return []  # a damaged checkpoint: the workers refuse it with their own line
    if step is None:
        return []
    notes = [f"resuming {run_dir} at step {step} ({latest.name}) of training.steps {spec.training.steps}"]
    if step >= spec.training.steps:
        notes.append(f"nothing to train: step {step} is at or past training.steps {spec.training.steps}; raise it "
                     "(--set training.steps=N) to train on")  # fmt: skip
    lr_note = _lr_note(run_dir / CONFIG_NAME, spec, step)
    return notes + ([lr_note] if lr_note else [])


def _lr_note(saved_config: Path, spec: RunSpec, step: int) -> str | None:
    """One line when the new config changes the learning rate of the next step (training.steps, scheduler or
    optimizer.lr changed since the run's config.yaml): the LR before and after, and how to extend a run."""
    from dllm.config.training import SchedulerConfig
    from dllm.training.lr import LRSchedule

    try:
        saved = yaml.safe_load(saved_config.read_text(encoding="utf-8"))
        old_steps, old_lr = int(saved["training"]["steps"]), float(saved["optimizer"]["lr"])
        old_sched = SchedulerConfig.model_validate(saved.get("scheduler") or {})
    except (OSError, yaml.YAMLError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        return None  # no readable saved plan to compare with
    new_steps, new_lr, new_sched = spec.training.steps, spec.optimizer.lr, spec.scheduler
    if (old_steps, old_lr, old_sched) == (new_steps, new_lr, new_sched) or step >= new_steps:
        return None
    before = LRSchedule(old_sched, old_lr, old_steps).lr_at(max(step - 1, 0))
    after = LRSchedule(new_sched, new_lr, new_steps).lr_at(step)
    what = f"training.steps {old_steps} -> {new_steps}" if old_steps != new_steps else "the scheduler or optimizer.lr"
    return (
        f"{what}: the LR schedule is recomputed from the new config over training.steps {new_steps} (a checkpoint "
        f"keeps only its step), so the learning rate goes from {before:.3g} at step {step} to {after:.3g} at step "
        f"{step + 1} and follows the {new_sched.name} schedule of {new_steps} steps from there; to extend a run on "
        "one schedule, give training.steps its final value from the first launch, or train a new run from this "
        "one's weights (dllm convert --to-hf DIR --run RUN, then model.init_from: DIR)"
    )


def config_digest(text: str) -> str:
    """SHA-256 of a resolved config's text (what `prepare_run_dir` writes is `dump_config(spec)`)."""
    return hashlib.sha256(text.encode()).hexdigest()


def train_from_run_dir(run_dir: Path, config_sha256: str | None = None) -> list[float]:
    """Build and run the trainer described by RUN_DIR/config.yaml (one worker process). With
    `config_sha256` (multi-node), every rank first agrees that the file is what its launch resolved."""
    from dllm.parallel.dims import DistEnv
    from dllm.training.build import build_trainer

    cfg_path = run_dir / CONFIG_NAME
    text = cfg_path.read_text(encoding="utf-8")
    spec = load_config(RunSpec, cfg_path)
    env = DistEnv.from_environ()
    trainer = build_trainer(spec, run_dir, env)
    try:
        if config_sha256 is not None:
            _check_same_config(cfg_path, config_digest(text) != config_sha256, trainer)
        return trainer.fit()
    finally:
        trainer.metrics.close()
        if env.distributed:
            _keep_until_exit(trainer)


def _check_same_config(cfg_path: Path, differs: bool, trainer: TrainLoop) -> None:
    """Every rank stops with a ConfigError when any node's launch resolved another config than the
    one node rank 0 wrote (other flags or overrides on that node, or a stale copy of the file on a
    shared filesystem), instead of training node rank 0's config silently."""
    import torch

    from dllm.parallel.dims import all_reduce_sum

    flag = torch.tensor([float(differs)], device=trainer.device)
    if all_reduce_sum(flag, trainer.env).item() == 0:
        return
    what = "what this node's launch resolved" if differs else "what another node's launch resolved"
    raise ConfigError(
        f"{cfg_path} (written by node rank 0) differs from {what}; start every node with the same config "
        "file and --set overrides"
    )


_KEPT: list[object] = []


def _keep_until_exit(trainer: object) -> None:
    """A distributed worker keeps its trainer (the model, DDP's reducer, the process groups they hold)
    until the process ends, and the worker ends with `os._exit` (training/worker.py), so no gloo
    process group is ever torn down from Python: ~ProcessGroupGloo joins its worker threads while the
    caller holds the GIL, and a worker thread that is still releasing a finished collective's tensors
    needs the GIL, so `destroy_process_group` or the reducer's dealloc after a collective could hang
    forever (seen on 2-process DDP runs: the last checkpoint's all-reduce, then a hang at exit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank is done with its collectives before any of them leaves
    _KEPT.append(trainer)
