"""The Family record and the weight-name maps every family is read and written through.

A family is data: its config.json keys -> ModelConfig fields, and a weight-name map (with the few
tensor transforms some layouts need: GPT-2's transposed Conv1D and fused qkv, BERT's token-type
embedding, ModernBERT's fused qkv and gate/up). Import and export use the same map in both directions,
so a round trip is exact. The families themselves live next to this file, one module per group of
checkpoint layouts; hf_io.py reads and writes Hugging Face folders through these functions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.config.profile import DecodeProfile
from dllm.errors import ConfigError

StateDict = dict[str, torch.Tensor]
ConfigMap = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values read as this family (the first is written on export, unless
    `config_to_hf` writes another: a DiffusionGemma stack without its canvas block is Gemma 4's text model)."""
    architecture: str
    """config.json `architectures` entry written on export."""
    causal_lm: bool | Callable[[ModelConfig], bool]
    """Loadable with transformers' AutoModelForCausalLM (an autoregressive family); a function of the config
    for a family only some of whose models are (`is_causal_lm`)."""
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    renames: tuple[tuple[str, str], ...]
    """(native regex, HF template) pairs, applied in order; `{i}` stands for the layer index."""
    from_hf_extra: Callable[[StateDict, ModelConfig], StateDict] = field(default=lambda sd, cfg: sd)
    to_hf_extra: Callable[[StateDict, ModelConfig], StateDict] = field(default=lambda sd, cfg: sd)
    hf_name: Callable[[str, ModelConfig], str] = field(default=lambda name, cfg: name)
    """A name the renames give as the export of a model of this config writes it (diffusion_gemma: Gemma 4's
    text model, without the canvas block, is Gemma4ForCausalLM's model.* where DiffusionGemma has
    model.decoder.*). Exported weights and adapter module paths both pass through it."""
    ignore_hf: tuple[str, ...] = ()
    """HF keys (regex) that carry nothing the native model needs (buffers, unused poolers)."""
    architectures_read: tuple[str, ...] = ()
    """config.json `architectures` entries that pick this family before `model_type` is looked at."""
    block_size: int | None = None
    """A folder of this family without a decode profile decodes block-causally in blocks of this size (LLaDA2)."""
    decode_from_hf: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """The decode facts (DecodeProfile fields) a folder of this family records in its config.json, by which a folder
    without a decode profile decodes (Nemotron-Labs-Diffusion: block_size, dlm_paradigm, mask_token_id)."""
    decode_to_hf: Callable[[DecodeProfile, Any], dict[str, Any]] | None = None
    """The config.json keys that record a model's decode profile and its run's objective section (None: a model not
    trained here), as this family's folders carry them; `decode_from_hf` reads them back."""

    def exported_architecture(self, cfg: ModelConfig) -> str:
        """The `architectures` entry of the folder a model of `cfg` exports to (ConfigError when it has none)."""
        return (self.config_to_hf(cfg).get("architectures") or [self.architecture])[0]

    def is_causal_lm(self, cfg: ModelConfig) -> bool:
        """Whether a model of this config is a causal LM (diffusion_gemma: Gemma 4's text model, without the
        canvas block, is; DiffusionGemma is not)."""
        return self.causal_lm(cfg) if callable(self.causal_lm) else self.causal_lm


# -- name maps -----------------------------------------------------------------------------------------
_GROUP = re.compile(r"\(([^()]*)\)")


def _native_to_hf(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for native, hf in renames:
        m = re.fullmatch(native, name)
        if m:
            return hf.format(*m.groups())
    raise KeyError(name)


def _hf_to_native(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """The inverse of `_native_to_hf`: each `{}` of the HF template matches the native group's pattern."""
    for native, hf in renames:
        pattern = re.escape(hf)
        for group in _GROUP.findall(native):  # `{}` placeholders in order, each with its group's pattern
            pattern = pattern.replace(r"\{\}", f"({group})", 1)
        m = re.fullmatch(pattern, name)
        if m:
            template = _GROUP.sub("{}", native).replace("\\", "")
            return template.format(*m.groups())
    raise KeyError(name)


def native_to_hf_name(family: Family, name: str, cfg: ModelConfig) -> str:
    """The Hugging Face name of a native parameter of a model of `cfg` (KeyError when the family has no place
    for it)."""
    return family.hf_name(_native_to_hf(name, family.renames), cfg)


def module_path_to_hf(family: Family, path: str, cfg: ModelConfig) -> str:
    """The Hugging Face module path of a native linear layer of a model of `cfg` (for adapter files): the
    module of the folder that model exports to."""
    hf = native_to_hf_name(family, f"{path}.weight", cfg).removesuffix(".weight")
    if re.search(r"(c_attn|Wqkv)\.[qkv]$|Wi\.(gate|up)$|\battention\.[qkv]_proj$", hf):
        raise ConfigError("--adapter-only: this family fuses q, k, v (or gate, up) in one layer; export merged weights")
    return hf


def state_to_hf(family: Family, native: StateDict, cfg: ModelConfig) -> StateDict:
    out = {native_to_hf_name(family, k, cfg): v for k, v in native.items()}
    return family.to_hf_extra(out, cfg)


def state_from_hf(family: Family, hf: StateDict, cfg: ModelConfig) -> StateDict:
    hf = family.from_hf_extra(dict(hf), cfg)
    out: StateDict = {}
    for k, v in hf.items():
        if any(re.fullmatch(p, k) for p in family.ignore_hf):
            continue
        try:
            out[_hf_to_native(k, family.renames)] = v
        except KeyError:
            raise ConfigError(f"model.init_from: weight {k!r} has no place in a {family.name} model") from None
    return out


def drop_tied_head(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """A tied checkpoint may still list lm_head.weight (a copy of the embedding): ignore it."""
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def is_causal_model(profile: DecodeProfile, model_cfg: ModelConfig) -> bool:
    """Whether a loaded model decodes autoregressively: its profile says attention causal (a run trained
    with objective ar, or exported from one), or it is a folder never trained here (no objective in its
    profile) of a causal LM (`Family.is_causal_lm`: llama, qwen2, qwen3, qwen3_moe, gpt2, and Gemma 4's text
    model, a diffusion_gemma stack without the canvas block; not llada, dream, bert or DiffusionGemma). A
    diffusion run converted from an AR model is not: it was trained otherwise."""
    from dllm.config.registries import FAMILIES  # resolved on use (its entries are this part's modules)

    if profile.attention == "causal":
        return True
    return profile.objective is None and FAMILIES.resolve(model_cfg.family).is_causal_lm(model_cfg)
