"""Continuous batching of diffusion decoding (the engine's shared canvas forwards: inference/canvas_rows.py,
inference/cached_rows.py): requests that join the running canvases at different steps, with different
prompts, lengths, blocks, step budgets, policies, EOS and sampler settings, decode exactly what a
`generate` call of each alone decodes (greedy token for token; sampled from the same seeded draws), and
count the same model calls and steps.

The model is float64 so that forwards of batches of other shapes agree far below any argmax gap.
"""

from __future__ import annotations

import random

import pytest
import torch

from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import Engine, generate, make_loop, shares_forwards
from dllm.inference.request import Request
from dllm.inference.scheduler import Limits
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds
from tests.unit.test_sampling import tiny_transformer

SPECIAL = SpecialIds(mask_id=31, pad_id=30, eos_id=8, num_tokens=29)  # 8: a token the tiny model produces


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_transformer(seed=3).double()


def _cfg(**kw) -> SamplerConfig:
    return SamplerConfig(**{"gen_length": 8, "block_length": 4, "steps": 8, "stop_at_eos": False, "shift": "off",
                            **kw})  # fmt: skip


def _gen(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(seed)


def _engine(model, max_rows: int = 64) -> Engine:
    return Engine(model, SPECIAL, Limits(max_rows=max_rows))


def _add(engine: Engine, prompts, cfg: SamplerConfig, seed: int | None = None, callback=None) -> Request:
    return engine.add(make_loop(engine.model, prompts, cfg, SPECIAL, generator=_gen(seed), callback=callback))


def _run(engine: Engine, arrivals: list[tuple[int, list[list[int]], SamplerConfig, int | None]]) -> list[Request]:
    """Add each request at its step (seeded generators for sampled ones); step until all have ended."""
    reqs: list[Request | None] = [None] * len(arrivals)
    step = 0
    while step == 0 or engine.busy or any(r is None for r in reqs):
        for i, (at, prompts, cfg, seed) in enumerate(arrivals):
            if at == step and reqs[i] is None:
                reqs[i] = _add(engine, prompts, cfg, seed)
        engine.step()
        step += 1
        assert step < 500
    return [r for r in reqs if r is not None]


def _same(req: Request, model, prompts, cfg: SamplerConfig, seed: int | None) -> None:
    assert req.error is None, req.error
    got = req.result
    assert got is not None
    alone = generate(model, prompts, cfg, SPECIAL, generator=_gen(seed))
    assert got.sequences == alone.sequences
    assert torch.equal(got.canvas_BL, alone.canvas_BL)
    assert got.gen_start_B == alone.gen_start_B
    mine, theirs = got.counters.as_dict(), alone.counters.as_dict()
    for key in ("nfe", "steps", "tokens_committed", "overrun_steps", "reused_forwards", "query_tokens"):
        assert mine[key] == theirs[key], key


def _prompts(rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(0, 29) for _ in range(rng.randrange(1, 9))] for _ in range(rng.choice([1, 1, 2, 3]))]


@pytest.mark.parametrize("attention", ["bidirectional", "block"])
@pytest.mark.parametrize("shift", ["off", "on"])
def test_greedy_requests_joining_at_different_steps_decode_as_alone(model, attention, shift):
    rng = random.Random(hash((attention, shift)) % 1000)
    arrivals = []
    for i in range(10):
        if attention == "block":  # block sizes (a forward each), lengths, budgets and sub-blocks vary
            bl = rng.choice([4, 4, 2])
            kw = {
                "block_length": bl,
                "gen_length": bl * rng.choice([1, 2, 3]),
                "sub_block_length": rng.choice([None, 2]),
            }
        else:
            G = rng.choice([4, 8, 16])
            kw = {"gen_length": G, "block_length": rng.choice([b for b in (2, 4, 8, 16) if G % b == 0])}
        kw["steps"] = kw["gen_length"] * rng.choice([1, 2]) // 2 or kw["gen_length"]
        kw["steps"] -= kw["steps"] % (kw["gen_length"] // kw["block_length"])
        policy = rng.choice(["low_confidence", "margin", "entropy", "threshold", "factor"])
        cfg = _cfg(attention=attention, shift=shift, policy=policy, threshold=0.2, stop_at_eos=i % 2 == 0, **kw)
        arrivals.append((rng.randrange(0, 12), _prompts(rng), cfg, None))
    engine = _engine(model)
    reqs = _run(engine, arrivals)
    for req, (_, prompts, cfg, _) in zip(reqs, arrivals, strict=True):
        _same(req, model, prompts, cfg, None)
    assert not engine.busy and engine.rows == 0
    assert max(r.batch_rows / r.counters.nfe for r in reqs) > max(r.rows for r in reqs)  # forwards were shared


@pytest.mark.parametrize("shift", ["off", "on"])
def test_block_cached_requests_share_forwards_and_decode_as_alone(model, shift):
    """Block models with the exact block cache: each request's first call (prompt and first block) runs alone,
    then its rows' keys live in the batch's ragged cache and its windows (a block, or the previous block's
    clean rows with the next) share one forward per block size with the other cached requests, beside
    uncached ones; equal to alone, forwards counted the same."""
    rng = random.Random(11 if shift == "off" else 12)
    arrivals = []
    for i in range(10):
        bl = rng.choice([4, 4, 2])
        G = bl * rng.choice([1, 2, 3])
        policy = rng.choice(["low_confidence", "threshold"])
        cfg = _cfg(attention="block", shift=shift, cache=rng.choice(["block", "block", "none"]), block_length=bl,
                   gen_length=G, steps=G * rng.choice([1, 2]) // 2 or G, sub_block_length=rng.choice([None, 2]),
                   policy=policy, threshold=0.2, stop_at_eos=i % 3 == 0)  # fmt: skip
        arrivals.append((rng.randrange(0, 10), _prompts(rng), cfg, None))
    engine = _engine(model)
    reqs = _run(engine, arrivals)
    for req, (_, prompts, cfg, _) in zip(reqs, arrivals, strict=True):
        _same(req, model, prompts, cfg, None)
    assert not engine.busy and all(rows.num_rows == 0 for rows in engine.executor.cached.values())
    cached = [r for r in reqs if r.loop.cfg.cache == "block"]
    assert max(r.batch_rows / r.counters.nfe for r in cached) > max(r.rows for r in cached)  # forwards were shared


def test_a_block_cached_request_that_leaves_moves_the_last_rows(model):
    engine = _engine(model)
    kw = {"attention": "block", "cache": "block", "block_length": 4, "gen_length": 12, "steps": 12}
    a = _add(engine, [[1, 2, 3], [4]], _cfg(**kw))
    b = _add(engine, [[5, 6]], _cfg(**kw))
    c = _add(engine, [[7, 8, 9, 10, 11], [12, 13]], _cfg(**kw))
    engine.step()
    a.cancelled = True
    engine.step()
    rows = engine.executor.cached[4]
    assert rows.num_rows == 3 and sorted(r for g in rows.requests for r in rows.rows[g]) == [0, 1, 2]
    assert rows.kv.layers[0].k_BKTD.shape[0] == 3
    while engine.busy:
        engine.step()
    _same(b, model, [[5, 6]], _cfg(**kw), None)
    _same(c, model, [[7, 8, 9, 10, 11], [12, 13]], _cfg(**kw), None)


@pytest.mark.parametrize("policy", ["random", "low_confidence", "ancestral", "uniform"])
def test_sampled_requests_draw_what_they_draw_alone(model, policy):
    rng = random.Random(7)
    arrivals = []
    for i in range(6):
        cfg = _cfg(policy=policy, temperature=0.9, top_k=rng.choice([None, 5]), gen_length=8,
                   block_length=rng.choice([4, 8]), steps=8)  # fmt: skip
        arrivals.append((rng.randrange(0, 6), _prompts(rng), cfg, 100 + i))
    reqs = _run(_engine(model), arrivals)
    for req, (_, prompts, cfg, seed) in zip(reqs, arrivals, strict=True):
        _same(req, model, prompts, cfg, seed)


def test_a_request_that_leaves_frees_its_rows_and_the_others_decode_as_alone(model):
    engine = _engine(model)
    stays = ([[1, 2, 3], [4]], _cfg(gen_length=16, steps=16))
    a = _add(engine, *stays)
    b = _add(engine, [[5, 6, 7, 8, 9]], _cfg(gen_length=16, block_length=16, steps=16))
    for _ in range(3):
        engine.step()
    b.cancelled = True
    assert b in engine.step()
    assert engine.running == [a] and engine.rows == 2 and b.done and b.result is None
    while engine.busy:
        engine.step()
    _same(a, model, *stays, None)


def test_a_failing_request_leaves_alone(model):
    def boom(event):
        raise RuntimeError("this request's callback failed")

    engine = _engine(model)
    ok = _add(engine, [[1, 2]], _cfg())
    bad = _add(engine, [[3, 4]], _cfg(), callback=boom)
    assert engine.step() == [bad] and isinstance(bad.error, RuntimeError) and engine.running == [ok]
    while engine.busy:
        engine.step()
    _same(ok, model, [[1, 2]], _cfg(), None)


def test_what_shares_forwards():
    tiny = tiny_transformer()
    assert shares_forwards(_cfg(), tiny)
    assert not shares_forwards(_cfg(cache="prefix"), tiny)  # approximate caches hold keys of their own canvas
    assert shares_forwards(_cfg(cache="block", attention="block"), tiny)
    assert not shares_forwards(_cfg(cfg_scale=1.0), tiny)
    engine = _engine(tiny, max_rows=3)
    kinds = [
        engine.add(make_loop(tiny, [[1]], cfg, SPECIAL)).kind
        for cfg in (_cfg(), _cfg(cache="dual"), _cfg(attention="block", cache="block", block_length=4))
    ]
    assert kinds == ["canvas", "own", "canvas_cached"]
    assert (
        engine.add(make_loop(tiny, [[1]], SamplerConfig(generation="causal", gen_length=4), SPECIAL)).kind == "causal"
    )


def test_the_steps_stream_through_each_requests_callback(model):
    seen: list[int] = []
    engine = _engine(model, max_rows=8)
    req = _add(
        engine, [[1, 2, 3]], _cfg(gen_length=8, steps=8), callback=lambda e: seen.append(int(e.committed_BT.sum()))
    )
    while engine.busy:
        engine.step()
    assert seen == [1] * 8 and req.counters.steps == 8 and req.counters.nfe == 8


def test_a_step_runs_one_forward_per_mask_and_length_bucket(model):
    """Requests share a forward when their masks agree (a block model's block size) and their canvases are
    longer than half of the forward's longest; the others run in forwards of their own in the same step."""
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        engine = _engine(model)
        _add(engine, [[1, 2]], _cfg(gen_length=8))  # canvas 10
        _add(engine, [[3, 4, 5], [6]], _cfg(gen_length=8))  # 11
        _add(engine, [[7]], _cfg(gen_length=32, block_length=8, steps=32))  # 33: more than twice 11
        engine.step()
        assert sorted(shapes) == [(1, 33), (3, 11)]
        shapes.clear()
        blocks = _engine(model)
        _add(blocks, [[1, 2]], _cfg(attention="block", block_length=4))
        _add(blocks, [[3]], _cfg(attention="block", block_length=2))
        blocks.step()
        assert len(shapes) == 2  # one per block size
    finally:
        hook.remove()
