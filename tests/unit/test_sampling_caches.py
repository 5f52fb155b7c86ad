"""Sampling caches and budgets against the plain (uncached, unbatched) reference path.

Every model here runs in float64: the cached, uncached, batched and unbatched paths add the same
numbers in different orders, and in float32 that rounding can flip a greedy argmax between two
near-tied tokens, which would make an exactness test flaky for reasons unrelated to the cache.

Shapes: B batch, L canvas length, V vocabulary, G generated length.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from pydantic import ValidationError

from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.results import GenerationResult
from tests.unit.test_sampling import FakeModel

V = 32
SPECIAL = SpecialIds(mask_id=31, pad_id=30, eos_id=29, num_tokens=V)
PROMPTS = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]  # different lengths, one a single token
DETERMINISTIC = ["low_confidence", "margin", "entropy", "threshold", "factor"]
COMMIT_POLICIES = ["low_confidence", "random", "margin", "entropy", "threshold", "factor"]
ALL_POLICIES = [*COMMIT_POLICIES, "ancestral", "first_hitting", "uniform"]
CACHES = {"bidirectional": ["none", "prefix", "dual"], "block": ["none", "block"]}


def make_tiny(seed: int = 0, num_layers: int = 2, shift_logits: bool = False) -> Transformer:
    """A random tiny transformer in float64 (see the module docstring for why float64)."""
    cfg = ModelConfig(preset="tiny", vocab_size=V, init_std=0.2, num_layers=num_layers, shift_logits=shift_logits)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.double().eval()


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return make_tiny(0)


class CacheTolerantFake(FakeModel):
    """A FakeModel that accepts (and ignores) the KV cache the cached paths hand to the model."""

    def forward(self, tokens_BL, positions_BL, mask=None, cache=None):
        return super().forward(tokens_BL, positions_BL, mask)


def prefers_mask(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The mask token wins by far everywhere; the sampler must never propose it."""
    logits = torch.zeros(*tokens.shape, V, dtype=torch.float64)
    logits[..., SPECIAL.mask_id] = 1e4
    logits[..., 3] = 0.5
    return logits


def sampler(**kw) -> SamplerConfig:
    base = {"gen_length": 12, "block_length": 4, "steps": 12, "stop_at_eos": False, "shift": "off"}
    return SamplerConfig(**{**base, **kw})


def run(model, prompts, cfg: SamplerConfig, seed: int = 0) -> GenerationResult:
    return generate(model, prompts, cfg, SPECIAL, generator=torch.Generator().manual_seed(seed))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


# --------------------------------------------------------------------------------------------------
# 1. the exact block cache


@pytest.mark.parametrize("policy", ["low_confidence", "margin", "threshold", "factor"])
@pytest.mark.parametrize("sub_block_length", [None, 2])
@pytest.mark.parametrize("shift", ["off", "on"])
def test_block_cache_is_exact_for_block_attention(tiny, shift, sub_block_length, policy):
    kw = {"attention": "block", "policy": policy, "threshold": 0.3, "shift": shift}
    kw["sub_block_length"] = sub_block_length
    plain = run(tiny, PROMPTS, sampler(cache="none", **kw))
    cached = run(tiny, PROMPTS, sampler(cache="block", **kw))
    assert cached.sequences == plain.sequences
    assert torch.equal(cached.canvas_BL, plain.canvas_BL)
    assert cached.counters.nfe == plain.counters.nfe
    # the cache is used: fewer query rows, the rest read from the cache
    assert cached.counters.query_tokens < plain.counters.query_tokens
    assert cached.counters.cached_tokens > 0
    assert plain.counters.cached_tokens == 0
    for i, prompt in enumerate(PROMPTS):
        for cache in ("none", "block"):
            alone = run(tiny, [prompt], sampler(cache=cache, **kw))
            assert alone.sequences[0] == plain.sequences[i], (i, cache)


@pytest.mark.parametrize("cache", ["none", "block"])
def test_shifted_block_model_with_a_prompt_shorter_than_a_block(tiny, cache):
    kw = {"attention": "block", "shift": "on", "cache": cache}
    """The first active block would start at canvas index 0; the prediction of its first position reads
    the row before it, so the canvas gets one more block of left padding."""
    for prompts in ([[6]], [[1, 2], [3]], PROMPTS):
        res = run(tiny, prompts, sampler(**kw))
        assert not any(31 in s for s in res.sequences) and [len(s) for s in res.sequences] == [12] * len(prompts)
        for i, prompt in enumerate(prompts):
            assert run(tiny, [prompt], sampler(**kw)).sequences[0] == res.sequences[i]


# --------------------------------------------------------------------------------------------------
# 2. batched equals unbatched


@pytest.mark.parametrize("policy", DETERMINISTIC)
@pytest.mark.parametrize("attention", ["bidirectional", "block"])
def test_batched_equals_each_prompt_alone_for_every_cache(tiny, attention, policy):
    prompts = [*PROMPTS, []]  # an empty prompt: the model must still decode from positions alone
    for cache in CACHES[attention]:
        cfg = sampler(attention=attention, cache=cache, policy=policy, threshold=0.3, shift="off")
        batched = run(tiny, prompts, cfg)
        assert [len(s) for s in batched.sequences] == [12] * len(prompts)
        for i, prompt in enumerate(prompts):
            alone = run(tiny, [prompt], cfg)
            assert alone.sequences[0] == batched.sequences[i], (cache, i)


@pytest.mark.parametrize(("attention", "cache"), [("bidirectional", "none"), ("bidirectional", "dual"),
                                                  ("block", "none"), ("block", "block")])  # fmt: skip
def test_a_model_that_shifts_its_own_logits_decodes_as_its_unshifted_weights(attention, cache):
    """shift on: the model returns unshifted states and the runner shifts across its slices itself, so
    a shift_logits model decodes exactly as the same weights without the flag."""
    plain, shifting = make_tiny(0), make_tiny(0, shift_logits=True)
    cfg = sampler(attention=attention, cache=cache, shift="on")
    a, b = run(plain, PROMPTS, cfg), run(shifting, PROMPTS, cfg)
    assert a.sequences == b.sequences and torch.equal(a.canvas_BL, b.canvas_BL)


def test_generate_refuses_an_unresolved_shift(tiny):
    with pytest.raises(ValueError, match="resolve_sampler"):
        run(tiny, PROMPTS, sampler(shift="auto"))


def test_shifted_model_refuses_an_empty_prompt_alone(tiny):
    with pytest.raises(ValueError, match="at least one token"):
        run(tiny, [[]], sampler(attention="bidirectional", shift="on"))


def test_shifted_model_refuses_an_empty_prompt_in_a_batch(tiny):
    with pytest.raises(ValueError, match="at least one token"):
        run(tiny, [[1, 2], []], sampler(attention="bidirectional", shift="on"))


# --------------------------------------------------------------------------------------------------
# 3. the approximate prefix and dual caches


@pytest.mark.parametrize("shift", ["off", "on"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_cache_refreshed_every_step_is_the_uncached_loop(tiny, cache, shift):
    prompts = PROMPTS if shift == "on" else [*PROMPTS, []]
    base = {"attention": "bidirectional", "shift": shift}
    plain = run(tiny, prompts, sampler(cache="none", **base))
    every = run(tiny, prompts, sampler(cache=cache, refresh_every=1, **base))
    assert every.sequences == plain.sequences
    assert torch.equal(every.canvas_BL, plain.canvas_BL)


@pytest.mark.parametrize("shift", ["off", "on"])
@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_cache_is_exact_for_a_one_layer_model(cache, shift):
    """With one layer a key depends on its own token and position only: prefix tokens and the masked
    suffix do not change inside a block, so their cached keys are exact and so is the output."""
    model = make_tiny(0, num_layers=1)
    prompts = PROMPTS if shift == "on" else [*PROMPTS, []]
    base = {"attention": "bidirectional", "shift": shift}
    plain = run(model, prompts, sampler(cache="none", **base))
    cached = run(model, prompts, sampler(cache=cache, **base))
    assert cached.sequences == plain.sequences
    assert cached.counters.query_tokens < plain.counters.query_tokens


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_approximate_cache_agreement_and_cost(cache, capsys):
    """Refreshed once per block the cache is stale inside the block: report how often it agrees with
    the uncached loop (random untrained models are the worst case; trained ones agree far more)."""
    prompts = [*PROMPTS, []]
    agree, fewer = [], []
    for seed in range(4):
        model = make_tiny(seed)
        plain = run(model, prompts, sampler(attention="bidirectional", cache="none"))
        cached = run(model, prompts, sampler(attention="bidirectional", cache=cache))
        agree.append(agreement(cached.sequences, plain.sequences))
        fewer.append(cached.counters.query_tokens < plain.counters.query_tokens)
        assert cached.counters.nfe == plain.counters.nfe
        assert cached.counters.cached_tokens > 0 == plain.counters.cached_tokens
    rate = sum(agree) / len(agree)
    with capsys.disabled():
        print(f"\n{cache} cache, refreshed once per block: token agreement {rate:.3f} (per model {agree})")
    assert rate > 0.5
    assert all(fewer)


# --------------------------------------------------------------------------------------------------
# 4. never a mask, always gen_length tokens


def budgets(G: int, b: int) -> list[int]:
    return [G, G // 2, G // b]  # one step per token, half, one step per block


@pytest.mark.parametrize("model_kind", ["tiny", "prefers_mask"])
@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_no_mask_and_full_length_for_every_valid_combination(tiny, model_kind, policy):
    G, b = 8, 4
    model = tiny if model_kind == "tiny" else CacheTolerantFake(prefers_mask)
    valid = 0
    combos = itertools.product(["bidirectional", "block"], ["none", "prefix", "dual", "block"], budgets(G, b), [0, 1.0])
    for attention, cache, steps, temperature in combos:
        try:
            cfg = SamplerConfig(gen_length=G, block_length=b, steps=steps, policy=policy, attention=attention,
                                cache=cache, temperature=temperature, stop_at_eos=False, shift="off")  # fmt: skip
        except ValidationError:
            continue
        valid += 1
        res = run(model, PROMPTS, cfg, seed=valid)
        where = (attention, cache, steps, temperature)
        assert not bool((res.canvas_BL == SPECIAL.mask_id).any()), where
        assert all(SPECIAL.mask_id not in s for s in res.sequences), where
        assert [len(s) for s in res.sequences] == [G] * len(PROMPTS), where
        assert all(0 <= t < V for s in res.sequences for t in s), where
        assert res.counters.tokens_committed == G * len(PROMPTS), where
        for i, prompt in enumerate(PROMPTS):  # the prompt is never overwritten
            start = res.gen_start_B[i]
            assert res.canvas_BL[i, start - len(prompt) : start].tolist() == prompt, where
    # bidirectional: 3 caches, block: 2 (process policies: bidirectional, cache none only); x 3 x 2
    expected = 6 if policy in ("ancestral", "first_hitting", "uniform") else 30
    assert valid == expected


# --------------------------------------------------------------------------------------------------
# 5. NFE of fixed budgets


@pytest.mark.parametrize(
    "layout",
    [(8, 4, 8), (8, 4, 4), (8, 4, 2), (16, 4, 16), (16, 4, 8), (16, 4, 4), (12, 4, 24)],
    ids=lambda x: "g{}b{}s{}".format(*x),
)
def test_nfe_of_scheduled_policies_and_guidance(tiny, layout):
    G, b, S = layout
    nblocks = G // b
    expected = nblocks * min(S // nblocks, b)
    prompts = [[1, 2, 3], [4, 5, 6]]
    T = 3 + G
    plain = run(tiny, prompts, sampler(gen_length=G, block_length=b, steps=S, attention="bidirectional"))
    assert plain.counters.nfe == expected
    assert plain.counters.query_tokens == expected * len(prompts) * T
    guided = run(tiny, prompts, sampler(gen_length=G, block_length=b, steps=S, cfg_scale=1.5))
    assert guided.counters.nfe == expected  # the guidance pair is one batched call
    assert guided.counters.query_tokens == 2 * plain.counters.query_tokens


@pytest.mark.parametrize("steps", [16, 4])
def test_nfe_of_first_hitting_is_one_per_token(tiny, steps):
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    cfg = sampler(gen_length=16, block_length=4, steps=steps, policy="first_hitting", temperature=1.0)
    res = run(tiny, prompts, cfg)
    assert res.counters.nfe == 16
    assert res.counters.tokens_committed == 16 * len(prompts)


# --------------------------------------------------------------------------------------------------
# 6. overrun instead of a mask


@pytest.mark.parametrize("G", [8, 16])
def test_threshold_never_reached_overruns_one_token_per_step(tiny, G):
    b = 4
    nblocks = G // b
    cfg = sampler(gen_length=G, block_length=b, steps=nblocks, policy="threshold", threshold=1.0)
    res = run(tiny, PROMPTS, cfg)
    assert not bool((res.canvas_BL == SPECIAL.mask_id).any())
    assert [len(s) for s in res.sequences] == [G] * len(PROMPTS)
    # no probability reaches 1: each step commits only each row's most confident position
    assert res.counters.nfe == res.counters.steps == G
    assert res.counters.overrun_steps == G - nblocks


@pytest.mark.parametrize("kind", ["canvas", "ragged"])
def test_a_dropped_cache_frees_its_buffers_without_the_cycle_collector(tiny, kind):
    """Each layer's buffers hold only a weak reference to their cache: a decoding call's cache (hundreds of MB
    on a real model) is freed when its last user drops it, not at some later cyclic garbage collection (a
    process decoding many calls in a row grew by GBs before)."""
    import gc
    import weakref

    from dllm.sampling.cache import KVCache
    from dllm.sampling.causal import Target
    from dllm.sampling.results import Counters

    gc.collect()
    gc.disable()
    try:
        with torch.inference_mode():
            if kind == "canvas":
                cache = KVCache(8).at(0, 4)
                tiny(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache=cache)
                buffers = [weakref.ref(layer.k_BKTD) for layer in cache.layers.values()]
            else:
                cache = Target(tiny, 2, 8, Counters())
                cache.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
                cache.commit(torch.tensor([3, 2]))
                cache.forward(torch.tensor([[7], [8]]))  # rows at different lengths: the ragged write
                buffers = [weakref.ref(layer.k_BKTD) for layer in cache.cache.layers.values()]
        assert len(buffers) == tiny.cfg.num_layers and all(b() is not None for b in buffers)
        del cache
        assert all(b() is None for b in buffers)
    finally:
        gc.enable()
