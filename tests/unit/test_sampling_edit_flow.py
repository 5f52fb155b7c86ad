"""Edit Flows tau-leaping: the policy's events, applying them, and the batched loop."""

from __future__ import annotations

import math

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.diffusion.edit_schedule import cumulative_weight
from dllm.models import Transformer
from dllm.models.edit_flow import DELETE, INSERT, SUBSTITUTE
from dllm.sampling.edit_flow import KEEP, RowEdits, TauLeaping, apply_edits, sample_edit_flow

V = 24
ANCHOR, PAD = V - 1, V - 3


def _model(seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, edit_head=True, attention_backend="sdpa"))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.double().eval()


def _sample(model, prompts, seeds, num_steps=6, max_new_tokens=10):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return sample_edit_flow(model, prompts, num_steps=num_steps, anchor_id=ANCHOR, pad_id=PAD, num_tokens=V - 3,
                            max_new_tokens=max_new_tokens, generators=gens)  # fmt: skip


def test_zero_rates_step_is_the_identity():
    logp = torch.log_softmax(torch.randn(5, V, dtype=torch.float64), -1)
    edits = TauLeaping(2).step(torch.zeros(5, 3), logp, logp, torch.Generator().manual_seed(0), float("inf"))
    assert (edits.kind_N == KEEP).all()
    assert apply_edits([3, 4, 5, 6], edits, max_completion=10) == [3, 4, 5, 6]


def test_zero_rates_through_the_loop_leave_the_prompt_and_an_empty_completion():
    model = _model()
    with torch.no_grad():
        model.edit_head.rate_proj.weight.zero_()
        model.edit_head.rate_proj.bias.fill_(-1e4)  # softplus underflows to exactly 0
    out = _sample(model, [[1, 2], [3]], [0, 1])
    assert out.completions == [[], []] and out.nfe == 6 and out.edits_per_step == [0] * 6


def test_apply_edits_by_hand():
    # events: after the prefix insert 9; delete 3; substitute 4 by 8; keep 5
    edits = RowEdits(torch.tensor([INSERT, DELETE, SUBSTITUTE, KEEP]), torch.tensor([9, 0, 8, 0]))
    assert apply_edits([3, 4, 5], edits, max_completion=10) == [9, 8, 5]
    ins = RowEdits(torch.tensor([INSERT, INSERT, INSERT, INSERT]), torch.tensor([9, 8, 7, 6]))
    assert apply_edits([3, 4, 5], ins, max_completion=5) == [9, 3, 8, 4, 5]  # room for two insertions


def test_prefix_token_never_deletes_or_substitutes():
    logp = torch.log_softmax(torch.randn(3, V, dtype=torch.float64), -1)
    rates = torch.tensor([[0.0, 50.0, 50.0], [0.0, 50.0, 0.0], [0.0, 0.0, 50.0]])
    edits = TauLeaping(1).step(rates, logp, logp, torch.Generator().manual_seed(0), 1.0)
    assert edits.kind_N.tolist() == [KEEP, DELETE, SUBSTITUTE]


def test_batched_sampling_equals_per_row_with_fixed_seeds():
    model = _model(1)
    prompts, seeds = [[1, 2, 3], [], [4, 5]], [11, 12, 13]
    batched = _sample(model, prompts, seeds)
    rows = [_sample(model, [p], [s]) for p, s in zip(prompts, seeds, strict=True)]
    assert batched.completions == [r.completions[0] for r in rows]
    assert batched.edits_per_step == [sum(e) for e in zip(*(r.edits_per_step for r in rows), strict=True)]
    assert batched.nfe == 6 and sum(batched.edits_per_step) > 0
    assert all(len(c) <= 10 for c in batched.completions)
    assert all(0 <= t < V - 3 for c in batched.completions for t in c)


@pytest.mark.parametrize("kappa", ["cubic", "linear"])
def test_fire_probability_is_the_integral_of_the_weight_over_the_step(kappa):
    """A position with intensity lambda fires in step [t, t + h] with probability 1 - exp(-(K(t+h) - K(t)) lambda),
    K = -log(1 - kappa): checked on the formula and on the frequency of events over many positions."""
    policy = TauLeaping(4, kappa, end_time=1.0, grid="time")
    h = 0.25
    for step in range(3):
        assert policy.weight(step) == pytest.approx(
            cumulative_weight(kappa, (step + 1) * h) - cumulative_weight(kappa, step * h)
        )
    assert policy.weight(3) == float("inf")  # the exact last step: every intensity left fires
    assert TauLeaping(4, kappa, end_time=0.999, grid="time").weight(3) == pytest.approx(
        cumulative_weight(kappa, 0.999) - cumulative_weight(kappa, 0.75 * 0.999)
    )
    equal = TauLeaping(4, kappa, end_time=0.999)  # the default grid: equal shares of K(end_time)
    assert equal.times[0] == 0.0 and equal.times[-1] == 0.999 and equal.times == sorted(equal.times)
    for step in range(4):
        assert equal.weight(step) == pytest.approx(cumulative_weight(kappa, 0.999) / 4)
        k_t, k_s = (cumulative_weight(kappa, equal.times[step + d]) for d in (0, 1))
        assert equal.weight(step) == pytest.approx(k_s - k_t)
    N, lam = 40000, 0.7
    logp = torch.log_softmax(torch.zeros(N, V, dtype=torch.float64), -1)
    rates = torch.tensor([[0.2, 0.3, 0.2]], dtype=torch.float64).expand(N, 3)
    for step in (1, 2, 3):
        weight = policy.weight(step)
        expected = 1.0 - math.exp(-weight * lam)
        assert float(TauLeaping.fire_probability(weight, torch.tensor([lam]))) == pytest.approx(expected)
        edits = policy.step(rates, logp, logp, torch.Generator().manual_seed(step), weight)
        freq = float((edits.kind_N[1:] != KEEP).double().mean())
        sigma = max(math.sqrt(expected * (1 - expected) / N), 1e-9)
        assert abs(freq - expected) < 5 * sigma + 1e-12, (step, freq, expected)
    assert float(TauLeaping.fire_probability(float("inf"), torch.tensor([0.0]))) == 0.0


def test_generate_runs_edit_flows_in_its_loop_with_the_step_callback():
    """generate() on an edit-flow sampler: one event per step, its edits add up to the counters, the last
    canvas is the result's, and committed marks only generated positions."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    model = _model(2)
    cfg = SamplerConfig(generation="edit_flow", steps=5, gen_length=8, shift="off", attention="bidirectional",
                        edit_kappa="linear", edit_end_time=0.999, temperature=1.0, stop_at_eos=False)  # fmt: skip
    events = []
    res = generate(model, [[1, 2, 3], [4]], cfg, SpecialIds(ANCHOR, PAD, V - 2, V - 3),
                   generator=torch.Generator().manual_seed(0), callback=lambda e: events.append(e))  # fmt: skip
    assert len(events) == 5 == res.nfe == res.counters.steps
    assert sum(e.edits for e in events) == res.counters.edits > 0
    assert torch.equal(events[-1].canvas_BT, res.canvas_BL) and res.gen_start_B == [4, 2]
    for e in events:
        for b, start in enumerate(e.gen_start_B):
            assert not e.committed_BT[b, :start].any()
    last = events[-1].canvas_BT.tolist()
    assert [row[s : s + len(seq)] for row, s, seq in zip(last, res.gen_start_B, res.sequences, strict=True)] == [
        list(seq) for seq in res.sequences
    ]
