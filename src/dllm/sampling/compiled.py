"""Compiled sampling: each transformer block compiled once, in place, for every shape the sampler uses.

Regional compilation (`block.compile()`): the blocks share one code object, so one graph serves every
layer and a new layer count does not recompile; parameter names stay as they are (checkpoints, LoRA).
Shapes are dynamic (`dynamic=True`): the canvas length, the cached query slice [qs, qe) and the key
range [0, ke) change with every prompt length and block, and a static graph would recompile for each.
The KV cache's buffer writes and the attention masks are traced into the block's graph; attention
backends that cannot be traced (the CPU blockwise kernel) break the graph there and run eagerly.
"""

from __future__ import annotations

import importlib.util
import shutil

import torch

from dllm.errors import ConfigError

_COMPILED = "_dllm_compiled_blocks"
_RECOMPILE_LIMIT = 64


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Compile `model.layers` in place (idempotent) and return the model."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ConfigError(f"sampler.compile: {type(model).__name__} has no transformer blocks (model.layers)")
    if not getattr(model, _COMPILED, False):
        _check_toolchain(next(model.parameters()).device)
        # one code object serves every layer of every compiled model: its variants (KV buffer not yet
        # allocated / allocated / no cache, trimmed last block, batch 1, each mask kind) outnumber
        # dynamo's default limit of 8, past which it would silently run the block eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        for block in layers:
            block.compile(dynamic=True)
        setattr(model, _COMPILED, True)
    return model


def _check_toolchain(device: torch.device) -> None:
    """torch.compile's inductor needs triton for a GPU and a C++ compiler for a CPU."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("sampler.compile: compiling for a GPU needs triton (pip install triton); or drop --compile")
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ConfigError("sampler.compile: compiling for a CPU needs a C++ compiler (install g++); or drop --compile")
