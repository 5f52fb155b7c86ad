"""Per-sample keyed noise for a batch: the former per-sample loop, the shipped path, and MT19937 in NumPy.

`NoiseKeys.uniform` gives each sample `torch.rand(shape)` from a CPU generator seeded with
mix_key(seed, crc32(purpose), sample id). Three ways to get the same bits for a batch:

- loop: the former code, one Python `mix_key` (three SplitMix64 rounds on Python ints), one
  `manual_seed` and one `torch.rand` per sample, then a stack (kept here as the reference);
- shipped: `NoiseKeys.uniform`, the keys of the batch mixed in one NumPy call (`mix_keys`), the rows
  drawn by torch's own generator into one preallocated tensor;
- mt19937: everything batched, torch's generator re-implemented over [624, B] NumPy states. torch
  seeds MT19937 with the low 32 bits of the 64-bit seed (Knuth's init_genrand), regenerates all 624
  words before the first output, and a float32 uniform takes one tempered 32-bit output per value,
  its low 24 bits times 2**-24.

All three are checked bit for bit before timing. Rounds are interleaved (loop, shipped, mt19937,
loop, ...) so machine jitter hits each alike; the JSON line has medians and the ratios
loop / variant (above 1: the variant is faster).

    python bench/noise_keys.py [--rounds 21]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import zlib
from collections.abc import Callable

import numpy as np
import torch

from dllm.diffusion.corruption import NoiseKeys
from dllm.seeding import mix_key

MT_N, MT_M = 624, 397  # MT19937's state words and the offset of the word each twist mixes in
CONFIGS = ((64, 2048), (8, 512), (64, 0))  # (samples B, positions L); L = 0 is shape (), one value a sample
SEED, PURPOSE = 1234, "bd3lm.corrupt"


def loop_uniform(noise: NoiseKeys, sample_ids_B: torch.Tensor, shape: tuple[int, ...], purpose: str) -> torch.Tensor:
    """The former `NoiseKeys.uniform`: key, seed and draw one sample at a time."""
    g = torch.Generator(device="cpu")
    rows = []
    for sid in sample_ids_B.tolist():
        g.manual_seed(mix_key(noise.seed, zlib.crc32(purpose.encode()), sid))
        rows.append(torch.rand(shape, generator=g))
    return torch.stack(rows)


def mt_seed(keys_B: list[int]) -> np.ndarray:
    """init_genrand of every key's low 32 bits (all that torch keeps of a 64-bit seed): [624, B] uint32."""
    B = len(keys_B)
    state_NB = np.empty((MT_N, B), np.uint32)
    state_NB[0] = np.asarray(keys_B, np.uint64) & 0xFFFFFFFF
    t_B = np.empty(B, np.uint32)
    for j in range(1, MT_N):  # word j needs word j - 1: 623 dependent steps, vectorised over B only
        np.right_shift(state_NB[j - 1], 30, out=t_B)
        np.bitwise_xor(t_B, state_NB[j - 1], out=t_B)
        np.multiply(t_B, np.uint32(1812433253), out=t_B)  # uint32 arrays wrap mod 2**32, as in C
        np.add(t_B, np.uint32(j), out=state_NB[j])
    return state_NB


def _mix(upper_XB: np.ndarray, lower_XB: np.ndarray) -> np.ndarray:
    """MT19937's twist of (upper bit of one word | lower 31 bits of the next), times the matrix A."""
    y_XB = (upper_XB & 0x80000000) | (lower_XB & 0x7FFFFFFF)
    return (y_XB >> 1) ^ ((lower_XB & 1) * np.uint32(0x9908B0DF))


def mt_twist(state_NB: np.ndarray) -> None:
    """Regenerate the 624 words in place. Word i reads word i + 1 (still old) and word i + 397, which
    wraps to i - 227 and is new from i = 227 on; each run below reads only words of one age."""
    for lo, hi, far in ((0, 227, MT_M), (227, 454, MT_M - MT_N), (454, MT_N - 1, MT_M - MT_N)):
        state_NB[lo:hi] = state_NB[lo + far : hi + far] ^ _mix(state_NB[lo:hi], state_NB[lo + 1 : hi + 1])
    state_NB[-1] = state_NB[MT_M - 1] ^ _mix(state_NB[-1], state_NB[0])  # the last word reads new word 0


def mt_float32(state_NB: np.ndarray) -> np.ndarray:
    """Temper each word into an output, then torch's float32 uniform: low 24 bits times 2**-24."""
    y = state_NB ^ (state_NB >> 11)
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return (y & 0xFFFFFF).astype(np.float32) * np.float32(2.0**-24)


def mt19937_uniform(keys_B: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """torch.rand(shape, generator=torch.Generator().manual_seed(k)) for every key k: [B, *shape]."""
    num_values = math.prod(shape)
    state_NB = mt_seed(keys_B)
    blocks = [np.empty((0, len(keys_B)), np.float32)]
    for _ in range(-(-num_values // MT_N)):  # torch twists before its first output, then every 624
        mt_twist(state_NB)
        blocks.append(mt_float32(state_NB))
    u_nB = np.concatenate(blocks)[:num_values]
    return torch.from_numpy(np.ascontiguousarray(u_nB.T)).reshape(len(keys_B), *shape)


def variants(noise: NoiseKeys, ids_B: torch.Tensor, shape: tuple[int, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "loop": lambda: loop_uniform(noise, ids_B, shape, PURPOSE),
        "shipped": lambda: noise.uniform(ids_B, shape, PURPOSE),
        "mt19937": lambda: mt19937_uniform(noise.keys(ids_B, PURPOSE), shape),
    }


def median_ms(fns: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    times_s: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):  # interleaved so machine jitter hits every variant alike
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times_s[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in times_s.items()}


def run_config(B: int, L: int, rounds: int) -> dict:
    noise = NoiseKeys(SEED, group_size=B)
    ids_B = torch.randint(0, 2**40, (B,), generator=torch.Generator().manual_seed(B * 100003 + L))
    shape = (L,) if L else ()
    fns = variants(noise, ids_B, shape)
    reference = fns["loop"]()
    for name, fn in fns.items():
        assert torch.equal(fn(), reference), f"{name} differs from the per-sample loop at B={B} L={L}"
    ms = median_ms(fns, rounds)
    out = {"B": B, "L": L, **{f"{name}_ms": round(v, 4) for name, v in ms.items()}}
    out |= {f"loop_over_{name}": round(ms["loop"] / ms[name], 3) for name in ("shipped", "mt19937")}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args(argv)
    result = {
        "bench": "noise_keys",
        "bit_identical": True,  # run_config asserts it for every variant before timing
        "configs": [run_config(B, L, args.rounds) for B, L in CONFIGS],
        "rounds": args.rounds,
        "device": "cpu",
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
