"""Causal decoding of a hybrid (qwen3_5: Gated DeltaNet and attention layers) with its cache: the ragged KV
cache of the causal loop holds the attention layers' keys and values and each linear layer's per-row state
(sampling/causal.py, models/linear_state.py).

Checked against the no-cache reference (`Recompute`: every row's whole sequence at every round): greedy AR
token for token with equal logits, alone and in a ragged batch of 4; seeded sampling draws the same tokens;
speculative decoding with drafters whose proposals rows accept in different lengths gives the AR tokens; the
running batch of the server decodes each request as alone. Against transformers: greedy decoding of an
imported random Qwen3_5ForCausalLM (float32) equals its `generate`. The models are float64 (as in
test_sampling_speculative.py) so that a forward of one token and one of the whole row agree far below any
argmax gap.

Shapes: B batch, Q tokens of a forward, N new tokens, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.inference.engine import Engine
from dllm.inference.scheduler import Limits
from dllm.models import Transformer
from dllm.sampling.causal import Target
from dllm.sampling.results import Counters
from tests.unit.test_continuous import SPECIAL, _alone, _cfg, _run, _same
from tests.unit.test_sampling_ar import MASK_ID, V, causal_model, decode, random_prompts
from tests.unit.test_sampling_speculative import (
    FeatureProbeDrafter,
    ModelDrafter,
    RandomDrafter,
    ReplayDrafter,
    full_sequences,
)

F64 = torch.float64


def hybrid(seed: int = 0, layers: int = 4) -> Transformer:
    """A random qwen3_5 of the test vocabulary (three linear layers to one attention layer), decays and
    convolution taps spread rather than their initial constants; wide init (std 0.2): peaked predictions."""
    cfg = ModelConfig(family="qwen3_5", preset="tiny", vocab_size=V, num_layers=layers, init_std=0.2)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.layers:
            if layer.linear_attn is not None:
                layer.linear_attn.A_log.normal_(0, 1, generator=g)
                layer.linear_attn.dt_bias.normal_(0, 1, generator=g)
                layer.linear_attn.conv1d.weight.normal_(0, 0.5, generator=g)
    return model.to(F64).eval()


@pytest.fixture(scope="module")
def target() -> Transformer:
    return hybrid()


def _finite_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| where the logits are finite (the mask token's are -inf in both)."""
    d = (a - b)[a.isfinite()]
    return float(d.abs().max())


def test_commit_leaves_the_state_after_the_kept_tokens(target):
    """A forward of 5 tokens per row that keeps 0..5 of them (decided after it, as a verification does), then
    one more token: its output equals that of a fresh cache that ran only the kept prefix and the token."""
    B, P, Q = 6, 4, 5
    x = torch.randint(0, MASK_ID, (B, P + Q + 1), generator=torch.Generator().manual_seed(0))
    n_B = torch.tensor([0, 1, 2, 3, 5, 4])
    with torch.inference_mode():
        t = Target(target, B, 16, Counters())
        t.forward(x[:, :P], keep_B=torch.full((B,), P))
        t.commit(torch.full((B,), P))
        t.forward(x[:, P : P + Q])  # kept counts unknown: the linear layers wait for commit
        t.commit(n_B)
        nxt = x.gather(1, (P + n_B)[:, None])
        got, _ = t.forward(nxt, keep_B=torch.ones(B, dtype=torch.long))
        for b in range(B):
            m = P + int(n_B[b])
            alone = torch.cat([x[b : b + 1, :m], nxt[b : b + 1]], 1)
            want = target(alone, torch.arange(m + 1)[None], AttentionMask("causal")).logits()[:, -1]
            torch.testing.assert_close(got[b, 0], want[0], atol=1e-12, rtol=0)


def test_cached_greedy_equals_recompute_alone_and_in_a_ragged_batch(target):
    prompts = random_prompts(4, seed=3)
    assert len({len(p) for p in prompts}) > 1  # ragged
    N = 24
    cached = decode(target, prompts, N, return_logits=True)
    plain = decode(target, prompts, N, return_logits=True, use_cache=False)
    assert cached.sequences == plain.sequences and all(len(s) == N for s in cached.sequences)
    diff = _finite_diff(cached.logits_BNV, plain.logits_BNV)
    assert diff < 1e-10, diff
    for i, p in enumerate(prompts):  # each row alone: the batch's tokens
        assert decode(target, [p], N).sequences == [cached.sequences[i]]
    c, r = cached.counters, plain.counters
    assert c.nfe == r.nfe == N  # a prefill and N - 1 rounds, both
    # the cache runs each prompt once and one token per row per round; recomputation every row every round
    assert c.query_tokens == 4 * max(len(p) for p in prompts) + 4 * (N - 1) < r.query_tokens
    print(f"hybrid AR batch 4: logits max|diff| {diff:.1e}, query tokens cached {c.query_tokens} "
          f"recompute {r.query_tokens}")  # fmt: skip


def test_cached_sampling_draws_what_recompute_draws(target):
    prompts = random_prompts(4, seed=5)
    for temperature, top_k in ((1.0, None), (0.8, 6)):
        runs = [
            decode(
                target,
                prompts,
                16,
                temperature=temperature,
                top_k=top_k,
                eos_id=3,
                use_cache=use_cache,
                generator=torch.Generator().manual_seed(7),
            )  # fmt: skip
            for use_cache in (True, False)
        ]
        assert runs[0].sequences == runs[1].sequences
        assert runs[0].counters.tokens_committed == runs[1].counters.tokens_committed


@pytest.mark.parametrize("kind", ["replay", "model", "random", "features"])
def test_speculative_decoding_of_the_hybrid_equals_ar(target, kind):
    """Batches of 4 ragged prompts, block 4: rows accept different numbers of drafts each round, so their
    linear layers keep different prefixes of the verification; the tokens are the AR tokens."""
    N, b = 20, 4
    totals = {"accepted": 0, "drafted": 0}
    for i in range(3):
        prompts = random_prompts(4, seed=60 + i)
        ref = decode(target, prompts, N + b)
        if kind == "replay":
            drafter = ReplayDrafter(full_sequences(prompts, ref.sequences, 9 + N + b), b, error=0.3, seed=i)
        elif kind == "model":  # a second hybrid drafts from the tokens it knows
            drafter = ModelDrafter(hybrid(seed=5, layers=2), prompts, b)
        elif kind == "random":
            drafter = RandomDrafter(b, seed=i)
        else:  # reads a linear and the attention layer's outputs of the target
            drafter = FeatureProbeDrafter((0, 3), target.cfg.hidden_size, b, seed=i)
        out = decode(target, prompts, N, drafter=drafter)
        assert out.sequences == [s[:N] for s in ref.sequences], i
        plain = decode(target, prompts, N, drafter=_again(drafter, prompts, ref, i, kind, b, N), use_cache=False)
        assert plain.sequences == out.sequences and plain.counters.accepted == out.counters.accepted
        for k in totals:
            totals[k] += getattr(out.counters, k)
    if kind in ("replay", "model"):
        assert 0 < totals["accepted"] < totals["drafted"], totals
    print(f"hybrid speculative {kind}: accepted {totals['accepted']} of {totals['drafted']} drafts")


def _again(drafter, prompts, ref, i, kind, b, N):
    """A fresh drafter of the same kind and seed (the random ones keep a generator)."""
    if kind == "replay":
        return ReplayDrafter(full_sequences(prompts, ref.sequences, 9 + N + b), b, error=0.3, seed=i)
    if kind == "random":
        return RandomDrafter(b, seed=i)
    return drafter


def test_the_running_batch_decodes_hybrid_requests_as_alone(target):
    """Requests join at different steps (greedy and seeded sampling, EOS on or off), leave, and their rows'
    states move with them: each decodes what a `generate` call of it alone decodes."""
    arrivals = [
        (0, random_prompts(2, seed=1), _cfg(12), None),
        (1, random_prompts(1, seed=2), _cfg(9, temperature=0.9, top_k=5), 12),
        (3, random_prompts(3, seed=3), _cfg(5, eos=False), None),
        (4, random_prompts(2, seed=4), _cfg(15, temperature=1.2, eos=False), 13),
        (9, random_prompts(2, seed=6), _cfg(7), None),
    ]
    engine = Engine(target, SPECIAL, Limits(max_rows=16))
    reqs = _run(engine, arrivals)
    for req, (_, prompts, cfg, seed) in zip(reqs, arrivals, strict=True):
        _same(req, _alone(target, prompts, cfg, seed))
    rows = engine.executor.causal
    assert rows.owner == [] and all(
        layer.recurrent.state is None or layer.recurrent.state.S_BHKV.shape[0] == 0
        for layer in rows.target.cache.layers.values()
    )


def test_a_llama_drafts_for_the_hybrid(target):
    """A drafter of another family (the test vocabulary's llama): lossless all the same."""
    N, b = 16, 3
    prompts = random_prompts(4, seed=70)
    ref = decode(target, prompts, N)
    out = decode(target, prompts, N, drafter=ModelDrafter(causal_model(seed=3, dtype=F64), prompts, b))
    assert out.sequences == ref.sequences


def test_greedy_decoding_equals_transformers_in_a_ragged_batch():
    """The imported random transformers model (float32): our cached causal loop over 4 prompts of different
    lengths in one batch gives transformers' greedy `generate` of each prompt alone (its own recurrent cache),
    and our recomputation the same."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds
    from tests.unit.test_qwen3_5 import V as HF_V
    from tests.unit.test_qwen3_5 import _hf_model, _import

    pytest.importorskip("transformers")
    import tempfile
    from pathlib import Path

    hf = _hf_model()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = _import(Path(tmp))
    prompts = [[5, 17, 33, 2, 60, 41], [7, 8, 9], [70, 3, 1, 9, 12, 44, 30, 2, 8], [11]]
    N = 12
    cfg = SamplerConfig(generation="causal", gen_length=N, temperature=0.0, stop_at_eos=False)
    special = SpecialIds(mask_id=HF_V - 1, pad_id=0, eos_id=HF_V - 2, num_tokens=HF_V)
    got = generate(ours, prompts, cfg, special)
    with torch.no_grad():
        # the causal loop never predicts the mask id (the last one here): neither may transformers
        want = [hf.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                            suppress_tokens=[HF_V - 1])[0, len(p) :] for p in prompts]  # fmt: skip
    assert got.sequences == [w.tolist() for w in want]
    with torch.inference_mode():
        plain = generate(ours, prompts, cfg, special, recompute=True)
    assert plain.sequences == got.sequences
