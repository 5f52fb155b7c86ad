"""Continuous batching of causal decoding (inference/causal_rows.py through the engine): requests that join the
running rows at different steps, with different prompts, lengths, EOS, stop functions, sampler settings and
drafters, decode exactly what a `generate` call of each alone decodes (greedy token for token; sampled from
the same seeded draws), and the shared rows are reused, compacted and released as requests leave.

The model is float64 (as in test_sampling_speculative.py) so that batches of different rows agree far
below any argmax gap.
"""

from __future__ import annotations

import random

import pytest
import torch

from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import Engine, generate, make_loop
from dllm.inference.request import Request
from dllm.inference.scheduler import Limits
from dllm.sampling.canvas import SpecialIds
from tests.unit.test_sampling_ar import MASK_ID, V, causal_model, random_prompts

EOS = 3
SPECIAL = SpecialIds(MASK_ID, 0, EOS, V)

Arrival = tuple[int, list[list[int]], SamplerConfig, "int | None"]


@pytest.fixture(scope="module")
def model():
    return causal_model(seed=4, dtype=torch.float64)


def _cfg(n: int, temperature: float = 0.0, top_k: int | None = None, eos: bool = True) -> SamplerConfig:
    return SamplerConfig(generation="causal", gen_length=n, temperature=temperature, top_k=top_k, stop_at_eos=eos)


def _gen(seed: int | None) -> torch.Generator | None:
    return torch.Generator().manual_seed(seed) if seed is not None else None


def _alone(model, prompts, cfg: SamplerConfig, seed: int | None = None, stop=None, drafter=None, special=SPECIAL):
    return generate(model, prompts, cfg, special, generator=_gen(seed), stop=stop, drafter=drafter)


def _add(engine: Engine, prompts, cfg: SamplerConfig, seed: int | None = None, stop=None, drafter=None) -> Request:
    loop = make_loop(engine.model, prompts, cfg, engine.special, generator=_gen(seed), stop=stop, drafter=drafter)
    return engine.add(loop)


def _run(engine: Engine, arrivals: list[Arrival], drafters: list | None = None) -> list[Request]:
    """Add each request at its step (seeded generators for sampled ones, its drafter); step until all have ended."""
    reqs: list[Request | None] = [None] * len(arrivals)
    step = 0
    while step == 0 or engine.busy or any(r is None for r in reqs):
        for i, (at, prompts, cfg, seed) in enumerate(arrivals):
            if at == step and reqs[i] is None:
                reqs[i] = _add(engine, prompts, cfg, seed, drafter=None if drafters is None else drafters[i])
        engine.step()
        step += 1
        assert step < 500
    return [r for r in reqs if r is not None]


def _same(req: Request, alone) -> None:
    assert req.error is None, req.error
    got = req.result
    assert got is not None
    assert got.sequences == alone.sequences
    assert torch.equal(got.canvas_BL, alone.canvas_BL)
    assert got.gen_start_B == alone.gen_start_B
    mine, theirs = got.counters.as_dict(), alone.counters.as_dict()
    for key in ("nfe", "steps", "rounds", "tokens_committed", "accepted", "drafted", "tau"):
        assert mine[key] == theirs[key], key


def _prompts(req: Request) -> list[list[int]]:
    loop = req.loop
    return [row[:n] for row, n in zip(loop.tokens_BP.tolist(), loop.len_B.tolist(), strict=True)]


def test_greedy_requests_joining_at_different_steps_decode_as_alone(model):
    rng = random.Random(0)
    arrivals = []
    for i in range(12):
        prompts = random_prompts(rng.choice([1, 1, 2, 3]), seed=100 + i)
        arrivals.append((rng.randrange(0, 20), prompts, _cfg(rng.choice([1, 3, 8, 17]), eos=i % 2 == 0), None))
    engine = Engine(model, SPECIAL, Limits(max_rows=64))
    reqs = _run(engine, arrivals)
    for req, (_, prompts, cfg, _) in zip(reqs, arrivals, strict=True):
        _same(req, _alone(model, prompts, cfg))
    rows = engine.executor.causal
    assert rows.rows == {} and rows.owner == []
    assert all(k.shape[0] == 0 for layer in rows.target.cache.layers.values() for k in (layer.k_BKTD, layer.v_BKTD))


def test_sampled_requests_draw_what_they_draw_alone(model):
    arrivals = [
        (0, random_prompts(2, seed=1), _cfg(12, temperature=1.0), 11),
        (2, random_prompts(1, seed=2), _cfg(9, temperature=0.7, top_k=5), 12),
        (3, random_prompts(3, seed=3), _cfg(6), None),  # greedy beside them
        (5, random_prompts(2, seed=4), _cfg(15, temperature=1.3, eos=False), 13),
    ]
    reqs = _run(Engine(model, SPECIAL, Limits(max_rows=64)), arrivals)
    for req, (_, prompts, cfg, seed) in zip(reqs, arrivals, strict=True):
        _same(req, _alone(model, prompts, cfg, seed))


def test_a_stop_function_ends_a_row_as_it_does_alone(model):
    prompts = random_prompts(3, seed=7)
    stop = lambda ids: len(ids) >= 2 and ids[-1] % 4 == 0  # noqa: E731
    alone = _alone(model, prompts, _cfg(20, eos=False), stop=stop)
    engine = Engine(model, SPECIAL, Limits(max_rows=8))
    other = _add(engine, random_prompts(2, seed=8), _cfg(30))
    req = _add(engine, prompts, _cfg(20, eos=False), stop=stop)
    while not req.done:
        engine.step()
    _same(req, alone)
    other.cancelled = True
    engine.step()
    assert not engine.busy and other.done and other.result is None


def test_leaving_moves_the_last_rows_into_the_freed_ones(model):
    """A request that leaves (done, or its client gone) frees its rows: the last running rows move into them
    and the buffers end after the running rows, so no forward runs a free row; the others decode on unchanged."""
    engine = Engine(model, SPECIAL, Limits(max_rows=16))
    rows = engine.executor.causal
    long = [_add(engine, random_prompts(2, seed=20 + i), _cfg(40, eos=False)) for i in range(4)]  # 8 rows
    engine.step()
    assert len(rows.owner) == 8 and engine.rows == 8
    long[1].cancelled = True  # a client went away
    engine.step()
    assert len(rows.owner) == 6 == engine.rows == rows.target.length_B.shape[0]
    assert sorted(r for held in rows.rows.values() for r in held) == list(range(6))
    late = _add(engine, random_prompts(2, seed=30), _cfg(8, eos=False))
    engine.step()
    assert len(rows.owner) == 8 and engine.rows == 8
    for _ in range(2):
        engine.step()
    long[0].cancelled = long[2].cancelled = True
    engine.step()
    assert len(rows.owner) == 4 == engine.rows
    assert all(k.shape[0] == 4 for layer in rows.target.cache.layers.values() for k in (layer.k_BKTD, layer.v_BKTD))
    while not late.done:
        engine.step()
    assert len(rows.owner) == 2 == engine.rows
    while not long[3].done:
        engine.step()
    _same(long[3], _alone(model, _prompts(long[3]), _cfg(40, eos=False)))
    _same(late, _alone(model, _prompts(late), _cfg(8, eos=False)))
    assert rows.owner == [] and all(layer.k_BKTD.shape[0] == 0 for layer in rows.target.cache.layers.values())


def test_the_buffers_memory_stays_for_the_next_wave(model):
    """When the rows empty, their memory stays: the next requests join into it without a new allocation (as
    long as they fit its rows and capacity), and decode as alone."""
    engine = Engine(model, SPECIAL, Limits(max_rows=16))
    rows = engine.executor.causal
    first = [_add(engine, random_prompts(2, seed=40 + i), _cfg(12, eos=False)) for i in range(3)]  # 6 rows
    while engine.busy:
        engine.step()
    layer = rows.target.cache.layers[0]
    memory = layer.bases["k_BKTD"].data_ptr()
    assert layer.k_BKTD.shape[0] == 0 and layer.bases["k_BKTD"].shape[0] >= 6
    second = [_add(engine, random_prompts(2, seed=50 + i), _cfg(8, eos=False)) for i in range(2)]  # 4 rows
    engine.step()
    assert layer.k_BKTD.shape[0] == 4 and layer.k_BKTD.data_ptr() == memory  # the same memory
    while engine.busy:
        engine.step()
    for req in first + second:
        _same(req, _alone(model, _prompts(req), _cfg(req.loop.cfg.gen_length, eos=False)))


def test_a_request_that_ends_with_its_first_token_never_takes_a_row(model):
    engine = Engine(model, SPECIAL, Limits(max_rows=4))
    other = _add(engine, random_prompts(1, seed=6), _cfg(9, eos=False))
    engine.step()
    req = _add(engine, random_prompts(2, seed=5), _cfg(1))
    assert req in engine.step() and req.done
    assert len(engine.executor.causal.owner) == 1  # the other's row only
    _same(req, _alone(model, _prompts(req), _cfg(1)))
    while engine.busy:
        engine.step()
    _same(other, _alone(model, _prompts(other), _cfg(9, eos=False)))


def test_a_request_that_does_not_fit_waits_for_rows_to_free(model):
    engine = Engine(model, SPECIAL, Limits(max_rows=4))
    first = _add(engine, random_prompts(3, seed=60), _cfg(6, eos=False))
    waiting = _add(engine, random_prompts(2, seed=61), _cfg(4, eos=False))
    engine.step()
    assert first.started and not waiting.started and list(engine.waiting) == [waiting]
    while not first.done:
        engine.step()
    while engine.busy:
        engine.step()
    _same(waiting, _alone(model, _prompts(waiting), _cfg(4, eos=False)))


def test_drafter_requests_join_the_running_rows_beside_ar_requests(model):
    """Speculative requests (a drafter each, its own state) share the target forwards with AR requests: every
    request's tokens and counters equal its decoding alone, greedy and sampled."""
    from tests.unit.test_dflash import make_drafter, make_target

    target = make_target(seed=3).double()
    drafter = make_drafter(target, block=4).double()
    special = SpecialIds(63, 0, 1, 64)
    rng = random.Random(5)
    arrivals, drafters = [], []
    for i in range(8):
        cfg = SamplerConfig(generation="causal", gen_length=rng.choice([5, 12, 20]),
                            temperature=0.0 if i % 3 else 1.0, stop_at_eos=i % 2 == 0)  # fmt: skip
        prompts = [[rng.randrange(2, 60) for _ in range(rng.randrange(1, 9))] for _ in range(rng.choice([1, 2]))]
        arrivals.append((rng.randrange(0, 6), prompts, cfg, 100 + i))
        drafters.append(drafter if i % 2 == 0 else None)  # half of them speculative
    engine = Engine(target, special, Limits(max_rows=32))
    reqs = _run(engine, arrivals, drafters)
    assert engine.executor.causal.counters.nfe < sum(r.counters.nfe for r in reqs)  # forwards were shared
    for req, (_, prompts, cfg, seed), d in zip(reqs, arrivals, drafters, strict=True):
        _same(req, _alone(target, prompts, cfg, seed, drafter=d, special=special))
