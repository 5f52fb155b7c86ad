"""Load a trained model for inference from a run folder or one checkpoint folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dllm.checkpoint.manager import TRAINER_STATE, latest_checkpoint, load_model_weights
from dllm.config.loading import load_config
from dllm.config.spec import RunSpec
from dllm.errors import CheckpointError
from dllm.models import MODELS
from dllm.tokenization import Tokenizer, build_tokenizer

RUN_CONFIG = "config.yaml"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    spec: RunSpec
    checkpoint: Path


def resolve_checkpoint(run: Path | None, checkpoint: Path | None) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) from either `--run` or `--checkpoint`."""
    if (run is None) == (checkpoint is None):
        raise CheckpointError("give exactly one of --run RUN_DIR or --checkpoint CHECKPOINT_DIR")
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        if not (ckpt / TRAINER_STATE).is_file():
            raise CheckpointError(f"{ckpt}: not a dllm checkpoint folder (no {TRAINER_STATE})")
        return ckpt.resolve().parent.parent, ckpt
    run_dir = Path(run)  # type: ignore[arg-type]
    if not (run_dir / RUN_CONFIG).is_file():
        raise CheckpointError(f"{run_dir}: not a run folder (no {RUN_CONFIG}); train with `dllm launch` first")
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no checkpoint yet; wait for the first save or check checkpointing")
    return run_dir, ckpt


def load_for_inference(
    run: Path | None = None, checkpoint: Path | None = None, device: torch.device | None = None
) -> LoadedModel:
    run_dir, ckpt = resolve_checkpoint(run, checkpoint)
    spec = load_config(RunSpec, run_dir / RUN_CONFIG)
    tok = build_tokenizer(spec.tokenizer)
    model = MODELS.get(spec.model.family)(spec.model)
    load_model_weights(ckpt, model)
    model.eval()
    if device is not None:
        model.to(device)
    return LoadedModel(model=model, tokenizer=tok, spec=spec, checkpoint=ckpt)
