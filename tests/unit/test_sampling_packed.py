"""The packed linear layers of causal decoding on a CPU (sampling/packed.py) against the plain F.linear
reference: the same greedy tokens and logits within float rounding, the packed weights kept across calls
and packed again after a weight changes, the model's modules untouched after a call; and the equal-length
fast path of the ragged cache (one slice write, no mask for one query) against the no-cache reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import RaggedKVCache, Target
from dllm.sampling.packed import PackedLinears
from dllm.sampling.results import Counters
from dllm.sampling.speculative import causal_generate
from tests.unit.test_sampling_ar import MASK_ID, V, causal_model, random_prompts

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def run(model, prompts, n: int = 10, **kwargs):
    cfg = SamplerConfig(generation="causal", gen_length=n, stop_at_eos=False)
    with torch.inference_mode():
        return causal_generate(model, prompts, cfg, SpecialIds(MASK_ID, 0, 0, V), return_logits=True, **kwargs)


def test_packed_decoding_matches_the_plain_linear_reference():
    model = causal_model(seed=6, width=128)
    prompts = random_prompts(5, seed=7)
    packed, plain = run(model, prompts), run(model, prompts, packed=False)
    assert packed.sequences == plain.sequences
    torch.testing.assert_close(packed.logits_BNV, plain.logits_BNV, atol=1e-4, rtol=0)


def test_packed_weights_are_kept_across_calls_and_repacked_after_a_change():
    model = causal_model(seed=8)
    with torch.inference_mode():
        first = PackedLinears.of(model)
        again = PackedLinears.of(model)
    assert first is not None and again is not None
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert len(first.packed) == len(linears)
    assert all(again.packed[k][1] is v[1] for k, v in first.packed.items())  # packed once
    prompts = random_prompts(3, seed=9)
    run(model, prompts)  # packs the tied output head at its first use
    assert len(model._dllm_packed_linears) == len(linears) + 1
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(3.0)  # changed in place, as a training step would
        model.embed_tokens.weight.mul_(0.5)
    after, plain = run(model, prompts), run(model, prompts, packed=False)
    torch.testing.assert_close(after.logits_BNV, plain.logits_BNV, atol=1e-4, rtol=0)


def test_the_modules_are_plain_again_after_a_call_and_autograd_is_never_packed():
    model = causal_model(seed=10)
    run(model, random_prompts(2, seed=11))
    assert not any("forward" in vars(m) for m in model.modules())  # the class's forward, no instance patch
    target = Target(model, 1, 16, Counters())  # grad enabled: the plain path, autograd works through it
    assert target.packed is None
    x = torch.randint(0, MASK_ID, (1, 4))
    model(x, torch.arange(4)[None]).logits().sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad is not None


def test_rows_of_equal_length_take_the_slice_write_and_match_the_reference():
    """Equal lengths: the cache writes one slice and a single query needs no mask; the tokens and logits
    are those of recomputing every row (and of the ragged path, which a longer first row forces)."""
    model = causal_model(seed=12)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, MASK_ID, (6,), generator=g).tolist() for _ in range(4)]
    cached, plain = run(model, prompts), run(model, prompts, use_cache=False)
    assert cached.sequences == plain.sequences
    torch.testing.assert_close(cached.logits_BNV, plain.logits_BNV, atol=1e-5, rtol=0)
    ragged = run(model, [prompts[0] + [1], *prompts[1:]])
    assert ragged.sequences[1:] == cached.sequences[1:]
    cache = RaggedKVCache(16, torch.tensor([5, 5]))
    _, mask = cache.at(1)
    assert cache.write_start == 5 and mask.is_plain and mask.kind == "bidirectional"
    cache.length_B = torch.tensor([5, 3])
    _, mask = cache.at(1)
    assert cache.write_start is None and mask.query_offset_B is not None


def test_a_build_whose_packed_ops_fail_or_disagree_decodes_with_f_linear(monkeypatch):
    import dllm.sampling.packed as packed

    model = causal_model(seed=14)
    prompts = random_prompts(2, seed=15)
    plain = run(model, prompts, packed=False)
    monkeypatch.setattr(packed, "_packed_linear", lambda p, b, x: torch.zeros(*x.shape[:-1], p.shape[0]))
    with torch.inference_mode():
        assert PackedLinears.of(model) is None  # disagrees with F.linear: not used
    assert run(model, prompts).sequences == plain.sequences

    def missing(*args):
        raise RuntimeError("no such op in this build")

    monkeypatch.setattr(packed, "_pack", missing)
    with torch.inference_mode():
        assert PackedLinears.of(causal_model(seed=16)) is None
