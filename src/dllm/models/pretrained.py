"""Pretrained weights: `model.init_from` folders (Hugging Face or `dllm convert`) and their configs.

A source is a local folder or a Hugging Face hub id (`org/name[@revision]`), which dllm.hub turns into
a snapshot folder of the hub cache.

A dllm model folder holds model.yaml (the ModelConfig and the tokenizer section), model.safetensors
with native parameter names, and the tokenizer files when the tokenizer is a Hugging Face one.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from dllm.config.data import TokenizerConfig
from dllm.config.loading import read_yaml, validate_config
from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.hub import local_folder
from dllm.models.families.base import StateDict
from dllm.models.gemma import fresh_canvas_conditioning
from dllm.models.hf_io import (
    TOKENIZER_FILES,
    check_weight_shapes,
    check_weight_values,
    copy_tokenizer_files,
    import_hf,
    is_hf_folder,
    model_config_from_hf,
    resize_vocab,
    safetensors_shapes,
)
from dllm.seeding import mix_key

MODEL_YAML = "model.yaml"
WEIGHTS = "model.safetensors"
CANVAS_PREFIX = "canvas_cond."
"""The native names of DiffusionGemma's self-conditioning block (Transformer.canvas_cond)."""
_CANVAS_STREAM = 0xCA57  # keeps an added canvas block's random stream apart from the base initialisation

# fields that may differ from the checkpoint's: how the weights are used, not what they are
_USAGE_FIELDS = {"preset", "init_from", "vocab_size", "max_seq_len", "attention_backend", "flex_compile",
                 "init_std", "router_aux_loss_coef", "shift_logits"}  # fmt: skip


def is_model_folder(path: Path) -> bool:
    return (Path(path) / MODEL_YAML).is_file()


def _model_yaml(path: Path) -> dict[str, dict]:
    """model.yaml of a dllm model folder, its `model` and `tokenizer` sections checked to be mappings."""
    data, _ = read_yaml(path / MODEL_YAML)
    for key in ("model", "tokenizer"):
        if not isinstance(data.get(key, {}), dict):
            raise ConfigError(f"{path / MODEL_YAML}: {key} must be a mapping of fields")
    return data


def pretrained_config(source: Path | str) -> ModelConfig:
    """The architecture of a folder or hub id (`model.init_from`)."""
    path = local_folder(source, "model.init_from")
    if is_model_folder(path):
        section = {**_model_yaml(path).get("model", {}), "init_from": None}
        return validate_config(ModelConfig, section, source=f"{path / MODEL_YAML}: model", base_dir=None)
    if is_hf_folder(path):
        return model_config_from_hf(path)
    raise ConfigError(f"model.init_from: {path} is neither a Hugging Face folder (config.json) nor a dllm model folder")


def pretrained_tokenizer(source: Path | str) -> TokenizerConfig | None:
    """The tokenizer a pretrained folder (or hub id) ships: its own files (HF), or the section in model.yaml."""
    path = local_folder(source, "model.init_from")
    if is_model_folder(path):
        tok = _model_yaml(path).get("tokenizer", {})
        if tok.get("kind") == "hf":
            return TokenizerConfig(kind="hf", path=path, mask_token=tok.get("mask_token", "<|mask|>"))
        source = f"{path / MODEL_YAML}: tokenizer"
        return validate_config(TokenizerConfig, tok, source=source, base_dir=None) if tok else None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        return TokenizerConfig(kind="hf", path=path)
    return None


def merge_pretrained(user: ModelConfig) -> ModelConfig:
    """The checkpoint's architecture plus the user's usage fields; an architecture field the user set
    to something else than the checkpoint's is an error naming it. A checkpoint without DiffusionGemma's
    canvas block (Gemma 4) may be given one (`canvas_conditioning`, and its `canvas_length`): AR-to-diffusion
    conversion, the block starting fresh (`pretrained_state`)."""
    assert user.init_from is not None
    pre = pretrained_config(user.init_from)
    asked = "canvas_conditioning" in user.model_fields_set and user.canvas_conditioning
    adds_canvas = asked and not pre.canvas_conditioning
    grown = {"canvas_conditioning", "canvas_length"} if adds_canvas else set()
    for name in sorted(user.model_fields_set - _USAGE_FIELDS - grown):
        if getattr(user, name) != getattr(pre, name):
            raise ConfigError(
                f"model.{name}: {getattr(user, name)!r} but the checkpoint in {user.init_from} has "
                f"{getattr(pre, name)!r}; remove it from the config (model.init_from sets the architecture)"
            )
    usage = {name: getattr(user, name) for name in user.model_fields_set & (_USAGE_FIELDS | grown) if name != "preset"}
    data = {**pre.model_dump(exclude={"preset"}), **usage, "init_from": user.init_from}
    if "vocab_size" not in user.model_fields_set:
        data["vocab_size"] = pre.vocab_size
    return ModelConfig.model_validate(data)


def pretrained_state(cfg: ModelConfig, seed: int = 0) -> StateDict:
    """Native float32 weights of `cfg.init_from`, the vocabulary grown to cfg.vocab_size if needed, and
    DiffusionGemma's canvas block added when `cfg` has it and the checkpoint has not (seeded by `seed`)."""
    assert cfg.init_from is not None and cfg.vocab_size is not None
    path = local_folder(cfg.init_from, "model.init_from")
    if is_model_folder(path):
        from safetensors.torch import load_file

        shapes = safetensors_shapes(path / WEIGHTS)  # checked against model.yaml before loading
        check_weight_shapes(path / MODEL_YAML, pretrained_config(path), cfg, shapes, lambda: shapes)
        state = load_file(str(path / WEIGHTS))
        check_weight_values(state, path / WEIGHTS)
        state = resize_vocab({k: v.float() for k, v in state.items()}, cfg.vocab_size)
    else:
        state = import_hf(path, cfg)
    if cfg.canvas_conditioning and not any(k.startswith(CANVAS_PREFIX) for k in state):
        generator = torch.Generator().manual_seed(mix_key(seed, _CANVAS_STREAM))
        state.update({CANVAS_PREFIX + k: v for k, v in fresh_canvas_conditioning(cfg, generator).items()})
    return state


def save_model_folder(folder: Path, state: StateDict, cfg: ModelConfig, tokenizer: TokenizerConfig) -> Path:
    """Write a dllm model folder (what `dllm convert --from-hf` produces and `init_from` reads)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in state.items()}, str(folder / WEIGHTS))
    tok = tokenizer.model_dump(mode="json", exclude={"path"})
    if tokenizer.kind == "hf" and tokenizer.path is not None:
        copy_tokenizer_files(local_folder(tokenizer.path, "tokenizer.path"), folder)
    model = cfg.model_dump(mode="json", exclude={"init_from", "preset"})
    text = yaml.safe_dump({"model": model, "tokenizer": tok}, sort_keys=False)
    (folder / MODEL_YAML).write_text(text, encoding="utf-8")
    return folder
