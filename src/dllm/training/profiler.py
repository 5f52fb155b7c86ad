"""torch.profiler traces of chosen training steps (`profiling:` in the config).

Steps count from 1 (the number the step has in metrics.jsonl). The profiler starts before step
`start_step` fetches its data and stops after step `start_step + steps - 1`. A unit of several optimizer
steps (an rl round of rl.inner_updates steps) is profiled whole: the window widens to the rounds that
hold those steps, and the file names say the steps it covers. Then it writes a Chrome
trace (open it in chrome://tracing or https://ui.perfetto.dev) to RUN/profile/, one per rank; with
`memory` on CUDA also a snapshot of the allocator's history (https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dllm.config.observability import ProfilingConfig

MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events the CUDA memory snapshot keeps (the newest ones)."""


class StepProfiler:
    def __init__(self, cfg: ProfilingConfig, folder: Path, device: torch.device, rank: int, announce: bool) -> None:
        self.cfg, self.folder, self.device, self.rank = cfg, Path(folder), device, rank
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.announce = announce  # the main rank prints where the files went
        self.paths: list[Path] = []
        self._prof: profile | None = None
        self._step_range: record_function | None = None
        self._started_at: int | None = None
        self._cuda_memory = cfg.memory and device.type == "cuda"

    def before_step(self, step: int, last: int | None = None) -> None:
        """Called before a unit of work that takes steps `step`..`last` (1-based; one step when `last` is None)."""
        last = step if last is None else last
        if step <= self.first <= last and self._prof is None and not self.paths:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(
                activities=activities, record_shapes=self.cfg.record_shapes, profile_memory=self.cfg.memory
            )
            if self._cuda_memory:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._prof.start()
            self._started_at = step
        if self._prof is not None:
            label = f"dllm step {step}" if last == step else f"dllm steps {step}-{last}"
            self._step_range = record_function(label)  # the unit's span in the trace
            self._step_range.__enter__()

    def after_step(self, step: int) -> None:
        """Called when step `step` is done."""
        if self._prof is None:
            return
        self._end_range()
        if step >= self.last:
            self._finish(step)

    def _end_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _finish(self, step: int) -> None:
        assert self._prof is not None and self._started_at is not None
        self._end_range()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        span = f"steps{self._started_at}-{step}-rank{self.rank}"
        trace = self.folder / f"trace-{span}.json"
        self._prof.export_chrome_trace(str(trace))
        self.paths.append(trace)
        if self._cuda_memory:
            snapshot = self.folder / f"memory-{span}.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.paths.append(snapshot)
        self._prof = None

    def close(self, step: int, start_step: int) -> list[Path]:
        """At the end of the run (`step` reached, resumed at `start_step`): a window the run ended inside
        is written as far as it got; prints the files (or why there are none)."""
        if self._prof is not None:
            self._finish(step)
        if self.announce:
            for path in self.paths:
                what = "trace" if path.suffix == ".json" else "memory snapshot"
                print(f"dllm: profiler {what}: {path}", file=sys.stderr)
            if not self.paths and start_step >= self.first:
                print(
                    f"dllm: warning: profiling.start_step {self.first} was before this run's first step "
                    f"{start_step + 1} (a resume): nothing was profiled",
                    file=sys.stderr,
                )
        return self.paths
