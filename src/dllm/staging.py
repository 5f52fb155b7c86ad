"""Output folders written whole: staged in a temporary sibling folder and renamed into place.

A command that writes a folder (`dllm data prepare`, `dllm convert`) writes into `.NAME.tmp-PID` next
to its output and renames that into place at the end, so a failure (a full disk included) leaves
nothing. It only ever replaces a previous output of its own kind (`OutputKind`), as a unit, and only
when that holds nothing but the files it wrote: a file a user put inside is never deleted, and a folder
that holds one of the command's inputs is never replaced.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dllm.errors import UserError


@dataclass(frozen=True)
class OutputKind:
    """What one command writes, for the checks of `staged_folder`."""

    what: str
    """The kind in messages: 'a dllm artifact'."""
    marker: str
    """How a previous output is recognised, for messages: 'no manifest.json of this format'."""
    files_of: Callable[[Path], set[str] | None]
    """The names of the files a previous output in that folder wrote (its marker included); None: not one."""
    error: type[UserError]
    stage_files: frozenset[str] = frozenset()
    """Names a staging folder of this kind may hold, for removing those of killed processes (an empty one is
    removed whatever this says); empty: only empty ones."""


def unwritable_problem(folder: Path) -> str | None:
    """Why `folder` cannot be made or written here, None when it can: a folder made (and removed) in its nearest
    existing parent proves it (a file in the way, or a read-only place, would otherwise fail after the work)."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file; give a folder"
    parent = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    if not parent.is_dir():
        return f"{parent} is a file, not a folder; choose another output folder"
    try:
        Path(tempfile.mkdtemp(dir=parent, prefix=".dllm-probe-")).rmdir()
    except OSError as e:
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or type(e).__name__).lower()
        return f"cannot write in {parent} ({reason}); choose another output folder"
    return None


@contextmanager
def staged_folder(output: Path, kind: OutputKind, overwrite: bool, keep: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield a temporary folder next to `output`; on success rename it to `output`, replacing a previous
    output of `kind` (`check_replaceable`). On failure it is removed with the parent folders created here,
    and a full disk is one line. Staging folders of killed runs are cleaned up."""
    output = Path(os.path.abspath(output))
    check_replaceable(output, kind, overwrite, keep)
    created = _make_parents(output.parent, kind.error)
    stage = output.parent / f".{output.name}.tmp-{os.getpid()}"
    try:
        remove_stale_stages(output, kind.stage_files)
        if stage.exists():  # left by an earlier process with our PID, so a dead one
            shutil.rmtree(stage)
        _mkdir(stage, kind.error)
        yield stage
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_created(created)
        if isinstance(e, Exception) and not isinstance(e, UserError) and disk_full(e):
            raise kind.error(f"{output}: no space left on the disk; free some space or choose another output") from None
        raise
    trash = output.parent / f".{output.name}.old-{os.getpid()}"
    if os.path.lexists(output):
        os.replace(output, trash)
    os.replace(stage, output)
    shutil.rmtree(trash, ignore_errors=True)


def check_replaceable(output: Path, kind: OutputKind, overwrite: bool, keep: Iterable[Path] = ()) -> None:
    """Refuse an existing `output` unless it is a previous output of `kind` holding only its own files,
    `overwrite` is set, and it is not and holds nothing in `keep` (the command's inputs)."""
    if not os.path.lexists(output):
        return
    owned = kind.files_of(output) if output.is_dir() and not output.is_symlink() else None
    if owned is None:
        raise kind.error(
            f"{output} exists and is not {kind.what} ({kind.marker}); choose another output "
            f"(--overwrite only replaces {kind.what})"
        )
    if not overwrite:
        raise kind.error(f"{output} already exists; pass --overwrite to replace it")
    real = output.resolve()
    for path in keep:
        p = Path(path).resolve()
        if p == real or real in p.parents:
            raise kind.error(f"{output} holds {path}, which replacing it would delete; choose another output")
    others = sorted(set(os.listdir(output)) - owned)
    if others:
        raise kind.error(
            f"{output} holds {others[0]} ({len(others)} file(s) in all), which is not part of {kind.what}; "
            "replacing it would delete them: move them out, or choose another output"
        )


def disk_full(exc: BaseException) -> bool:
    """Whether an error comes from a full disk or quota: an errno in the exception, its causes and contexts,
    or the per-rank failures torch.distributed.checkpoint wraps (torch.save reports a full disk as
    `unexpected pos`, with the OSError only as its context; safetensors as an IoError in its message)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(e) or "StorageFull" in str(e):
            return True
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        todo += [pair[0] for pair in getattr(e, "failures", {}).values()]
    return False


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def remove_stale_stages(output: Path, stage_files: frozenset[str]) -> list[Path]:
    """Remove the staging folders `.NAME.tmp-PID` of `output` left by killed processes.

    Only folders of exactly that name whose process is gone and which hold nothing, or nothing but
    `stage_files` (a process killed before it wrote a file leaves an empty one, whatever its kind);
    anything else (a live run, a user's file, another name) is left alone."""
    prefix = f".{output.name}.tmp-"
    removed = []
    for folder in output.parent.glob(glob.escape(prefix) + "*"):
        pid = folder.name[len(prefix) :]
        if not (pid.isascii() and pid.isdigit()) or folder.is_symlink() or not folder.is_dir() or _alive(int(pid)):
            continue
        held = set(os.listdir(folder))
        if not held:
            with contextlib.suppress(OSError):  # rmdir: only while it is still empty
                folder.rmdir()
                removed.append(folder)
        elif stage_files and held <= stage_files:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (unknown counts as alive: nothing is removed)."""
    if os.name != "posix" or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: it exists, owned by someone else
        return True
    return True


def _mkdir(folder: Path, error: type[UserError], parents: bool = False) -> None:
    """mkdir whose failure (a file in the way, no permission) is one line naming the output."""
    try:
        folder.mkdir(parents=parents, exist_ok=parents)
    except OSError as e:
        blocker = next((p for p in (folder, *folder.parents) if os.path.lexists(p)), folder)
        if not blocker.is_dir():
            raise error(f"output: {blocker} is a file, not a folder; choose another output") from None
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or type(e).__name__)
        raise error(f"output: cannot create {folder} ({reason}); choose another output") from None


def _make_parents(folder: Path, error: type[UserError]) -> list[Path]:
    """Create `folder` and its missing parents; returns those created, deepest first."""
    missing = []
    p = folder
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    try:
        _mkdir(folder, error, parents=True)
    except UserError:  # it may have failed halfway down
        _remove_created(missing)
        raise
    return missing


def _remove_created(folders: list[Path]) -> None:
    """Remove folders this run created (deepest first) while they are empty: never anything else."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return
