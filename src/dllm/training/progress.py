"""Progress display: a rich bar with its ETA on a terminal, plain lines otherwise. `Progress` is training's (main
rank); `CountBar` counts any other long job towards a total (prompts, examples, weights of a convert)."""

from __future__ import annotations

import sys
import time
from typing import Any

from dllm.config.training import LoggingConfig


def _fmt_eta(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def format_flops(n: float) -> str:
    """1.2 TFLOP, 340 GFLOP, ... (decimal units)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} FLOP"


def _rich_bar(label: str, console: Any = None) -> Any:
    """A started rich progress display: label, bar, done/total, an info field, time remaining."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn(f"[bold]{label}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeRemainingColumn(),
        transient=False,
        console=console,
    )
    bar.start()
    return bar


class CountBar:
    """`total` items counted on stderr: a rich bar with its ETA when stderr is a terminal, else a plain line
    `done/total label  info  eta H:MM:SS` at most every `every_s` seconds, and at the end when it printed one
    before (a job shorter than `every_s` prints none); nothing when not `enabled` (a command's -q). `total` 0: not
    known yet (`count` tells it). A context manager: the bar is closed however the job ends."""

    def __init__(self, label: str, total: int, enabled: bool = True, every_s: float = 0.0) -> None:
        self.label, self.total, self.done, self.every_s = label, total, 0, every_s
        self.enabled = enabled
        self._t0 = self._last = time.perf_counter()
        self._printed = False
        self._bar: Any = None
        if self.enabled and sys.stderr.isatty():
            from rich.console import Console

            self._bar = _rich_bar(label, Console(stderr=True))
            self._task = self._bar.add_task(label, total=total or None, info="")

    def count(self, done: int, total: int) -> None:
        """A (done, total) report, the callback of a loader that knows its total only once it runs."""
        if total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.update(self._task, total=total)
        self.advance(done - self.done)

    def advance(self, n: int = 1, info: str = "") -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, info=info)
            return
        now = time.perf_counter()
        due = now - self._last >= self.every_s or (self.done >= self.total and self._printed)
        if self.enabled and self.total > 0 and due:
            self._last, self._printed = now, True
            eta = (now - self._t0) / max(self.done, 1) * (self.total - self.done)
            text = f"  {info}" if info else ""
            print(f"{self._counts()} {self.label}{text}  eta {_fmt_eta(eta)}", file=sys.stderr, flush=True)

    def _counts(self) -> str:
        """done/total; in millions from a million on (the parameters of a model)."""
        if self.total < 1_000_000:
            return f"{self.done}/{self.total}"
        return f"{self.done / 1e6:.1f}M/{self.total / 1e6:.1f}M"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> CountBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Progress:
    def __init__(self, cfg: LoggingConfig, total_steps: int, start_step: int, enabled: bool) -> None:
        mode = cfg.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "off"
        self.total = total_steps
        self.start_step = start_step
        self.every = cfg.every_steps
        self._t0 = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None
        if self.mode == "bar":
            self._bar = _rich_bar("train")
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")

    def update(self, step: int, loss: float, tokens_per_s: float, perf: dict[str, Any] | None = None) -> None:
        """`perf`: the step's flops_per_s and mfu (training.mfu), shown when present; with compile_s
        (the compiled warm-up step), this step's line is shown whatever logging.every_steps says."""
        info = f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
        compile_s = (perf or {}).get("compile_s")
        warm_up = compile_s is not None
        if warm_up:
            info += f"  compile {compile_s:.1f} s"
        if perf and "flops_per_s" in perf:
            info += f"  {format_flops(perf['flops_per_s'])}/s"
        if perf and "mfu" in perf:
            info += f"  MFU {100 * perf['mfu']:.1f}%"
        if perf and "reward_mean" in perf:  # an rl round (training/grpo.py)
            info += f"  reward {perf['reward_mean']:.3f}±{perf['reward_std']:.3f}  acc {100 * perf['accuracy']:.0f}%"
            info += f"  kl {perf['kl']:.4f}  clip {perf['clip_fraction']:.3f}  len {perf['completion_len']:.1f}"
        if self.mode == "bar":
            self._bar.update(self._task, completed=step, info=info)
        elif self.mode == "lines" and (warm_up or step % self.every == 0 or step == self.total):
            done = step - self.start_step
            elapsed = time.perf_counter() - self._t0
            eta = elapsed / max(done, 1) * (self.total - step)
            print(f"step {step}/{self.total}  {info}  eta {_fmt_eta(eta)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
