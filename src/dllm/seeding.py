"""Seed mixing shared by every layer: one stable integer hash from integer parts.

It sits at the bottom of the package (it imports nothing from dllm) so that models (LoRA init),
diffusion (per-sample noise keys) and anything else can derive independent streams from one seed.
`mix_keys` is `mix_key` for a whole vector of sample ids at once, bit for bit.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1


def _splitmix64(x):
    """SplitMix64's finaliser on a Python int or a uint64 array. The masks keep Python ints to 64 bits;
    on uint64 arrays they are no-ops, as NumPy's array arithmetic already wraps mod 2**64."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _absorb(parts: tuple[int, ...]) -> int:
    """The 64-bit state after folding `parts` in (the key before its last shift)."""
    h = 0
    for p in parts:
        h = _splitmix64(h ^ (p & _MASK64))
    return h


def mix_key(*parts: int) -> int:
    """A 63-bit seed from integer parts (stable across Python versions and platforms)."""
    return _absorb(parts) >> 1


def mix_keys(*parts: int, ids: np.ndarray) -> np.ndarray:
    """`mix_key(*parts, i)` for every i of the int64 array `ids`, at once: an int64 array, ids' shape.

    A negative id is taken in two's complement, as `mix_key` masks it."""
    ids_N = np.asarray(ids, dtype=np.int64)
    # 1-d even for one id: ufuncs on 0-d arrays return NumPy scalars, whose wrap-around warns
    h_N = _splitmix64(ids_N.reshape(-1).view(np.uint64) ^ _absorb(parts))
    return (h_N >> 1).astype(np.int64).reshape(ids_N.shape)
