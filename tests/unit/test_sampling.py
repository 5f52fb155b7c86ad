"""Sampling: policies, the commit schedule and the generate loop (with a tiny model and fake models).

Shapes: B batch, L canvas length, V vocabulary, P prompt length, G generated length.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dllm.config.model import ModelConfig
from dllm.config.registries import POLICIES
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds, left_pad
from dllm.sampling.policies import LowConfidence, Proposal, RandomOrder, select_topk
from dllm.sampling.proposals import commit_schedule, propose
from tests.helpers import output_of_logits

V = 32
SPECIAL = SpecialIds(mask_id=31, pad_id=30, eos_id=29)


# --------------------------------------------------------------------------------------------------
# fake models


class FakeModel(nn.Module):
    """Deterministic logits from a function of (tokens, positions); records the canvases it sees."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))  # generate() reads the device from a parameter
        self.fn = fn
        self.calls: list[torch.Tensor] = []

    def forward(self, tokens_BL, positions_BL, mask=None):
        self.calls.append(tokens_BL.clone())
        return output_of_logits(self.fn(tokens_BL, positions_BL))


def position_table_model(seed: int = 0) -> FakeModel:
    """Logits depend on the absolute position only (a fixed random table)."""
    table = torch.randn(256, V, generator=torch.Generator().manual_seed(seed)) * 3

    def fn(tokens, positions):
        return table[positions].clone()

    return FakeModel(fn)


def prefer(token_B_L_or_int, strength: float = 10.0):
    def fn(tokens, positions):
        logits = torch.zeros(*tokens.shape, V)
        logits[..., token_B_L_or_int] = strength
        return logits

    return fn


def tiny_transformer(seed: int = 0) -> Transformer:
    cfg = ModelConfig(preset="tiny", vocab_size=V, init_std=0.1, num_layers=1)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    return tiny_transformer()


def sampler(**kw) -> SamplerConfig:
    base = {"gen_length": 8, "block_length": 8, "steps": 8, "stop_at_eos": False, "shift": "off"}
    return SamplerConfig(**{**base, **kw})


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


# --------------------------------------------------------------------------------------------------
# policies and select_topk


def test_policies_registered():
    assert POLICIES.resolve("low_confidence") is LowConfidence
    assert POLICIES.resolve("random") is RandomOrder


def as_proposal(p: torch.Tensor) -> Proposal:
    return Proposal(torch.zeros_like(p, dtype=torch.long), p, p, p)


def test_low_confidence_scores_are_the_probabilities():
    p = torch.rand(3, 5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(LowConfidence().scores(as_proposal(p), None), p)


def test_random_scores_reproducible_with_generator():
    p = as_proposal(torch.rand(3, 5))
    a = RandomOrder().scores(p, torch.Generator().manual_seed(1))
    b = RandomOrder().scores(p, torch.Generator().manual_seed(1))
    c = RandomOrder().scores(p, torch.Generator().manual_seed(2))
    assert a.shape == p.prob_BR.shape and torch.equal(a, b) and not torch.equal(a, c)


def test_select_topk_picks_k_highest_eligible():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        B, L = 4, 12
        scores = torch.rand(B, L, generator=g)
        eligible = torch.rand(B, L, generator=g) < 0.6
        eligible[:, 0] = True
        n_elig = eligible.sum(-1)
        k = (torch.rand(B, generator=g) * (n_elig + 1).float()).long().clamp(max=n_elig)
        sel = select_topk(scores, eligible, k)
        assert sel.dtype == torch.bool and sel.shape == (B, L)
        assert not bool((sel & ~eligible).any()), trial
        assert torch.equal(sel.sum(-1), k), trial
        for b in range(B):
            chosen = scores[b][sel[b]]
            rest = scores[b][eligible[b] & ~sel[b]]
            if len(chosen) and len(rest):
                assert float(chosen.min()) >= float(rest.max())
            # ineligible high scores never win
            expect = sorted(scores[b][eligible[b]].tolist(), reverse=True)[: int(k[b])]
            assert sorted(chosen.tolist(), reverse=True) == expect


def test_select_topk_ignores_high_scores_of_ineligible_positions():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.2, 0.95]])
    eligible = torch.tensor([[False, True, True, True, False]])
    sel = select_topk(scores, eligible, torch.tensor([2]))
    assert sel.tolist() == [[False, True, False, True, False]]


def test_select_topk_k_zero_and_k_too_large():
    scores = torch.rand(2, 6)
    eligible = torch.tensor([[True, False, True, False, True, False], [False] * 6])
    assert not bool(select_topk(scores, eligible, torch.tensor([0, 0])).any())
    sel = select_topk(scores, eligible, torch.tensor([10, 3]))
    assert torch.equal(sel, eligible)


def test_select_topk_ties_are_broken_by_position():
    scores = torch.full((1, 5), 0.5)
    eligible = torch.ones(1, 5, dtype=torch.bool)
    assert select_topk(scores, eligible, torch.tensor([2])).tolist() == [[True, True, False, False, False]]


def test_select_topk_commits_k_even_with_minus_inf_scores():
    scores = torch.tensor([[0.5, float("-inf")], [float("-inf"), 0.3]])
    eligible = torch.tensor([[False, True], [True, False]])
    sel = select_topk(scores, eligible, torch.tensor([1, 1]))
    assert sel.tolist() == [[False, True], [True, False]]


def test_select_topk_float_scores_of_other_dtypes():
    scores = torch.tensor([[0.1, 0.7, 0.3]], dtype=torch.bfloat16)
    sel = select_topk(scores, torch.ones(1, 3, dtype=torch.bool), torch.tensor([1]))
    assert sel.tolist() == [[False, True, False]]


# --------------------------------------------------------------------------------------------------
# commit schedule, propose, left_pad


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 8, 13])
def test_commit_schedule_even_split(steps):
    counts = torch.tensor([0, 1, 7, 8, 13, 40])
    sched = commit_schedule(counts, steps)
    assert sched.shape == (6, steps) and sched.dtype == counts.dtype
    assert torch.equal(sched.sum(-1), counts)
    assert bool(((sched.max(-1).values - sched.min(-1).values) <= 1).all())
    assert bool((sched >= 0).all())
    # the remainder goes to the first steps
    assert bool((sched[:, :-1] >= sched[:, 1:]).all())


def test_propose_greedy_and_probability():
    logits = torch.tensor([[[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]]])
    x0, p = propose(logits, 0.0, None)
    assert x0.tolist() == [[1, 0]]
    torch.testing.assert_close(p, torch.softmax(logits.double(), -1).amax(-1))
    assert p.dtype == torch.float64


def test_propose_temperature_reproducible_and_distributed():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(1, 20000, 3)
    a, pa = propose(logits, 1.0, torch.Generator().manual_seed(0))
    b, _ = propose(logits, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(a, b)
    freq = torch.bincount(a.flatten(), minlength=3).double() / a.numel()
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64), atol=0.02, rtol=0)
    # the reported probability is the model's probability of the proposed token
    torch.testing.assert_close(pa, torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)[a])


def test_left_pad():
    ids, valid = left_pad([[1, 2], [3, 4, 5], []], pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 0]]
    assert valid.tolist() == [[False, True, True], [True, True, True], [False, False, False]]


# --------------------------------------------------------------------------------------------------
# generate


LAYOUTS = [  # (gen_length, block_length, steps)
    (8, 8, 8),
    (8, 4, 4),
    (8, 2, 8),
    (6, 3, 2),
    (8, 8, 3),  # several tokens per step, uneven
    (4, 4, 8),  # more steps than tokens: some steps commit nothing
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "g{}b{}s{}".format(*x))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("policy", ["low_confidence", "random"])
def test_generate_never_returns_mask_and_counts_nfe(tiny, policy, temperature, layout):
    G, blk, steps = layout
    cfg = sampler(gen_length=G, block_length=blk, steps=steps, policy=policy, temperature=temperature)
    fakes = [position_table_model(), FakeModel(prefer(SPECIAL.mask_id, 100.0))]
    for model in [tiny, *fakes]:
        res = generate(model, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(0))
        P = max(map(len, PROMPTS))
        assert res.canvas_BL.shape == (3, P + G)
        assert not bool((res.canvas_BL == SPECIAL.mask_id).any())
        assert all(SPECIAL.mask_id not in s for s in res.sequences)
        assert [len(s) for s in res.sequences] == [G] * 3
        # a block stops once it has no mask: a step that could commit nothing costs no forward
        nfe = (G // blk) * min(steps // (G // blk), blk)
        assert res.nfe == nfe
        assert res.tokens_committed == 3 * G
        assert res.tokens_per_forward == pytest.approx(3 * G / nfe)
        # the prompt part of the canvas is untouched
        prompt_ids, _ = left_pad(PROMPTS, SPECIAL.pad_id, torch.device("cpu"))
        assert torch.equal(res.canvas_BL[:, :P], prompt_ids)
        assert res.sequences == res.canvas_BL[:, P:].tolist()
        if isinstance(model, FakeModel):
            assert len(model.calls) == nfe


def test_generate_blocks_are_decoded_left_to_right():
    model = position_table_model()
    cfg = sampler(gen_length=8, block_length=4, steps=4)
    generate(model, [[1, 2]], cfg, SPECIAL)
    masked_per_call = [(c[0, 2:] == SPECIAL.mask_id).tolist() for c in model.calls]
    # calls 0, 1 decode block 0 (block 1 stays masked); calls 2, 3 decode block 1 (block 0 done)
    for i in (0, 1):
        assert all(masked_per_call[i][4:])
    for i in (2, 3):
        assert not any(masked_per_call[i][:4])
    # two commits per call
    assert [sum(m) for m in masked_per_call] == [8, 6, 4, 2]


def test_generate_positions_and_padding_mask_passed_to_model():
    seen = {}

    def fn(tokens, positions):
        seen["positions"] = positions.clone()
        return torch.zeros(*tokens.shape, V)

    model = FakeModel(fn)

    class Spy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, tokens, positions, mask):
            seen["mask"] = mask
            return self.inner(tokens, positions, mask)

    generate(Spy(), [[1, 2], [3, 4, 5, 6]], sampler(gen_length=4, block_length=4, steps=1), SPECIAL)
    assert seen["positions"].tolist() == [[0, 0, 0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7]]
    mask = seen["mask"]
    assert mask.kind == "bidirectional"
    assert mask.key_valid_BL.tolist() == [[False, False] + [True] * 6, [True] * 8]
    # no padding: no mask to build
    generate(Spy(), [[1, 2], [3, 4]], sampler(gen_length=4, block_length=4, steps=1), SPECIAL)
    assert seen["mask"].is_plain


def test_low_confidence_commits_most_probable_position_first():
    heights = torch.tensor([1.0, 4.0, 2.0, 3.0])  # per generated position: peak logit of token 10 + j

    def fn(tokens, positions):
        B, L = tokens.shape
        logits = torch.zeros(B, L, V)
        P = L - 4
        for j in range(4):
            logits[:, P + j, 10 + j] = heights[j]
        return logits

    model = FakeModel(fn)
    res = generate(model, [[1, 2, 3]], sampler(gen_length=4, block_length=4, steps=4), SPECIAL)
    assert res.sequences == [[10, 11, 12, 13]]
    unmasked = [(c[0, 3:] != SPECIAL.mask_id).nonzero().flatten().tolist() for c in model.calls]
    assert unmasked == [[], [1], [1, 3], [1, 2, 3]]


def test_mask_logit_is_never_proposed():
    model = FakeModel(prefer(SPECIAL.mask_id, 1e4))
    res = generate(model, [[1]], sampler(gen_length=4, block_length=4, steps=2), SPECIAL)
    assert SPECIAL.mask_id not in res.sequences[0]


def test_stop_at_eos_false_keeps_full_length_and_nfe():
    model = FakeModel(prefer(SPECIAL.eos_id))
    res = generate(model, PROMPTS, sampler(gen_length=8, block_length=2, steps=8), SPECIAL)
    assert res.nfe == 8
    assert res.sequences == [[SPECIAL.eos_id] * 8] * 3


def test_stop_at_eos_stops_once_every_row_has_ended():
    """The first step commits EOS at the first generated position of every row: nothing before it
    is undecided, so the loop stops after one model call."""
    model = FakeModel(prefer(SPECIAL.eos_id))
    cfg = sampler(gen_length=8, block_length=2, steps=8, stop_at_eos=True)
    res = generate(model, PROMPTS, cfg, SPECIAL)
    assert res.nfe == 1 == len(model.calls)
    assert res.sequences == [[], [], []]
    P = max(map(len, PROMPTS))
    assert bool((res.canvas_BL[:, P:] == SPECIAL.eos_id).all())
    assert res.tokens_committed == 3 * 1


def test_stop_at_eos_waits_for_every_row():
    """Only rows whose prompt contains token 1 prefer EOS: the others never end, so no early stop."""

    def fn(tokens, positions):
        logits = torch.zeros(*tokens.shape, V)
        ends = (tokens == 1).any(-1)
        logits[ends, :, SPECIAL.eos_id] = 10.0
        logits[~ends, :, 5] = 10.0
        return logits

    model = FakeModel(fn)
    cfg = sampler(gen_length=8, block_length=2, steps=8, stop_at_eos=True)
    res = generate(model, [[1, 2], [3, 4]], cfg, SPECIAL)
    assert res.nfe == 8
    assert res.sequences == [[], [5] * 8]


def test_sequences_truncated_at_first_eos_per_row():
    """EOS is preferred at absolute position 5 only: generated index 5 - prompt length."""

    def fn(tokens, positions):
        logits = torch.zeros(*tokens.shape, V)
        logits[..., 7] = 5.0
        logits[..., SPECIAL.eos_id] = torch.where(positions == 5, 10.0, 0.0)
        return logits

    cfg = sampler(gen_length=8, block_length=8, steps=8, stop_at_eos=True)
    res = generate(FakeModel(fn), [[1, 2], [3, 4, 5]], cfg, SPECIAL)
    assert res.sequences == [[7, 7, 7], [7, 7]]
    assert res.canvas_BL[0, 3 + 3].item() == SPECIAL.eos_id  # P = 3; row 0 prompt at 1..2
    # EOS is the most confident everywhere it is proposed, so both rows end early; what follows
    # the first EOS is filled with EOS rather than decoded (it is cut from the output anyway)
    assert res.nfe < 8
    assert not bool((res.canvas_BL == SPECIAL.mask_id).any())
    # without stop_at_eos nothing is cut
    res2 = generate(FakeModel(fn), [[1, 2], [3, 4, 5]], sampler(), SPECIAL)
    assert [len(s) for s in res2.sequences] == [8, 8]


@pytest.mark.parametrize("layout", [(8, 8, 8), (8, 4, 4), (8, 2, 8)], ids=str)
@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_greedy_batched_equals_each_prompt_alone(tiny, layout, stop_at_eos):
    G, blk, steps = layout
    cfg = sampler(gen_length=G, block_length=blk, steps=steps, stop_at_eos=stop_at_eos)
    special = SpecialIds(mask_id=31, pad_id=30, eos_id=8)  # a token the tiny model produces in some rows
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14], [15, 16, 17, 18]]
    batched = generate(tiny, prompts, cfg, special)
    for i, p in enumerate(prompts):
        alone = generate(tiny, [p], cfg, special)
        assert alone.sequences[0] == batched.sequences[i], i
        if not stop_at_eos:
            assert torch.equal(alone.canvas_BL[0], batched.canvas_BL[i, -(len(p) + G) :]), i


@pytest.mark.parametrize("policy", ["low_confidence", "random"])
def test_temperature_sampling_reproducible_with_generator(tiny, policy):
    cfg = sampler(temperature=0.8, policy=policy, gen_length=16, block_length=8, steps=8)
    outs = [
        generate(tiny, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(s)).sequences for s in (0, 0, 1)
    ]
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_greedy_is_deterministic_without_generator(tiny):
    cfg = sampler()
    torch.manual_seed(0)
    a = generate(tiny, PROMPTS, cfg, SPECIAL).sequences
    torch.manual_seed(1)
    b = generate(tiny, PROMPTS, cfg, SPECIAL).sequences
    assert a == b


def test_generate_does_not_touch_global_rng_with_generator(tiny):
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    cfg = sampler(temperature=1.0, policy="random")
    generate(tiny, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(torch.rand(2), expected)


def test_generate_does_not_modify_model_output():
    fixed = torch.zeros(1, 1, V)
    fixed[..., 7] = 3.0

    def fn(tokens, positions):
        return fixed.expand(*tokens.shape, V)

    res = generate(FakeModel(fn), [[1, 2]], sampler(gen_length=4, block_length=4, steps=4), SPECIAL)
    assert res.sequences == [[7, 7, 7, 7]]
    assert float(fixed[0, 0, SPECIAL.mask_id]) == 0.0


def test_policy_and_temperature_grid_with_stop_at_eos(tiny):
    """With stop_at_eos the NFE is a whole number of blocks and never exceeds steps."""
    special = SpecialIds(mask_id=31, pad_id=30, eos_id=23)  # the tiny model's favourite token
    for policy, temperature in itertools.product(["low_confidence", "random"], [0.0, 0.8]):
        cfg = sampler(block_length=2, policy=policy, temperature=temperature, stop_at_eos=True)
        res = generate(tiny, PROMPTS, cfg, special, generator=torch.Generator().manual_seed(0))
        assert res.nfe <= 8 and res.nfe % 2 == 0
        assert not bool((res.canvas_BL == special.mask_id).any())
        for s in res.sequences:
            assert special.eos_id not in s and special.mask_id not in s


def test_stop_at_eos_stops_inside_a_single_block():
    model = FakeModel(prefer(SPECIAL.eos_id))
    cfg = sampler(gen_length=8, block_length=8, steps=8, stop_at_eos=True)
    res = generate(model, PROMPTS, cfg, SPECIAL)
    assert res.sequences == [[], [], []]
    # after the first call every row has committed EOS as its first generated token
    assert res.nfe == 1


def test_generated_canvas_can_enter_autograd():
    """The loop runs under inference_mode; its returned canvas is an ordinary tensor, so it can be
    trained on (an inference tensor would fail in the embedding's backward)."""
    model = tiny_transformer()
    res = generate(model, PROMPTS, sampler(), SPECIAL)
    assert not res.canvas_BL.is_inference()
    model.train()
    positions = torch.arange(res.canvas_BL.shape[1]).expand_as(res.canvas_BL)
    model(res.canvas_BL, positions).logits().logsumexp(-1).sum().backward()
    assert model.embed_tokens.weight.grad is not None
