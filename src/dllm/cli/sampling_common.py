"""What `dllm generate` and `dllm chat` share: the sampler config from a file, flags and overrides,
resolved against the run it samples from. The stop-string helpers live in `dllm.sampling.stops`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from dllm.cli.common import model_folder
from dllm.errors import ConfigError


@dataclass
class SamplingSetup:
    loaded: Any  # checkpoint.inference.LoadedModel
    cfg: Any  # config.spec.SamplerConfig, resolved
    special: Any  # sampling.generate.SpecialIds
    device: Any


SAMPLER_CONFIG_OPTION = typer.Option(None, "--sampler-config", help="YAML file of sampler settings (SamplerConfig).")
SET_OPTION = typer.Option(None, "--set", help="Override a sampler field: --set cache=dual (repeatable).")


def sampler_values(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags the user gave (None means not given)."""
    return {k: v for k, v in flags.items() if v is not None}


def setup_sampling(
    run: Path | None,
    checkpoint: Path | None,
    model: str | None,
    device: str,
    sampler_config: Path | None,
    overrides: list[str] | None,
    flags: dict[str, Any],
    causal: bool = False,
) -> SamplingSetup:
    """Load the model and build the sampler: file < flags < --set, then `auto` fields from the run.
    `model` is a folder or a hub id (cli.common.model_folder). `causal` (AR / speculative decoding): the
    sampler's length, temperature, top-k/p, EOS and stop fields are read as they are; nothing is resolved
    against the diffusion profile."""
    import torch

    from dllm.checkpoint.inference import load_for_inference
    from dllm.config.loading import apply_overrides, read_yaml, validate_config
    from dllm.config.sampler import SamplerConfig, resolve_sampler
    from dllm.sampling.generate import SpecialIds

    data: dict[str, Any] = {}
    source, node = "sampler options", None
    if sampler_config is not None:
        if not Path(sampler_config).is_file():
            raise ConfigError(f"--sampler-config: {sampler_config} does not exist")
        data, node = read_yaml(Path(sampler_config))
        source = str(sampler_config)
        if not isinstance(data, dict):
            raise ConfigError(f"{sampler_config}: expected a mapping of sampler fields")
    data = {**data, **sampler_values(flags)}
    data = apply_overrides(data, list(overrides or []))
    cfg = validate_config(SamplerConfig, data, source=source, base_dir=None, node=node, overrides=list(overrides or []))
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: {device!r} is not available here; use cpu")
    loaded = load_for_inference(run, checkpoint, torch.device(device), model_dir=model_folder(model))
    cfg = cfg if causal else resolve_sampler(cfg, loaded.profile)
    special = SpecialIds.of(loaded.profile)
    return SamplingSetup(loaded, cfg, special, torch.device(device))
