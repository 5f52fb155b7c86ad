"""Read a model's intermediate hidden states without changing its forward contract.

Speculative decoding with DFlash drafters (Chen et al. 2025, "DFlash: block diffusion for flash
speculative decoding") conditions the drafter on the target's hidden states at a few chosen layers.
The target stays a plain `Transformer`: forward hooks on its blocks record their outputs while a
`capture_layers` context is open, so neither the model nor its parallel wrappers learn about drafters.

Shapes: B batch, L sequence, E hidden, F = len(layer_ids) * E.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn


class CapturedLayers:
    """The outputs [B, L, E] of the captured blocks of the last forward(s), in `layer_ids` order."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = tuple(layer_ids)
        self.outputs: dict[int, torch.Tensor] = {}

    def features(self) -> torch.Tensor:
        """The captured outputs concatenated on the feature axis: [B, L, F], in `layer_ids` order."""
        missing = [i for i in self.layer_ids if i not in self.outputs]
        if missing:
            raise RuntimeError(f"layers {missing} produced no output inside the capture (no forward ran?)")
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)


@contextmanager
def capture_layers(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[CapturedLayers]:
    """Record the hidden state after each block `model.layers[i]`, i in `layer_ids` (0-based), for
    the forwards run inside the context (a later forward overwrites an earlier one's)."""
    layers = model.layers  # type: ignore[attr-defined]
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer ids {bad} are outside the model's {len(layers)} layers (0-based)")
    captured = CapturedLayers(layer_ids)

    def hook_for(i: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            x = output[0] if isinstance(output, tuple) else output  # blocks return (hidden, aux)
            captured.outputs[i] = x  # type: ignore[assignment]

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in dict.fromkeys(layer_ids)]
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()
