"""`dllm runs [DIR]`: a table of the run folders under DIR (default runs/); DIR may also be a project folder
(its runs/ and its configs' run.output_dir) or a single run folder."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import typer
import yaml

from dllm.errors import CheckpointError, UserError
from dllm.models.sizing import format_bytes
from dllm.training.metrics import read_metrics

CONFIG_NAME = "config.yaml"  # dllm.training.run.CONFIG_NAME (not imported: it loads torch at CLI start)


@dataclass(frozen=True)
class RunRow:
    name: str
    objective: str
    steps_done: int
    steps_planned: int | None
    last_loss: float | None
    tokens_seen: int | None
    checkpoint: str
    size_bytes: int


def runs(
    directory: Path = typer.Argument(
        Path("runs"),
        help="A folder of runs (run.output_dir), a project folder (its runs/ and the run.output_dir of each config "
        "in it), or one run folder.",
    ),
) -> None:
    """List the runs of DIR: objective, steps done / planned, last loss, tokens seen, newest checkpoint, size."""
    if not directory.is_dir():
        raise UserError(f"{directory}: no such folder; give a runs folder (run.output_dir, `runs` by default), a "
                        "project folder or a run folder")  # fmt: skip
    if (directory / CONFIG_NAME).is_file() and not _holds_runs(directory):  # one run
        run_dir = directory.resolve() if directory.is_symlink() else directory  # runs/latest: the run it names
        print_table([read_run(run_dir)], run_dir.parent)
        return
    shown = False
    for folder in _runs_folders(directory):
        rows = [read_run(p) for p in sorted(folder.iterdir()) if _is_run(p)]
        if rows:
            print_table(rows, folder)
            shown = True
    if not shown:
        print(f"no runs in {directory}", file=sys.stderr)


def _is_run(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / CONFIG_NAME).is_file()


def _holds_runs(folder: Path) -> bool:
    return any(_is_run(p) for p in folder.iterdir())


def _runs_folders(directory: Path) -> list[Path]:
    """`directory` when it holds run folders; else, a project folder: its runs/ and the run.output_dir of each
    training config in it (relative to the config's folder), each once."""
    if _holds_runs(directory):
        return [directory]
    found = [
        directory / "runs",
        *(_output_dir(c) for c in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])),
    ]
    folders: list[Path] = []
    for f in found:
        if f is not None and f.is_dir() and f.resolve() not in {x.resolve() for x in folders}:
            folders.append(f)
    return folders


def _output_dir(config: Path) -> Path | None:
    """The run.output_dir a training config names (`runs` when its run section names none); None otherwise."""
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    run = data.get("run") if isinstance(data, dict) else None
    if not isinstance(run, dict):
        return None
    out = Path(str(run.get("output_dir", "runs"))).expanduser()
    return out if out.is_absolute() else config.parent / out


def read_run(run_dir: Path) -> RunRow:
    """One run's row; a damaged file makes its cells unknown rather than the listing fail."""
    from dllm.checkpoint.manager import latest_checkpoint, read_trainer_state

    config = _config(run_dir)
    training = config.get("training") or {}
    planned = training.get("steps") if isinstance(training.get("steps"), int) else None
    records = read_metrics(run_dir)
    last = records[-1] if records else {}
    checkpoint, ckpt_step = "-", 0
    try:
        path = latest_checkpoint(run_dir / "checkpoints")
        if path is not None:
            checkpoint, ckpt_step = path.name, int(read_trainer_state(path)["step"])
    except CheckpointError:
        checkpoint = "damaged"
    done = max(int(last.get("step", 0)), ckpt_step)
    per_step = _tokens_per_step(config)
    return RunRow(
        name=run_dir.name,
        objective=str((config.get("objective") or {}).get("name", "?")),
        steps_done=done,
        steps_planned=planned,
        last_loss=last.get("loss"),
        tokens_seen=None if per_step is None else done * per_step,
        checkpoint=checkpoint,
        size_bytes=_size(run_dir),
    )


def _config(run_dir: Path) -> dict:
    try:
        data = yaml.safe_load((run_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _tokens_per_step(config: dict) -> int | None:
    batch = (config.get("training") or {}).get("global_batch_size")
    seq_len = (config.get("data") or {}).get("seq_len")
    return batch * seq_len if isinstance(batch, int) and isinstance(seq_len, int) else None


def _size(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):  # does not follow links
        for f in files:
            with contextlib.suppress(OSError):  # removed while we walk
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def _count(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def print_table(rows: list[RunRow], directory: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"runs in {directory}", title_justify="left")
    for col, justify in (
        ("run", "left"), ("objective", "left"), ("steps", "right"), ("last loss", "right"),
        ("tokens", "right"), ("checkpoint", "left"), ("size", "right"),
    ):  # fmt: skip
        table.add_column(col, justify=justify, no_wrap=True)
    for r in rows:
        steps = f"{r.steps_done}/{r.steps_planned if r.steps_planned is not None else '?'}"
        loss = "-" if not isinstance(r.last_loss, (int, float)) else f"{r.last_loss:.4f}"
        table.add_row(r.name, r.objective, steps, loss, _count(r.tokens_seen), r.checkpoint, format_bytes(r.size_bytes))
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 140))  # a pipe or a file: no truncated cells
    console.print(table)
