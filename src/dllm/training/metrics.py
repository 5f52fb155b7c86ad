"""Metrics sinks on the main rank: JSONL in the run folder, TensorBoard when available."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dllm.config.training import LoggingConfig


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: LoggingConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._tb = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
        if enabled and cfg.tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError:
                if cfg.tensorboard == "on":
                    raise
        self._fh = open(self.path, "a", encoding="utf-8") if enabled else None  # noqa: SIM115

    def truncate_after(self, step: int) -> None:
        """On resume, drop records the interrupted run wrote after its last checkpoint."""
        if not self.enabled or self._fh is None or not self.path.exists():
            return
        self._fh.close()
        kept = [
            line
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def log(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled or self._fh is None:
            return
        record = {"step": step, **values}
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
