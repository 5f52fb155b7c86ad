"""Helpers shared by the command modules."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from dllm.cli.outputs import Reads, check_output_place
from dllm.config.base import MAX_SEED
from dllm.errors import ConfigError

SetOption = typer.Option(None, "--set", help="Override a config field: --set training.steps=50 (repeatable).")
MODEL_HELP = "A Hugging Face or `dllm convert` model folder, or a hub id org/name[@revision]."
THREADS_OPTION = typer.Option(
    "auto",
    "--threads",
    help="CPU threads: a number, or auto (OMP_NUM_THREADS if set, else the cores other work leaves free: the "
    "1-minute load average, or fewer tasks runnable now; see dllm doctor).",
)
QUIET_OPTION = typer.Option(False, "--quiet", "-q", help="No progress display.")


def apply_threads(value: str, flag: str = "--threads") -> int:
    """Resolve a command's --threads (parallel/threads.py: `auto`'s rule) and run this process's torch ops on
    that many threads; called before the model loads. Returns the count."""
    from dllm.parallel.threads import parse_threads, resolve_threads, use_threads

    num_threads = resolve_threads(parse_threads(value, flag), 1, os.environ)
    use_threads(num_threads)
    return num_threads


def seed_option(default: int | None, help: str) -> Any:
    """A `--seed` option: an integer in [0, 2**63), like every seed field of the configs."""
    return typer.Option(default, "--seed", min=0, max=MAX_SEED, help=help)


def finite(value: float | None) -> float | None:
    """Callback of a float option: NaN and infinity mean nothing for any of them (a temperature, a wait)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def check_output_file(output: Path | None, flag: str = "--output", reads: Reads = (), parents: bool = False) -> None:
    """A file that can be written, checked before a model is loaded or a token sampled: a file is
    created next to it and removed (a folder may look writable and still refuse files, as /proc does);
    with `parents`, in the nearest existing folder above it (the command creates the others). It must not
    overwrite what the command reads (`reads`) nor lie in a folder dllm reads back (outputs.py)."""
    if output is None:
        return
    if output.is_dir():
        raise ConfigError(f"{flag}: {output} is a folder; give a file, e.g. {output / 'samples.jsonl'}")
    parent = output.absolute().parent
    if parents:
        parent = next(p for p in (parent, *parent.parents) if p.exists())
    if not parent.exists():
        raise ConfigError(f"{flag}: the folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise ConfigError(f"{flag}: {parent} is not a folder; choose another output file")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{output.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write in {parent} ({_reason(e)}); choose another output file") from None
    check_output_place(output, flag, reads)


def check_output_folder(folder: Path, flag: str, reads: Reads = (), own: str | None = None) -> None:
    """A folder that is or can be created here, checked before any work (`dllm.staging`'s rules: not the
    filesystem root nor under /proc, /sys, /dev; a folder made and removed in its nearest existing parent).
    It must not overlap what the command reads, nor be or lie in a folder dllm reads back unless of the kind
    `own` the command writes (outputs.py)."""
    from dllm.config.base import output_folder_problem
    from dllm.staging import unwritable_problem

    problem = output_folder_problem(folder) or unwritable_problem(folder)
    if problem is not None:
        raise ConfigError(f"{flag}: {problem}")
    check_output_place(folder, flag, reads, folder=True, own=own)


def write_lines(output: Path, lines: list[str], flag: str = "--output") -> None:
    """Write `lines` to `output` (`write_file`)."""

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as fh:
            fh.writelines(line + "\n" for line in lines)

    write_file(output, write, flag)


def write_file(output: Path, write: Callable[[Path], None], flag: str = "--output") -> None:
    """`write(tmp)` a temp file next to `output`, renamed into place: never a half-written file nor a write
    through another name of the file (a hard link), and a failed write (a full disk) is one line that leaves
    any old `output` as it was."""
    tmp = output.with_name(output.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, output)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ConfigError(f"{flag}: cannot write {output} ({_reason(e)}); choose another output file") from None
        raise


def _reason(e: OSError) -> str:
    return "permission denied" if isinstance(e, PermissionError) else (e.strerror or type(e).__name__).lower()


def model_folder(text: str | Path | None, flag: str = "--model") -> Path | None:
    """The folder a model argument names: a local folder wins, else a hub id `org/name[@revision]` through
    the Hugging Face cache (HF_HUB_OFFLINE honoured); every failure is one ConfigError naming `flag`."""
    if text is None or isinstance(text, Path):
        return text
    from dllm.config.base import source_of
    from dllm.hub import local_folder

    try:
        return local_folder(source_of(text, Path(text).expanduser()), flag)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None


def hub_id(text: str | Path | None) -> str | None:
    """`text` when a model argument is read as a hub id (no local folder of that name), else None."""
    from dllm.config.base import source_of

    if text is None or isinstance(text, Path):
        return None
    try:
        source = source_of(text, Path(text).expanduser())
    except ValueError:
        return None
    return source if isinstance(source, str) else None


def warn(msg: str) -> None:
    print(f"dllm: warning: {msg}", file=sys.stderr)


def info(msg: str) -> None:
    print(msg, file=sys.stderr)


def out(msg: Any = "") -> None:
    print(msg, flush=True)
