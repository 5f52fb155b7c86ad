"""Keyed noise drawn for a batch at once equals the former per-sample draws bit for bit.

Resume and rank-count invariance rest on these bits, so the former loop is kept here as the reference."""

from __future__ import annotations

import random
import warnings
import zlib

import numpy as np
import pytest
import torch

from dllm.diffusion.corruption import NoiseKeys
from dllm.seeding import mix_key, mix_keys

EDGE_IDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 + 3, 2**62, 2**63 - 1, -1, -(2**63)]
EDGE_PARTS = [(), (0,), (2**63 - 1,), (2**64 - 1, 5), (-1, -(2**63)), (2**64 + 7, 3), (1234, zlib.crc32(b"mdlm.mask"))]


class LoopNoiseKeys(NoiseKeys):
    """The former `NoiseKeys.uniform`: one key, one seeded generator and one torch.rand per sample."""

    def uniform(self, sample_ids_B: torch.Tensor, shape: tuple[int, ...], purpose: str) -> torch.Tensor:
        g = torch.Generator(device="cpu")
        rows = []
        for sid in sample_ids_B.tolist():
            g.manual_seed(mix_key(self.seed, zlib.crc32(purpose.encode()), sid))
            rows.append(torch.rand(shape, generator=g))
        return torch.stack(rows).to(sample_ids_B.device)


@pytest.mark.parametrize("parts", EDGE_PARTS)
def test_mix_keys_equals_mix_key_per_id(parts):
    rng = np.random.default_rng(len(parts))
    ids_N = np.array(EDGE_IDS + rng.integers(-(2**63), 2**63 - 1, 50).tolist(), np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the uint64 wrap-around must stay silent
        keys_N = mix_keys(*parts, ids=ids_N)
    assert keys_N.dtype == np.int64 and keys_N.shape == ids_N.shape
    assert keys_N.tolist() == [mix_key(*parts, int(i)) for i in ids_N]
    assert bool((keys_N >= 0).all())  # 63-bit, as mix_key


def test_mix_keys_keeps_the_shape_of_ids():
    ids = np.arange(6, dtype=np.int64).reshape(2, 3)
    assert mix_keys(7, ids=ids).tolist() == [[mix_key(7, int(i)) for i in row] for row in ids]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one = mix_keys(7, 2**63 - 1, ids=np.int64(2**63 - 1))
    assert one.shape == () and int(one) == mix_key(7, 2**63 - 1, 2**63 - 1)
    assert mix_keys(7, ids=np.array([], np.int64)).shape == (0,)


def _ids(rng: random.Random, n: int) -> torch.Tensor:
    return torch.tensor([0, 2**32, 2**32 + 1, 2**63 - 1] + [rng.randrange(2**40) for _ in range(n)])


@pytest.mark.parametrize("shape", [(), (1,), (7,), (623,), (624,), (625,), (1248,), (1249,), (2000,), (3, 5)])
def test_uniform_equals_the_per_sample_loop(shape):
    rng = random.Random(str(shape))
    for _ in range(6):
        seed, purpose = rng.randrange(2**63), rng.choice(["mdlm.mask", "bd3lm.corrupt", "t", ""])
        ids_B = _ids(rng, rng.randrange(0, 9))
        got = NoiseKeys(seed, group_size=4).uniform(ids_B, shape, purpose)
        assert torch.equal(got, LoopNoiseKeys(seed, group_size=4).uniform(ids_B, shape, purpose))
        assert got.shape == (len(ids_B), *shape) and got.dtype == torch.float32


def test_uniform_takes_any_integer_ids():
    ids = torch.tensor([5, 0, 77], dtype=torch.int32)
    expected = LoopNoiseKeys(3, 1).uniform(ids.long(), (9,), "p")
    assert torch.equal(NoiseKeys(3, 1).uniform(ids, (9,), "p"), expected)
    assert NoiseKeys(3, 1).uniform(ids[:0], (9,), "p").shape == (0, 9)


@pytest.mark.parametrize("antithetic", [False, True])
@pytest.mark.parametrize("group_size", [1, 3, 8])
def test_stratified_draws_are_unchanged(antithetic, group_size):
    rng = random.Random(group_size)
    ids_B = _ids(rng, 12)
    new, old = NoiseKeys(99, group_size), LoopNoiseKeys(99, group_size)
    assert torch.equal(new.stratified_time(ids_B, "t", antithetic), old.stratified_time(ids_B, "t", antithetic))
    for K in (1, 4, 700):
        got = new.stratified_blocks(ids_B, K, "block.t", antithetic)
        assert torch.equal(got, old.stratified_blocks(ids_B, K, "block.t", antithetic))
