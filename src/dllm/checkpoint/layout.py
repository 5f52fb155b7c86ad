"""Where a run's checkpoints are: the `step_N` folders of its checkpoints folder and the `latest` pointer.

Torch-free, so the launcher and `dllm runs` find checkpoints without loading torch. Every name read from
disk is matched strictly (ASCII digits, the exact form `step_name` writes, a bounded step), and `latest`
is read bounded from a regular file only. When `latest` is missing (deleted by hand, or left out of a
copy), the newest published folder is the run's checkpoint: a run never starts over beside complete
checkpoints by accident.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from dllm.config.training import MAX_STEPS
from dllm.config.untrusted import count, open_regular, read_json
from dllm.errors import CheckpointError

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_([0-9]{8,13})")  # ASCII digits, as step_name writes them up to MAX_STEPS
_MAX_POINTER_BYTES = 64  # `latest` holds one folder name
START_OVER = "set checkpointing.resume: never to start over (the old checkpoints are moved aside)"


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a published checkpoint folder name, exactly as `step_name` writes it (None for `.tmp`
    folders and anything else)."""
    m = _STEP_DIR.fullmatch(name)
    step = int(m.group(1)) if m else None
    return step if step is not None and step <= MAX_STEPS and step_name(step) == name else None


def pointer_target(folder: Path) -> str | None:
    """The folder name `latest` holds (None: no `latest`), read bounded, from a regular file only."""
    pointer = folder / LATEST
    if not os.path.lexists(pointer):
        return None
    try:
        with open_regular(pointer) as fh:
            raw = fh.read(_MAX_POINTER_BYTES + 1)
        text = raw.decode("utf-8").strip() if len(raw) <= _MAX_POINTER_BYTES else None
    except FileNotFoundError:  # removed since: as if it never was
        return None
    except UnicodeDecodeError:
        text = None
    if text is None:
        raise CheckpointError(f"{pointer}: not text naming a step_N folder; {_repair(pointer)}")
    return text


def _repair(pointer: Path) -> str:
    return f"delete {pointer} to resume from the newest complete checkpoint, or {START_OVER}"


def published_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint of a checkpoints folder, by step: `step_N` folders
    holding their trainer state (a `.tmp` folder of an unfinished save is not one)."""
    if not Path(folder).is_dir():
        return []
    found = ((step_of(p.name), p) for p in Path(folder).iterdir())
    # lexists: a trainer state that is not a regular file is refused when read, not taken for a missing one
    return sorted((step, p) for step, p in found if step is not None and os.path.lexists(p / TRAINER_STATE))


def has_checkpoints(folder: Path) -> bool:
    """Whether a checkpoints folder holds anything a run resumes from: `latest` or a published checkpoint."""
    return os.path.lexists(Path(folder) / LATEST) or bool(published_checkpoints(folder))


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest published checkpoint of a checkpoints folder, or None: the one `latest` names, or, when
    `latest` is missing (deleted by hand, or left out of a copy), the newest published step folder, so that
    a run never starts over (and prunes) beside complete checkpoints by accident."""
    pointer = Path(folder) / LATEST
    name = pointer_target(Path(folder))
    if name is None:
        published = published_checkpoints(folder)
        return published[-1][1] if published else None
    if step_of(name) is None:  # only a folder of this one: nothing elsewhere on disk
        raise CheckpointError(f"{pointer}: names {name[:80]!r}, not a step_N folder; {_repair(pointer)}")
    path = Path(folder) / name
    if not os.path.lexists(path / TRAINER_STATE):
        raise CheckpointError(f"{pointer} names {path.name}, which is incomplete; {_repair(pointer)}")
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint folder, its step checked: a count, the step of a `step_N` folder."""
    f = Path(path) / TRAINER_STATE
    advice = "use another checkpoint"
    try:
        state = read_json(f, "the JSON trainer state dllm writes", advice)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a dllm checkpoint (no {TRAINER_STATE})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f}: damaged (not the JSON trainer state dllm writes); {advice}")
    try:
        step = count(state.get("step"), "step", MAX_STEPS)
    except ValueError as e:
        raise CheckpointError(f"{f}: damaged ({e}); {advice}") from None
    named = step_of(Path(path).name)
    if named is not None and named != step:
        raise CheckpointError(f"{f}: records step {step} in the folder of step {named}; {advice}")
    return state
