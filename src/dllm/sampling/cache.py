"""Key/value caches for decoding: buffers over the whole canvas that a forward reads and writes.

A forward over a slice [query_start, query_start + Q) of the canvas writes its keys and values
(post-RoPE) into the buffers at those positions and attends to buffer positions [0, key_end). What
the rest of the buffer holds decides what kind of cache it is (sampling/runner.py chooses):

- prefix cache (Fast-dLLM, approximate for bidirectional models): refreshed by a full forward, then
  the active block and everything after it run against the prefix's cached keys;
- dual cache (Fast-dLLM, approximate): only the active block runs, against cached prefix and suffix;
- exact block cache (block diffusion: BD3LM, Fast-dLLM v2): with block-causal attention a clean
  block's keys never change, so each clean block is computed once (folded into the next block's first
  forward) and only the active block runs afterwards.

The model duck-types this: `Transformer.forward(..., cache=KVCache)` hands `cache.layer(i)` to layer i.
Shapes: B batch, K key/value heads, T canvas length, Q query rows, D head width.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerKV:
    """One layer's buffers [B, K, T, D] (allocated on the first write)."""

    owner: KVCache
    """The cache holding this layer, as a weak proxy: no reference cycle, so a dropped cache is freed at once."""
    k_BKTD: torch.Tensor | None = None
    v_BKTD: torch.Tensor | None = None
    recurrent: Any = None
    """A linear-attention layer's states instead of keys and values (models/linear_attention.py: RecurrentCache)."""

    def update(self, k_BKQD: torch.Tensor, v_BKQD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values at [query_start, +Q); return the keys/values [0, key_end)."""
        c = self.owner
        if self.k_BKTD is None:
            B, K, _, D = k_BKQD.shape
            self.k_BKTD = k_BKQD.new_zeros(B, K, c.length, D)
            self.v_BKTD = v_BKQD.new_zeros(B, K, c.length, D)
        assert self.v_BKTD is not None
        s, Q = c.query_start, k_BKQD.shape[2]
        if s + Q > c.length or c.key_end < s + Q:
            raise ValueError(f"cache: queries [{s}, {s + Q}) do not fit keys [0, {c.key_end}) of a {c.length} canvas")
        # narrow, not slicing: a slice's end is clamped to the length, so a compiled block would guard on
        # (and recompile for) whether a forward reaches the canvas end; narrow only asserts it fits
        self.k_BKTD.narrow(2, s, Q).copy_(k_BKQD)
        self.v_BKTD.narrow(2, s, Q).copy_(v_BKQD)
        return self.k_BKTD.narrow(2, 0, c.key_end), self.v_BKTD.narrow(2, 0, c.key_end)


@dataclass
class KVCache:
    """Per-layer K/V buffers over a canvas of `length` positions, plus where the next forward sits."""

    length: int
    query_start: int = 0
    """Canvas index of the next forward's first query token."""
    key_end: int = 0
    """The next forward attends to canvas positions [0, key_end)."""
    layers: dict[int, LayerKV] = field(default_factory=dict)

    def layer(self, i: int) -> LayerKV:
        if i not in self.layers:
            self.layers[i] = LayerKV(weakref.proxy(self))
        return self.layers[i]

    def allocate(self, num_layers: int, shape_BKD: tuple[int, int, int], like: torch.Tensor) -> KVCache:
        """Allocate every layer's buffers [B, K, length, D] now (dtype and device of `like`), instead
        of on each layer's first write: a compiled block then sees the same cache state on every
        call (allocated), not one variant per state (sampling/compiled.py)."""
        B, K, D = shape_BKD
        for i in range(num_layers):
            kv = self.layer(i)
            kv.k_BKTD = like.new_zeros(B, K, self.length, D)
            kv.v_BKTD = like.new_zeros(B, K, self.length, D)
        return self

    def at(self, query_start: int, key_end: int) -> KVCache:
        """Position the next forward: queries from `query_start`, keys [0, key_end)."""
        self.query_start, self.key_end = query_start, key_end
        return self


# -- cache modes: which canvas rows a forward runs for the active block --------------------------------
Window = tuple[int, int, int]
"""(qs, qe, ke): queries are canvas rows [qs, qe), keys [0, ke)."""


class CacheMode:
    """`sampler.cache` (registered in dllm.config.registries.CACHES): the forward window for the active
    block [lo, hi) of a canvas of T rows, with the sampler's shift s (position i read from row i - s).
    One instance per generation call (the exact block cache keeps state)."""

    buffers = True
    """Whether forwards read and write a KVCache."""

    def window(self, lo: int, hi: int, T: int, s: int, refresh: bool, block_attention: bool) -> Window:
        raise NotImplementedError


class NoCache(CacheMode):
    """Every forward runs the whole canvas (block models: up to the active block; nothing after it is seen)."""

    buffers = False

    def window(self, lo: int, hi: int, T: int, s: int, refresh: bool, block_attention: bool) -> Window:
        return (0, hi, hi) if block_attention else (0, T, T)


class PrefixCache(CacheMode):
    """Fast-dLLM prefix cache: a refresh runs the whole canvas; then the active block and everything after."""

    def window(self, lo: int, hi: int, T: int, s: int, refresh: bool, block_attention: bool) -> Window:
        return (0, T, T) if refresh else (lo - s, T, T)


class DualCache(CacheMode):
    """Fast-dLLM dual cache: a refresh runs the whole canvas; then only the active block, against both sides."""

    def window(self, lo: int, hi: int, T: int, s: int, refresh: bool, block_attention: bool) -> Window:
        return (0, T, T) if refresh else (lo - s, hi, T)


class BlockCache(CacheMode):
    """The exact block cache: the previous block's clean rows run once (with the first forward of the next
    block), after which their keys are final; refreshes change nothing."""

    def __init__(self) -> None:
        self.clean_upto = 0  # keys of [0, clean_upto) are final

    def window(self, lo: int, hi: int, T: int, s: int, refresh: bool, block_attention: bool) -> Window:
        qs = min(self.clean_upto, lo - s)
        self.clean_upto = max(self.clean_upto, lo)
        return qs, hi, hi
