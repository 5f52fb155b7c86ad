"""Metrics sinks on the main rank: JSONL in the run folder, TensorBoard when available, W&B when configured."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from dllm.config.training import LoggingConfig


class MetricsLogger:
    """metrics.jsonl holds one record per logged step of the run's history up to its current state:
    `start` is called before the first step, so a resume or a restart never duplicates steps."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.run_dir, self.cfg = run_dir, cfg
        self.path = run_dir / "metrics.jsonl"
        self._tb: Any = None
        self._wandb: Any = None
        self._fh: TextIO | None = None
        self.first = True  # the next record is the log's first (start() says)

    def start(self, step: int) -> None:
        """Open the sinks for a run that goes on after `step` (not before: a resume that is refused writes
        nothing). From a checkpoint (step > 0), the records after it were written by the interrupted run
        and are written again, so they go (and so does a line torn by a kill). From scratch (no checkpoint
        yet, or `resume: never`) the old records are history of another start: kept aside as
        metrics.jsonl.N, never deleted. `first` then says whether the log holds no record yet."""
        if not self.enabled:
            return
        self._close_file()
        self._open_sinks()
        self.first = True
        if self.path.exists() and step == 0 and self.path.stat().st_size > 0:
            kept = _set_aside(self.path)
            print(f"dllm: starting at step 0: kept the earlier metrics as {kept}", file=sys.stderr)
        elif self.path.exists():
            self.first = _truncate_after(self.path, step) == 0
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _open_sinks(self) -> None:
        """TensorBoard when available (or asked for), W&B when configured; once per run."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._tb is None and self.cfg.tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:
                if self.cfg.tensorboard == "on":
                    raise
        if self._wandb is None and self.cfg.wandb is not None and self.cfg.wandb.mode != "disabled":
            from dllm.training.wandb_sink import WandbSink

            self._wandb = WandbSink(self.cfg.wandb, self.run_dir)

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._fh is not None, "MetricsLogger.start(step) comes before the first record"
        record = {"step": step, **values}
        self.first = False
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(step, values)

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def close(self) -> None:
        self._close_file()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def _records(text: str) -> list[dict[str, Any]]:
    """The records of a metrics file. Every record is written as one whole line, so a line that
    does not parse is the torn end of a write cut by a kill (or a full disk) and is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _truncate_after(path: Path, step: int) -> int:
    """Keep the whole records up to `step`; rewritten through a temp file, so a kill leaves either
    the old file or the new one. Returns how many records are kept."""
    text = path.read_text(encoding="utf-8", errors="replace")
    kept = [r for r in _records(text) if r["step"] <= step]
    new_text = "".join(json.dumps(r) + "\n" for r in kept)
    if new_text == text:
        return len(kept)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(new_text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(kept)


def _set_aside(path: Path) -> Path:
    """Rename `path` to the first free `path.N` (N = 1, 2, ...) and return that name."""
    n = 1
    while path.with_name(f"{path.name}.{n}").exists():
        n += 1
    target = path.with_name(f"{path.name}.{n}")
    os.replace(path, target)
    return target


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return _records(path.read_text(encoding="utf-8", errors="replace"))
