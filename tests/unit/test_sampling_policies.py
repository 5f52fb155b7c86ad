"""Sampling policies, logit filters, guidance, the reverse processes, callbacks and stops.

The tiny transformer runs in float64 so that greedy decisions do not depend on float rounding
(two runs that should agree add the same numbers, possibly in another order).

Shapes: B batch, R region, L canvas length, V vocabulary, G generated length.
"""

from __future__ import annotations

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.policies import Entropy, Factor, Margin, Proposal, Threshold, make_policy
from dllm.sampling.proposals import filter_logits, full_proposal
from dllm.sampling.results import StepEvent
from tests.unit.test_sampling import FakeModel, prefer

V = 32
SPECIAL = SpecialIds(mask_id=31, pad_id=30, eos_id=29, num_tokens=V)
PROMPTS = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, init_std=0.2, num_layers=2))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.double().eval()


def sampler(**kw) -> SamplerConfig:
    base = {"gen_length": 8, "block_length": 4, "steps": 8, "stop_at_eos": False, "shift": "off"}
    return SamplerConfig(**{**base, **kw})


def proposal(prob_BR: list[list[float]]) -> Proposal:
    """A hand-made proposal: only the probabilities matter to threshold and factor."""
    p = torch.tensor(prob_BR, dtype=torch.float64)
    return Proposal(torch.zeros_like(p, dtype=torch.long), p, p, p)


def random_logits(B: int = 3, R: int = 6, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(B, R, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    logits[..., SPECIAL.mask_id] = float("-inf")  # as generate hands them over
    return logits


# --------------------------------------------------------------------------------------------------
# 7. policy units


def test_margin_scores_are_top1_minus_top2():
    logits = random_logits()
    prop = full_proposal(logits, 0.0, None)
    top = logits.softmax(-1).sort(-1, descending=True).values
    torch.testing.assert_close(prop.margin_BR, top[..., 0] - top[..., 1], rtol=0, atol=1e-12)
    policy = make_policy(sampler(policy="margin"))
    assert isinstance(policy, Margin) and policy.scheduled
    torch.testing.assert_close(policy.scores(prop, None), top[..., 0] - top[..., 1], rtol=0, atol=1e-12)


def test_entropy_scores_are_minus_the_entropy():
    logits = random_logits(seed=1)
    logits[0, 0] = float("-inf")
    logits[0, 0, 4] = 0.0  # a one-hot distribution: entropy 0, the best score, and no NaN from 0 * log 0
    prop = full_proposal(logits, 0.0, None)
    p = logits.softmax(-1)
    expected = (p * p.clamp_min(1e-300).log()).sum(-1)  # = -entropy
    policy = make_policy(sampler(policy="entropy"))
    assert isinstance(policy, Entropy) and policy.scheduled
    scores = policy.scores(prop, None)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-12)
    assert not bool(scores.isnan().any())
    assert float(scores[0, 0]) == 0.0 and float(scores[0, 0]) == float(scores.max())
    # a uniform distribution over the V - 1 possible tokens has the largest entropy
    flat = torch.zeros(1, 1, V, dtype=torch.float64)
    flat[..., SPECIAL.mask_id] = float("-inf")
    flat_prop = full_proposal(flat, 0.0, None)
    torch.testing.assert_close(flat_prop.entropy_BR, torch.tensor([[torch.log(torch.tensor(V - 1.0)).item()]],
                               dtype=torch.float64))  # fmt: skip


def test_threshold_commits_all_above_tau_and_at_least_the_most_confident():
    policy = make_policy(sampler(policy="threshold", threshold=0.5))
    assert isinstance(policy, Threshold) and not policy.scheduled
    prop = proposal(
        [
            [0.9, 0.6, 0.4, 0.95],  # two eligible above tau; the 0.95 is not eligible
            [0.2, 0.3, 0.1, 0.25],  # nothing above tau: the single most confident
            [0.9, 0.8, 0.7, 0.6],  # nothing eligible: nothing
            [0.5, 0.7, 0.1, 0.1],  # p == tau counts as above
        ]
    )
    eligible = torch.tensor(
        [[True, True, True, False], [True, True, True, True], [False] * 4, [True, True, True, True]]
    )
    commit = policy.commit(prop, eligible)
    assert commit.tolist() == [
        [True, True, False, False],
        [False, True, False, False],
        [False, False, False, False],
        [True, True, False, False],
    ]


def test_factor_rule_by_hand():
    policy = make_policy(sampler(policy="factor", factor=1.0))
    assert isinstance(policy, Factor) and not policy.scheduled
    prop = proposal(
        [
            # sorted 0.99, 0.97, 0.9, 0.5: (n+1)(1-p_n) = 0.02, 0.09, 0.4 < 1 but 2.5 >= 1: commit 3
            [0.5, 0.97, 0.99, 0.9],
            # 2 * (1 - 0.4) = 1.2 >= 1 even for n = 1: still commit the most confident one
            [0.3, 0.4, 0.2, 0.1],
            # the 0.999 is not eligible; eligible sorted 0.98, 0.6: 0.04 < 1, 3 * 0.4 = 1.2 >= 1: commit 1
            [0.999, 0.6, 0.98, 0.1],
            # nothing eligible: nothing
            [0.99, 0.99, 0.99, 0.99],
        ]
    )
    eligible = torch.tensor([[True] * 4, [True] * 4, [False, True, True, True], [False] * 4])
    commit = policy.commit(prop, eligible)
    assert commit.tolist() == [
        [False, True, True, True],
        [False, True, False, False],
        [False, False, True, False],
        [False, False, False, False],
    ]


def test_factor_never_commits_more_than_the_eligible_positions():
    # a large factor accepts every n, even the zero-probability padding of ineligible positions
    policy = make_policy(sampler(policy="factor", factor=100.0))
    prop = proposal([[0.3, 0.2, 0.9, 0.1, 0.4]])
    eligible = torch.tensor([[True, False, True, False, False]])
    assert policy.commit(prop, eligible).tolist() == [[True, False, True, False, False]]


# --------------------------------------------------------------------------------------------------
# 8. top-k / top-p


def test_top_k_keeps_exactly_k():
    logits = random_logits(B=4, R=5, seed=2)
    for k in (1, 3, 10):
        out = filter_logits(logits, top_k=k, top_p=None)
        kept = torch.isfinite(out)
        assert bool((kept.sum(-1) == k).all()), k
        # the kept ones are the k largest, unchanged
        top = logits.topk(k, dim=-1).indices
        assert bool(kept.gather(-1, top).all()), k
        assert torch.equal(out[kept], logits[kept])
    assert torch.equal(filter_logits(logits, top_k=V, top_p=None), logits)


def test_top_p_keeps_the_smallest_prefix_with_enough_mass():
    logits = random_logits(B=4, R=5, seed=3)
    probs = logits.softmax(-1)
    for p in (1e-6, 0.3, 0.6, 0.9, 0.999):
        kept = torch.isfinite(filter_logits(logits, top_k=None, top_p=p))
        mass = (probs * kept).sum(-1)
        smallest_kept = torch.where(kept, probs, torch.ones_like(probs)).amin(-1)
        assert bool((mass >= p - 1e-12).all()), p  # enough mass
        assert bool((mass - smallest_kept < p).all()), p  # and no smaller prefix has enough
        largest_dropped = torch.where(kept, torch.zeros_like(probs), probs).amax(-1)
        assert bool((largest_dropped <= smallest_kept).all()), p  # a prefix of the sorted tokens
        argmax = logits.argmax(-1, keepdim=True)
        assert bool(kept.gather(-1, argmax).all()), p  # the most probable token always stays


def test_top_p_by_hand():
    probs = torch.tensor([[0.1, 0.5, 0.05, 0.2, 0.15]], dtype=torch.float64)
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_logits(logits, None, p)).tolist()  # noqa: E731
    assert kept(0.4) == [[False, True, False, False, False]]
    assert kept(0.6) == [[False, True, False, True, False]]
    assert kept(0.8) == [[False, True, False, True, True]]
    assert kept(0.97) == [[True] * 5]


def test_sampling_with_top_k_1_is_greedy(tiny):
    logits = random_logits(B=4, R=8, seed=4)
    sampled = full_proposal(logits, 1.0, torch.Generator().manual_seed(0), top_k=1)
    greedy = full_proposal(logits, 0.0, None)
    assert torch.equal(sampled.tokens_BR, greedy.tokens_BR)
    assert torch.equal(sampled.prob_BR, greedy.prob_BR)
    g = torch.Generator().manual_seed(0)
    hot = generate(tiny, PROMPTS, sampler(temperature=1.0, top_k=1), SPECIAL, generator=g)
    cold = generate(tiny, PROMPTS, sampler(), SPECIAL)
    assert hot.sequences == cold.sequences
    # and sampling without top_k does differ (so the equality above is not vacuous)
    g = torch.Generator().manual_seed(0)
    assert generate(tiny, PROMPTS, sampler(temperature=1.0), SPECIAL, generator=g).sequences != cold.sequences


# --------------------------------------------------------------------------------------------------
# 9. classifier-free guidance

A, B_TOK = 7, 8  # the unguided and the guided favourite


def guidance_model() -> FakeModel:
    """Rows that see the prompt (token 1): A = 2.0, B = 1.5; rows with the prompt masked: A = 2.0, B = 0.
    Guided: B = (1 + w) * 1.5 beats A = 2 exactly when w > 1/3."""

    def fn(tokens, positions):
        logits = torch.zeros(*tokens.shape, V)
        sees_prompt = (tokens == 1).any(-1)
        logits[..., A] = 2.0
        logits[sees_prompt, :, B_TOK] = 1.5
        return logits

    return FakeModel(fn)


def test_guidance_runs_one_batched_call_with_the_prompt_masked():
    prompts = [[1, 2], [3, 1, 4]]
    model = guidance_model()
    cfg = sampler(cfg_scale=0.5)
    res = generate(model, prompts, cfg, SPECIAL)
    assert res.nfe == len(model.calls) == 8
    P = 3
    prompt_BL = torch.zeros(2, P + 8, dtype=torch.bool)
    prompt_BL[0, 1:3] = True
    prompt_BL[1, 0:3] = True
    for call in model.calls:
        assert call.shape == (4, P + 8)
        cond, unc = call[:2], call[2:]
        assert bool((unc[prompt_BL] == SPECIAL.mask_id).all())
        assert torch.equal(unc[~prompt_BL], cond[~prompt_BL])  # generated positions and padding
        assert cond[prompt_BL].tolist() == [1, 2, 3, 1, 4]


@pytest.mark.parametrize(("w", "token"), [(0.0, A), (0.3, A), (0.4, B_TOK), (2.0, B_TOK)])
def test_guided_logits_are_uncond_plus_one_plus_w_times_the_difference(w, token):
    res = generate(guidance_model(), [[1, 2], [3, 1, 4]], sampler(cfg_scale=w), SPECIAL)
    assert res.sequences == [[token] * 8] * 2


# --------------------------------------------------------------------------------------------------
# 10. the reverse processes


def test_ancestral_reuse_is_exact_and_saves_forwards(tiny):
    cfg = sampler(gen_length=8, block_length=4, steps=16, policy="ancestral", temperature=1.0)
    prompts = [[1, 2, 3], [4]]
    fresh = generate(tiny, prompts, cfg.model_copy(update={"reuse_unchanged": False}), SPECIAL,
                     generator=torch.Generator().manual_seed(5))  # fmt: skip
    reused = generate(tiny, prompts, cfg, SPECIAL, generator=torch.Generator().manual_seed(5))
    assert reused.sequences == fresh.sequences
    assert torch.equal(reused.canvas_BL, fresh.canvas_BL)
    assert fresh.counters.reused_forwards == 0 and fresh.counters.nfe == fresh.counters.steps
    assert reused.counters.steps == fresh.counters.steps
    assert 0 < reused.counters.nfe < fresh.counters.nfe
    assert reused.counters.reused_forwards == fresh.counters.nfe - reused.counters.nfe


def test_first_hitting_commits_one_position_per_row_per_step(tiny):
    events: list[torch.Tensor] = []
    cfg = sampler(gen_length=8, block_length=4, steps=4, policy="first_hitting", temperature=1.0)
    res = generate(tiny, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(0),
                   callback=lambda e: events.append(e.committed_BT.clone()))  # fmt: skip
    assert len(events) == res.nfe == 8
    for committed in events:
        assert committed.sum(-1).tolist() == [1] * len(PROMPTS)
    total = torch.stack(events).sum(0)
    gen = torch.zeros_like(total, dtype=torch.bool)
    for i, s in enumerate(res.gen_start_B):
        gen[i, s : s + 8] = True
    assert torch.equal(total, gen.long())  # every generated position exactly once


# --------------------------------------------------------------------------------------------------
# 11. uniform-state decoding


@pytest.mark.parametrize("steps", [8, 4, 2])
def test_uniform_never_shows_a_mask_and_costs_steps_forwards(tiny, steps):
    G, b = 8, 4
    N = steps // (G // b)
    seen: list[StepEvent] = []

    def callback(e: StepEvent) -> None:
        seen.append(StepEvent(e.canvas_BT.clone(), e.committed_BT.clone(), e.block, e.step, e.gen_start_B, e.mask_id))

    cfg = sampler(gen_length=G, block_length=b, steps=steps, policy="uniform", temperature=1.0)
    res = generate(tiny, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(0), callback=callback)
    assert res.nfe == steps == len(seen)
    P = res.gen_start_B[0]  # bidirectional: every row starts generating at the padded prompt length
    for e in seen:
        decoded = e.canvas_BT[:, P : P + (e.block + 1) * b]  # the blocks up to the active one
        assert not bool((decoded == SPECIAL.mask_id).any())
        assert bool((e.canvas_BT >= 0).all() and (e.canvas_BT < SPECIAL.num_tokens).all())
        # the linear schedule keeps floor((step + 1) / N * b) predictions per row
        assert e.committed_BT.sum(-1).tolist() == [(e.step + 1) * b // N] * len(PROMPTS)
    for s in res.sequences:
        assert len(s) == G and SPECIAL.mask_id not in s and all(0 <= t < V for t in s)


def test_uniform_decodes_the_models_favourite():
    res = generate(FakeModel(prefer(7)), PROMPTS, sampler(policy="uniform", steps=4), SPECIAL,
                   generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert res.sequences == [[7] * 8] * len(PROMPTS)
    assert res.nfe == 4


def test_uniform_needs_the_number_of_tokens():
    special = SpecialIds(mask_id=31, pad_id=30, eos_id=29)
    with pytest.raises(ValueError, match="num_tokens"):
        generate(FakeModel(prefer(7)), PROMPTS, sampler(policy="uniform"), special)


# --------------------------------------------------------------------------------------------------
# 12. callback and stop


def test_callback_marks_exactly_the_positions_decoded_at_each_step(tiny):
    events: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []

    def callback(e: StepEvent) -> None:
        assert e.mask_id == SPECIAL.mask_id
        events.append((e.canvas_BT.clone(), e.committed_BT.clone(), e.block, e.step))

    res = generate(tiny, PROMPTS, sampler(policy="threshold", threshold=0.2), SPECIAL, callback=callback)
    assert len(events) == res.counters.steps == res.nfe
    before = res.canvas_BL.clone()
    for i, s in enumerate(res.gen_start_B):
        before[i, s : s + 8] = SPECIAL.mask_id
    for canvas, committed, block, step in events:
        changed = (before == SPECIAL.mask_id) & (canvas != SPECIAL.mask_id)
        assert torch.equal(committed, changed), (block, step)
        assert torch.equal(canvas[~committed], before[~committed])
        before = canvas
    assert torch.equal(before, res.canvas_BL)
    # blocks in order, steps counted from 0 in each block
    assert [(b, s) for _, _, b, s in events] == sorted((b, s) for _, _, b, s in events)
    assert all(s == 0 for i, (_, _, _, s) in enumerate(events) if i == 0 or events[i - 1][2] != events[i][2])


def test_stop_function_ends_generation_early_without_changing_the_output(tiny):
    cfg = sampler(gen_length=16, block_length=4, steps=16)
    prompts = [[1, 2, 3], [4, 5]]
    full = generate(tiny, prompts, cfg, SPECIAL)
    stop_tokens = {full.sequences[0][1], full.sequences[1][2]}  # both rows hit one in block 0
    calls: list[list[int]] = []

    def stop(ids: list[int]) -> bool:
        calls.append(list(ids))
        return bool(stop_tokens & set(ids))

    stopped = generate(tiny, prompts, cfg, SPECIAL, stop=stop)
    assert stopped.nfe == 4 < full.nfe == 16  # one block instead of four
    assert calls and all(isinstance(t, int) for ids in calls for t in ids)
    for out, ref in zip(stopped.sequences, full.sequences, strict=True):
        end = min(ref.index(t) for t in stop_tokens if t in ref)
        assert out[: end + 1] == ref[: end + 1]
        assert SPECIAL.mask_id not in out
    # a stop that never fires changes nothing
    never = generate(tiny, prompts, cfg, SPECIAL, stop=lambda ids: False)
    assert never.sequences == full.sequences and never.nfe == full.nfe


# --------------------------------------------------------------------------------------------------
# 13. EOS


def eos_at_position(pos: int) -> FakeModel:
    """Token 7 everywhere (logit 5), EOS at position `pos` counted from the row's start (logit 10)."""

    def fn(tokens, positions):
        logits = torch.zeros(*tokens.shape, V)
        logits[..., 7] = 5.0
        logits[..., SPECIAL.eos_id] = torch.where(positions == pos, 10.0, 0.0)
        return logits

    return FakeModel(fn)


def test_stop_at_eos_cuts_each_row_and_saves_forwards():
    prompts = [[1, 2, 3], [4]]  # EOS at position 8: generated index 5 and 7
    cfg = sampler(gen_length=16, block_length=4, steps=16, stop_at_eos=True)
    res = generate(eos_at_position(8), prompts, cfg, SPECIAL)
    assert res.sequences == [[7] * 5, [7] * 7]
    # block 0: 4 steps; block 1: EOS first (most confident), then the positions before it in order;
    # row 1 needs 3 more, so the batch ends after 4 steps of block 1
    assert res.nfe == 8 < 16
    assert not bool((res.canvas_BL == SPECIAL.mask_id).any())
    full = generate(eos_at_position(8), prompts, cfg.model_copy(update={"stop_at_eos": False}), SPECIAL)
    assert full.nfe == 16
    assert [s[: s.index(SPECIAL.eos_id)] for s in full.sequences] == res.sequences
