"""Building a model from its config sections: the architecture, initial weights, LoRA adapters.

Training (`training/build.py`) and inference (`checkpoint/loading.py`) share these, so a run's
model is rebuilt the same way everywhere: base weights (seeded init or `model.init_from`), then
adapters with their own seeded generator.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm.config.model import LoraConfig, ModelConfig
from dllm.models.lora import apply_lora
from dllm.models.pretrained import pretrained_state
from dllm.models.transformer import Transformer
from dllm.seeding import mix_key

_LORA_STREAM = 0x10AA  # keeps the adapters' random stream apart from the base initialisation


def build_model(cfg: ModelConfig, lora: LoraConfig | None, seed: int = 0) -> nn.Module:
    """The module tree (on the current default device, e.g. meta), adapters included."""
    model = Transformer(cfg)
    if lora is not None:
        apply_lora(model, lora, torch.Generator().manual_seed(mix_key(seed, _LORA_STREAM)))
    return model


def initial_state(cfg: ModelConfig, lora: LoraConfig | None, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights as a full CPU state dict, identical on every rank and world size: the
    `model.init_from` checkpoint or a seeded initialisation, plus fresh adapters (B = 0)."""
    if cfg.init_from is not None and lora is None:
        return pretrained_state(cfg, seed)  # no second copy of a large model in memory
    model = Transformer(cfg)
    if cfg.init_from is not None:
        model.load_state_dict(pretrained_state(cfg, seed), strict=True)
    else:
        model.init_weights(torch.Generator().manual_seed(seed))
    if lora is not None:
        apply_lora(model, lora, torch.Generator().manual_seed(mix_key(seed, _LORA_STREAM)))
    return model.state_dict()


def cast_weights(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` with its parameters and saved buffers in `dtype` (decoding in bfloat16); the tables it computes
    itself (non-persistent buffers: RoPE's inverse frequencies) keep their float32, as transformers keeps them:
    rounded to bf16 they would turn a key at position 200 by up to ~0.3 radians."""
    tables = {name: buf for name, buf in model.named_buffers() if name not in model.state_dict()}
    model.to(dtype=dtype)
    for name, buf in tables.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, buf)
    return model
