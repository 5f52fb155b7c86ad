"""Continuous batching of diffusion decoding (sampling/canvas_batch.py): requests that join a running canvas
batch at different steps, with different prompts, lengths, blocks, step budgets, policies, EOS and sampler
settings, decode exactly what a `generate` call of each alone decodes (greedy token for token; sampled
from the same seeded draws), and count the same model calls and steps.

The model is float64 so that forwards of batches of other shapes agree far below any argmax gap.
"""

from __future__ import annotations

import random

import pytest
import torch

from dllm.config.sampler import SamplerConfig
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.canvas_batch import CanvasBatch, CanvasGroup
from dllm.sampling.generate import generate
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


def _run(
    batch: CanvasBatch, arrivals: list[tuple[int, list[list[int]], SamplerConfig, int | None]]
) -> list[CanvasGroup]:
    """Join each request at its step (seeded generators for sampled ones); step until all have returned."""
    groups: list[CanvasGroup | None] = [None] * len(arrivals)
    step = 0
    while step == 0 or batch.groups or any(g is None for g in groups):
        for i, (at, prompts, cfg, seed) in enumerate(arrivals):
            if at == step and groups[i] is None:
                assert batch.fits(len(prompts))
                groups[i] = batch.join(prompts, cfg, _gen(seed))
        batch.step()
        step += 1
        assert step < 500
    return [g for g in groups if g is not None]


def _same(group: CanvasGroup, model, prompts, cfg: SamplerConfig, seed: int | None) -> None:
    assert group.error is None
    got = group.result()
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
    batch = CanvasBatch(model, SPECIAL, max_rows=64)
    groups = _run(batch, arrivals)
    for group, (_, prompts, cfg, _) in zip(groups, arrivals, strict=True):
        _same(group, model, prompts, cfg, None)
    assert batch.groups == [] and batch.rows == 0
    assert max(g.batch_rows / g.counters.nfe for g in groups) > max(g.rows for g in groups)  # forwards were shared


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
    batch = CanvasBatch(model, SPECIAL, max_rows=64)
    groups = _run(batch, arrivals)
    for group, (_, prompts, cfg, _) in zip(groups, arrivals, strict=True):
        _same(group, model, prompts, cfg, None)
    assert batch.groups == [] and all(rows.num_rows == 0 for rows in batch.cached.values())
    cached = [g for g in groups if g.loop.cfg.cache == "block"]
    assert max(g.batch_rows / g.counters.nfe for g in cached) > max(g.rows for g in cached)  # forwards were shared


def test_a_block_cached_request_that_leaves_moves_the_last_rows(model):
    batch = CanvasBatch(model, SPECIAL, max_rows=64)
    kw = {"attention": "block", "cache": "block", "block_length": 4, "gen_length": 12, "steps": 12}
    a = batch.join([[1, 2, 3], [4]], _cfg(**kw))
    b = batch.join([[5, 6]], _cfg(**kw))
    c = batch.join([[7, 8, 9, 10, 11], [12, 13]], _cfg(**kw))
    batch.step()
    batch.leave(a)
    rows = batch.cached[4]
    assert rows.num_rows == 3 and sorted(r for g in rows.groups for r in rows.rows[g]) == [0, 1, 2]
    assert rows.kv.layers[0].k_BKTD.shape[0] == 3
    while batch.groups:
        batch.step()
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
    groups = _run(CanvasBatch(model, SPECIAL, max_rows=64), arrivals)
    for group, (_, prompts, cfg, seed) in zip(groups, arrivals, strict=True):
        _same(group, model, prompts, cfg, seed)


def test_a_request_that_leaves_frees_its_rows_and_the_others_decode_as_alone(model):
    batch = CanvasBatch(model, SPECIAL, max_rows=64)
    stays = ([[1, 2, 3], [4]], _cfg(gen_length=16, steps=16))
    a = batch.join(*stays)
    b = batch.join([[5, 6, 7, 8, 9]], _cfg(gen_length=16, block_length=16, steps=16))
    for _ in range(3):
        batch.step()
    batch.leave(b)
    assert batch.groups == [a] and batch.rows == 2 and b.done and b.returned is None
    while batch.groups:
        batch.step()
    _same(a, model, *stays, None)


def test_a_failing_request_leaves_alone(model):
    def boom(event):
        raise RuntimeError("this request's callback failed")

    batch = CanvasBatch(model, SPECIAL, max_rows=64)
    ok = batch.join([[1, 2]], _cfg())
    bad = batch.join([[3, 4]], _cfg(), callback=boom)
    finished = batch.step()
    assert finished == [bad] and isinstance(bad.error, RuntimeError) and batch.groups == [ok]
    while batch.groups:
        batch.step()
    _same(ok, model, [[1, 2]], _cfg(), None)


def test_what_joins_and_what_fits():
    tiny = tiny_transformer()
    assert CanvasBatch.takes(_cfg(), tiny)
    assert not CanvasBatch.takes(_cfg(cache="prefix"), tiny)  # approximate caches hold keys of their own canvas
    assert CanvasBatch.takes(_cfg(cache="block", attention="block"), tiny)
    assert not CanvasBatch.takes(_cfg(cfg_scale=1.0), tiny)
    assert not CanvasBatch.takes(SamplerConfig(generation="causal", gen_length=4), tiny)
    batch = CanvasBatch(tiny, SPECIAL, max_rows=3)
    with pytest.raises(ValueError, match="takes"):
        batch.join([[1]], _cfg(cache="dual"))
    assert batch.fits(5)  # an empty batch takes any request
    batch.join([[1], [2]], _cfg(attention="block", block_length=4))
    assert batch.fits(1) and not batch.fits(2)  # 4 rows > 3


def test_the_steps_stream_through_each_requests_callback(model):
    seen: list[int] = []
    batch = CanvasBatch(model, SPECIAL, max_rows=8)
    g = batch.join([[1, 2, 3]], _cfg(gen_length=8, steps=8), callback=lambda e: seen.append(int(e.committed_BT.sum())))
    while batch.groups:
        batch.step()
    assert seen == [1] * 8 and g.counters.steps == 8 and g.counters.nfe == 8


def test_a_step_runs_one_forward_per_mask_and_length_bucket(model):
    """Requests share a forward when their masks agree (a block model's block size) and their canvases are
    longer than half of the forward's longest; the others run in forwards of their own in the same step."""
    shapes: list[tuple[int, int]] = []
    hook = model.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    try:
        batch = CanvasBatch(model, SPECIAL, max_rows=64)
        batch.join([[1, 2]], _cfg(gen_length=8))  # canvas 10
        batch.join([[3, 4, 5], [6]], _cfg(gen_length=8))  # 11
        batch.join([[7]], _cfg(gen_length=32, block_length=8, steps=32))  # 33: more than twice 11
        batch.step()
        assert sorted(shapes) == [(1, 33), (3, 11)]
        shapes.clear()
        blocks = CanvasBatch(model, SPECIAL, max_rows=64)
        blocks.join([[1, 2]], _cfg(attention="block", block_length=4))
        blocks.join([[3]], _cfg(attention="block", block_length=2))
        blocks.step()
        assert len(shapes) == 2  # one per block size
    finally:
        hook.remove()
