"""Progress display on the main rank: a rich bar on a terminal, plain lines otherwise."""

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
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._bar.start()
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
