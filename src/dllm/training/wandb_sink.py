"""The Weights & Biases sink of MetricsLogger (main rank only; the wandb package is an optional extra).

The W&B run gets the run's resolved config (RUN/config.yaml, the file the workers train from) and
every metrics record at its step. Its files go to RUN/wandb/ (in offline mode that folder is the
whole record: `wandb sync RUN/wandb/offline-run-*` uploads it later). The W&B run id is kept in
RUN/wandb/dllm-run-id, so a resumed run continues the same W&B run; W&B ignores records at steps it
already has (those of an interrupted run past its last checkpoint).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import yaml

from dllm.config.observability import WandbConfig
from dllm.errors import ConfigError

RUN_ID_FILE = "dllm-run-id"


def missing_wandb_error() -> ConfigError:
    return ConfigError(
        "logging.wandb: needs the wandb package (pip install 'dllm[wandb]'), or set logging.wandb.mode: disabled"
    )


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise missing_wandb_error() from None
        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.name or run_dir.name,
            mode=cfg.mode,
            tags=list(cfg.tags),
            dir=str(run_dir),
            id=_run_id(folder),
            resume="allow",
            config=_resolved_config(run_dir),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        """Finish the run and wait for W&B's service process to write everything: `finish` alone can return
        before the service has flushed the run's files (seen on a loaded machine: an offline run file holding
        only its header)."""
        import wandb

        self.run.finish()
        wandb.teardown()


def _run_id(folder: Path) -> str:
    path = folder / RUN_ID_FILE
    if path.is_file():
        run_id = path.read_text(encoding="utf-8").strip()
        if run_id.isalnum():
            return run_id
    run_id = secrets.token_hex(4)
    path.write_text(run_id + "\n", encoding="utf-8")
    return run_id


def _resolved_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.yaml"  # written by training.run.prepare_run_dir before any worker starts
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}
