"""Assembly for decoding: a model loaded for inference (checkpoint/loading.py), the sampler resolved against its
decode profile, its special ids and, for speculative decoding, its drafter. `setup_sampling` is what
`dllm generate`, `chat`, `eval` and `serve` share (the CLI builds the sampler from its options, this module
loads and checks the model for it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dllm.checkpoint.loading import LoadedModel, load_for_inference
from dllm.config.sampler import SamplerConfig, resolve_sampler, unread_fields
from dllm.errors import ConfigError
from dllm.models.families.base import is_causal_model
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.speculative import Drafter, check_drafter, load_drafter


@dataclass(frozen=True)
class SamplingSetup:
    """A model ready to decode and the sampler resolved for it."""

    loaded: LoadedModel
    sampler: SamplerConfig
    """Resolved against the model's decode profile (`auto` fields filled; causal: its length checked)."""
    special: SpecialIds
    device: torch.device
    drafter: Drafter | None = None
    """Causal decoding with a drafter (speculative decoding); None: AR decoding or a diffusion sampler."""


def setup_sampling(
    sampler: SamplerConfig, device: torch.device, *, run: Path | None = None, checkpoint: Path | None = None,
    model_dir: Path | None = None, drafter_dir: Path | None = None, draft_block_size: int | None = None,
    causal_option: str = "--ar", dtype: torch.dtype = torch.float32,
) -> SamplingSetup:  # fmt: skip
    """Load a model (`load_for_inference`) in `dtype` (its weights, compute and KV caches; the logits are float32
    whatever it is: `models/output.py: token_logits`) and resolve `sampler` for it. Causal decoding
    (`sampler.generation == "causal"`, asked for by `causal_option`, named in errors) needs a causal model
    and loads the drafter of `drafter_dir` (in the target's dtype), refused when it was trained for another
    target or for blocks shorter than `draft_block_size` (a shorter block verifies its first proposals)."""
    loaded = load_for_inference(run, checkpoint, device, model_dir=model_dir, dtype=dtype)
    sampler = _causal_lm_decodes_causally(sampler, loaded)
    drafter = None
    if sampler.generation == "causal":
        profile, cfg = loaded.profile, loaded.model_cfg
        if not is_causal_model(profile, cfg):
            canvas = " with DiffusionGemma's canvas block" if cfg.canvas_conditioning else ""
            trained = f"trained with {profile.objective}" if profile.objective else f"a {cfg.family} model{canvas}"
            raise ConfigError(
                f"{causal_option}: {loaded.source} is not a causal model ({trained}, attention {profile.attention} "
                f"in its decode profile); causal decoding needs an ar run or a causal LM folder (an AR family, "
                f"Gemma 4's text model); drop {causal_option} to sample it"
            )
        if drafter_dir is not None:
            drafter = check_drafter(load_drafter(drafter_dir, loaded.model), loaded.model, draft_block_size)
    return SamplingSetup(loaded, resolve_sampler(sampler, loaded.profile), SpecialIds.of(loaded.profile), device,
                         drafter)  # fmt: skip


def _causal_lm_decodes_causally(sampler: SamplerConfig, loaded: LoadedModel) -> SamplerConfig:
    """A causal LM folder never trained here (an imported llama, qwen, gpt2 or Gemma 4 text model: no objective
    in its decode profile) decodes causally when no loop is asked for (`generation: auto`), as an ar run does,
    unless a field only canvas decoding reads is set (steps, block_length, policy, cache, ...): that asks for a
    diffusion sample of it (before converting it), as `generation: canvas` does; the commands' summary line
    says which loop ran."""
    profile = loaded.profile
    if sampler.generation != "auto" or profile.objective is not None or not is_causal_model(profile, loaded.model_cfg):
        return sampler
    if unread_fields(sampler, "causal"):
        return sampler
    return sampler.model_copy(update={"generation": "causal"})
