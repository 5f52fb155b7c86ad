"""Seed mixing shared by every layer: one stable integer hash from integer parts.

It sits at the bottom of the package (it imports nothing from dllm) so that models (LoRA init),
diffusion (per-sample noise keys) and anything else can derive independent streams from one seed.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_key(*parts: int) -> int:
    """A 63-bit seed from integer parts (stable across Python versions and platforms)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h >> 1
