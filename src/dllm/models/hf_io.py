"""Hugging Face checkpoint folders in and out (local disk only; safetensors or weights_only loading).

A folder is recognised by its config.json `model_type`; weights come from model.safetensors, a sharded
model.safetensors.index.json, or (weights_only) pytorch_model.bin. Export writes config.json,
model.safetensors and the tokenizer files, so that `transformers` loads causal families with
AutoModelForCausalLM (and BERT with BertForMaskedLM) and gives the same logits. No remote code is
ever needed: LLaDA and Dream folders are read with their own name maps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from dllm import __version__
from dllm.config.model import ModelConfig
from dllm.config.registries import FAMILIES
from dllm.errors import ConfigError
from dllm.models.families import Family, StateDict, state_from_hf, state_to_hf

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def is_hf_folder(path: Path) -> bool:
    return (Path(path) / "config.json").is_file()


def read_hf_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model.init_from: {folder} has no config.json (not a Hugging Face model folder)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def family_of(hf_config: dict[str, Any], where: str = "model.init_from") -> Family:
    model_type = hf_config.get("model_type")
    families: list[Family] = [FAMILIES.resolve(name) for name in FAMILIES]
    for family in families:
        if model_type in family.model_types:
            return family
    known = ", ".join(t for family in families for t in family.model_types)
    raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {known}")


def model_config_from_hf(folder: Path) -> ModelConfig:
    """The native ModelConfig of a Hugging Face folder (architecture fields only)."""
    hf = read_hf_config(folder)
    family = family_of(hf)
    fields = {k: v for k, v in family.config_from_hf(hf).items() if v is not None}
    return ModelConfig(family=family.name, **fields)


def load_hf_state_dict(folder: Path) -> StateDict:
    """All tensors of a checkpoint folder, by their Hugging Face names."""
    folder = Path(folder)
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: StateDict = {}
        for shard in shards:
            out.update(load_file(str(folder / shard)))
        return out
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"model.init_from: {folder} holds no model.safetensors, shard index or pytorch_model.bin")


def import_hf(folder: Path, cfg: ModelConfig) -> StateDict:
    """Native, float32 weights of a Hugging Face folder for a model built from `cfg`; embeddings are
    grown to cfg.vocab_size when a tokenizer needed more ids (an added mask token)."""
    hf = read_hf_config(folder)
    family = family_of(hf)
    src_cfg = model_config_from_hf(folder)
    native = state_from_hf(family, load_hf_state_dict(folder), src_cfg)
    native = {k: v.float() for k, v in native.items()}
    assert cfg.vocab_size is not None
    return resize_vocab(native, cfg.vocab_size)


def resize_vocab(native: StateDict, vocab_size: int) -> StateDict:
    """New token rows (e.g. an added mask token) start at the mean embedding, a common choice that
    keeps their initial logits ordinary (Hewitt 2021, "Initializing new word embeddings")."""
    for key in ("embed_tokens.weight", "lm_head.weight", "head_bias"):
        t = native.get(key)
        if t is None or t.shape[0] >= vocab_size:
            continue
        extra = vocab_size - t.shape[0]
        fill = t.mean(0, keepdim=True).expand(extra, *t.shape[1:]) if t.ndim > 1 else t.new_zeros(extra)
        native[key] = torch.cat([t, fill], dim=0)
    return native


def export_hf(state: StateDict, cfg: ModelConfig, folder: Path, tokenizer_dir: Path | None = None) -> Path:
    """Write a Hugging Face folder (config.json, model.safetensors, tokenizer files)."""
    from safetensors.torch import save_file

    family: Family = FAMILIES.resolve(cfg.family)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_state = state_to_hf(family, {k: v.detach().cpu().contiguous() for k, v in state.items()}, cfg)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config = {
        "model_type": family.model_types[0],
        "architectures": [family.architecture],
        "torch_dtype": "float32",
        "dllm_version": __version__,
        **family.config_to_hf(cfg),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, folder)
    return folder


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file() and Path(src).resolve() != Path(dst).resolve():
            shutil.copy2(Path(src) / name, Path(dst) / name)
