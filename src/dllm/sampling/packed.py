"""Prepacked linear layers for causal decoding on a CPU: oneDNN's float32 matmul over weights reordered
once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`, the ops
torch.compile's CPU weight-prepacking pass emits), instead of `F.linear` (MKL's sgemv / sgemm on the
plain weight) in every step.

A decoding step multiplies one row (or a few, one per sequence) by every weight of the model, so its time
is the time to stream the weights through those small matmuls: measured on SmolLM2-135M's shapes on an
AMD EPYC (bench/real_model.py), oneDNN's packed kernel runs them 1.5x (1 row) to 2.4x (8 rows) faster per
matmul. Only the layers change: the model, its parameters and its state dict stay as they are; while
`PackedLinears.installed()` is open each `nn.Linear` of the model runs through its packed weight and
`linear()` serves the output head (the tied embedding or `lm_head`).

The results equal `F.linear`'s up to float rounding (another summation order, ~1e-6 relative): the plain
path stays the reference (`causal_generate(..., packed=False)`; tests/unit/test_sampling_packed.py).

The packed copies (the weights' size again) are kept on the model across decoding calls and keyed by each
weight's storage and version: a weight changed in place (training between decoding calls) is packed
again; a model whose weights would not fit twice in a quarter of the machine's memory is not packed.

Shapes: N rows, I input width, O output width.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dllm.models.sizing import host_memory_bytes

_CACHE = "_dllm_packed_linears"
PACK_ROWS = 8
"""The row-count hint of the packed layout (oneDNN picks its blocking by it): 1 to 8 rows decode
equally fast with it, a prefill's hundreds too (measured)."""


class PackedLinears:
    """The packed weights of a CPU float32 model's linear layers and output head (`of` builds them)."""

    def __init__(self, model: nn.Module, packed: dict[int, tuple[tuple, torch.Tensor]]) -> None:
        self.model, self.packed = model, packed
        """id(weight) -> (the weight's key when packed, the packed weight)."""

    @classmethod
    def of(cls, model: nn.Module) -> PackedLinears | None:
        """The model's packed linear layers (packing the weights not packed yet), or None where packing does
        not apply: not on a CPU, not float32, no oneDNN in this torch build, or too large to hold twice."""
        weights = [m.weight for m in model.modules() if type(m) is nn.Linear]
        if not _packable(model, weights):
            return None
        cache: dict[int, tuple[tuple, torch.Tensor]] = getattr(model, _CACHE, {})
        fresh = {}
        try:
            for w in weights:
                entry = cache.get(id(w))
                fresh[id(w)] = entry if entry is not None and entry[0] == _key(w) else (_key(w), _pack(w))
            if not cache and not _agrees(weights[0], fresh[id(weights[0])][1]):
                return None
        except (RuntimeError, AttributeError, NotImplementedError, TypeError):  # an op this build lacks or refuses
            return None
        pointers = {p.data_ptr() for p in model.parameters()}  # keep the output head (packed by `linear`)
        fresh.update((k, v) for k, v in cache.items() if k not in fresh and v[0][0] in pointers)
        setattr(model, _CACHE, fresh)  # weights no longer in the model drop out
        return cls(model, fresh)

    @contextmanager
    def installed(self) -> Iterator[PackedLinears]:
        """Every `nn.Linear` of the model runs through its packed weight while the context is open."""
        patched = []
        try:
            for module in self.model.modules():
                if type(module) is nn.Linear and id(module.weight) in self.packed:
                    module.forward = partial(_packed_linear, self.packed[id(module.weight)][1], module.bias)
                    patched.append(module)
            yield self
        finally:
            for module in patched:
                del module.forward  # the class's forward again

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` through `weight` packed (packed at its first use: the output head)."""
        entry = self.packed.get(id(weight))
        if entry is None or entry[0] != _key(weight):
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
                return F.linear(x, weight, bias)
            entry = self.packed[id(weight)] = (_key(weight), _pack(weight))
        return _packed_linear(entry[1], bias, x)


def _packable(model: nn.Module, weights: list[torch.Tensor]) -> bool:
    if not weights or not torch.backends.mkldnn.is_available():
        return False
    if any(w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2 for w in weights):
        return False
    need, have = 2 * sum(p.numel() * p.element_size() for p in model.parameters()), host_memory_bytes()
    return not have or need <= have // 4


def _agrees(w_OI: torch.Tensor, packed_OI: torch.Tensor) -> bool:
    """A first packing checks the private oneDNN ops against F.linear once (they may change between torch
    builds): two rows through the packed and the plain weight agree to float rounding."""
    x_NI = torch.linspace(-1, 1, 2 * w_OI.shape[1], dtype=w_OI.dtype).view(2, -1)
    return torch.allclose(_packed_linear(packed_OI, None, x_NI), F.linear(x_NI, w_OI), rtol=1e-4, atol=1e-4)


def _key(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, tuple(w.shape))


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_ROWS)


def _packed_linear(packed_OI: torch.Tensor, bias: torch.Tensor | None, x_NI: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x_NI, packed_OI, bias, "none", [], "")
