"""Continuous batching (sampling/continuous.py): requests that join a running batch at different steps,
with different prompts, lengths, EOS, stop functions and sampler settings, decode exactly what a
`generate` call of each alone decodes (greedy token for token; sampled from the same seeded draws), and
the batch's rows are reused, compacted and released as requests leave.

The model is float64 (as in test_sampling_speculative.py) so that batches of different rows agree far
below any argmax gap.
"""

from __future__ import annotations

import random

import pytest
import torch

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.continuous import Group, RunningBatch
from dllm.sampling.generate import generate
from tests.unit.test_sampling_ar import MASK_ID, V, causal_model, random_prompts

EOS = 3
SPECIAL = SpecialIds(MASK_ID, 0, EOS, V)


@pytest.fixture(scope="module")
def model():
    return causal_model(seed=4, dtype=torch.float64)


def _cfg(n: int, temperature: float = 0.0, top_k: int | None = None, eos: bool = True) -> SamplerConfig:
    return SamplerConfig(generation="causal", gen_length=n, temperature=temperature, top_k=top_k, stop_at_eos=eos)


def _alone(model, prompts, cfg: SamplerConfig, seed: int | None = None, stop=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return generate(model, prompts, cfg, SPECIAL, generator=gen, stop=stop)


def _run(batch: RunningBatch, arrivals: list[tuple[int, list[list[int]], SamplerConfig, int | None]]) -> list[Group]:
    """Join each request at its step (seeded generators for sampled ones), step until all have ended."""
    groups: list[Group | None] = [None] * len(arrivals)
    step = 0
    while step == 0 or batch.groups or any(g is None for g in groups):
        for i, (at, prompts, cfg, seed) in enumerate(arrivals):
            if at == step and groups[i] is None:
                gen = torch.Generator().manual_seed(seed) if seed is not None else None
                groups[i] = batch.join(prompts, cfg, gen)
        batch.step()
        step += 1
        assert step < 500
    return [g for g in groups if g is not None]


def _same(group: Group, alone) -> None:
    got = group.result()
    assert got.sequences == alone.sequences
    assert torch.equal(got.canvas_BL, alone.canvas_BL)
    assert got.gen_start_B == alone.gen_start_B
    mine, theirs = got.counters.as_dict(), alone.counters.as_dict()
    for key in ("nfe", "steps", "rounds", "tokens_committed", "accepted", "drafted", "tau"):
        assert mine[key] == theirs[key], key


def test_greedy_requests_joining_at_different_steps_decode_as_alone(model):
    rng = random.Random(0)
    arrivals = []
    for i in range(12):
        prompts = random_prompts(rng.choice([1, 1, 2, 3]), seed=100 + i)
        arrivals.append((rng.randrange(0, 20), prompts, _cfg(rng.choice([1, 3, 8, 17]), eos=i % 2 == 0), None))
    batch = RunningBatch(model, SPECIAL, max_rows=64)
    groups = _run(batch, arrivals)
    for group, (_, prompts, cfg, _) in zip(groups, arrivals, strict=True):
        _same(group, _alone(model, prompts, cfg))
    assert batch.groups == [] and batch.owner == [] and batch.rows == 0
    assert all(k.shape[0] == 0 for layer in batch.target.cache.layers.values() for k in (layer.k_BKTD, layer.v_BKTD))


def test_sampled_requests_draw_what_they_draw_alone(model):
    arrivals = [
        (0, random_prompts(2, seed=1), _cfg(12, temperature=1.0), 11),
        (2, random_prompts(1, seed=2), _cfg(9, temperature=0.7, top_k=5), 12),
        (3, random_prompts(3, seed=3), _cfg(6), None),  # greedy beside them
        (5, random_prompts(2, seed=4), _cfg(15, temperature=1.3, eos=False), 13),
    ]
    groups = _run(RunningBatch(model, SPECIAL, max_rows=64), arrivals)
    for group, (_, prompts, cfg, seed) in zip(groups, arrivals, strict=True):
        _same(group, _alone(model, prompts, cfg, seed))


def test_a_stop_function_ends_a_row_as_it_does_alone(model):
    prompts = random_prompts(3, seed=7)
    alone = _alone(model, prompts, _cfg(20, eos=False), stop=lambda ids: len(ids) >= 2 and ids[-1] % 4 == 0)
    batch = RunningBatch(model, SPECIAL, max_rows=8)
    other = batch.join(random_prompts(2, seed=8), _cfg(30))
    group = batch.join(prompts, _cfg(20, eos=False), stop=lambda ids: len(ids) >= 2 and ids[-1] % 4 == 0)
    while not group.done:
        batch.step()
    _same(group, alone)
    batch.leave(other)


def test_leaving_moves_the_last_rows_into_the_freed_ones(model):
    """A request that leaves (done, or its client gone) frees its rows: the last running rows move into them
    and the buffers end after the running rows, so no forward runs a free row; the others decode on unchanged."""
    batch = RunningBatch(model, SPECIAL, max_rows=16)
    long = [batch.join(random_prompts(2, seed=20 + i), _cfg(40, eos=False)) for i in range(4)]  # 8 rows
    assert len(batch.owner) == 8 and batch.rows == 8
    assert batch.fits(8) and not batch.fits(9)
    batch.step()
    batch.leave(long[1])  # a client went away
    assert len(batch.owner) == 6 == batch.rows == batch.target.length_B.shape[0]
    assert sorted(r for g in batch.groups for r in g.rows) == list(range(6))
    late = batch.join(random_prompts(2, seed=30), _cfg(5, eos=False))
    assert len(batch.owner) == 8 and batch.rows == 8
    for _ in range(3):
        batch.step()
    batch.leave(long[0])
    batch.leave(long[2])
    assert len(batch.owner) == 4 == batch.rows
    assert all(k.shape[0] == 4 for layer in batch.target.cache.layers.values() for k in (layer.k_BKTD, layer.v_BKTD))
    while not late.done:
        batch.step()
    assert len(batch.owner) == 2 == batch.rows
    while not long[3].done:
        batch.step()
    _same(long[3], _alone(model, long[3].prompts, _cfg(40, eos=False)))
    _same(late, _alone(model, late.prompts, _cfg(5, eos=False)))
    assert batch.owner == [] and all(layer.k_BKTD.shape[0] == 0 for layer in batch.target.cache.layers.values())


def test_the_buffers_memory_stays_for_the_next_wave(model):
    """When the batch empties its rows go, not their memory: the next requests join into it without a new
    allocation (as long as they fit its rows and capacity), and decode as alone."""
    batch = RunningBatch(model, SPECIAL, max_rows=16)
    first = [batch.join(random_prompts(2, seed=40 + i), _cfg(12, eos=False)) for i in range(3)]  # 6 rows
    while batch.groups:
        batch.step()
    layer = batch.target.cache.layers[0]
    memory = layer.bases["k_BKTD"].data_ptr()
    assert layer.k_BKTD.shape[0] == 0 and layer.bases["k_BKTD"].shape[0] >= 6
    batch.reserve(4, 20)
    second = [batch.join(random_prompts(2, seed=50 + i), _cfg(8, eos=False)) for i in range(2)]  # 4 rows
    assert layer.k_BKTD.shape[0] == 4 and layer.k_BKTD.data_ptr() == memory  # the same memory
    while batch.groups:
        batch.step()
    for group in first + second:
        _same(group, _alone(model, group.prompts, _cfg(group.cfg.gen_length, eos=False)))


def test_a_request_that_ends_with_its_first_token_never_takes_a_row(model):
    batch = RunningBatch(model, SPECIAL, max_rows=4)
    group = batch.join(random_prompts(2, seed=5), _cfg(1))
    assert group.done and batch.owner == [] and batch.step() == []
    _same(group, _alone(model, group.prompts, _cfg(1)))
