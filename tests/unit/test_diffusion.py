"""Diffusion: noise schedules, keyed noise and masking, and the MDLM objective.

Shapes: B batch, L sequence, V vocabulary, N selected (masked) positions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dllm.config.objectives import MDLMConfig
from dllm.config.registries import OBJECTIVES, SCHEDULES
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, mask_tokens
from dllm.diffusion.objectives import ModelInputs, TokenIds
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.diffusion.schedules import CosineSchedule, LinearSchedule
from dllm.seeding import mix_key
from tests.helpers import output_of_logits

V = 12
MASK_ID = V - 1


def make_batch(B: int, L: int, first_id: int = 0, seed: int = 0, supervised: float = 0.7) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MASK_ID, (B, L), generator=g)  # never the mask id
    loss_mask = torch.rand(B, L, generator=g) < supervised
    return Batch(tokens, loss_mask, torch.arange(first_id, first_id + B, dtype=torch.int64))


def objective(schedule: str = "linear", **kw) -> MDLMObjective:
    return MDLMObjective(MDLMConfig(schedule=schedule, **kw), TokenIds(MASK_ID, MASK_ID - 1, MASK_ID - 2, V))


def take(batch: Batch, sl: slice) -> Batch:
    return Batch(batch.tokens_BL[sl], batch.loss_mask_BL[sl], batch.sample_ids_B[sl])


# --------------------------------------------------------------------------------------------------
# schedules


SCHEDULE_CLASSES = {"linear": LinearSchedule, "cosine": CosineSchedule}


def test_schedules_registered():
    assert set(SCHEDULES.names()) >= set(SCHEDULE_CLASSES)
    for name, cls in SCHEDULE_CLASSES.items():
        assert SCHEDULES.resolve(name) is cls


@pytest.mark.parametrize("name", sorted(SCHEDULE_CLASSES))
def test_schedule_endpoints_and_monotone(name):
    s = SCHEDULE_CLASSES[name]()
    t = torch.linspace(0, 1, 101, dtype=torch.float64)
    a = s.alpha(t)
    assert float(a[0]) == pytest.approx(1.0, abs=1e-12)
    assert float(a[-1]) == pytest.approx(0.0, abs=1e-12)
    assert bool((a[1:] < a[:-1]).all()), "alpha decreases strictly"
    assert bool(((a >= 0) & (a <= 1)).all())


@pytest.mark.parametrize("name", sorted(SCHEDULE_CLASSES))
def test_schedule_weight_is_elbo_weight_autograd(name):
    """w(t) = -alpha'(t) / (1 - alpha(t))."""
    s = SCHEDULE_CLASSES[name]()
    t = torch.linspace(0.01, 0.99, 50, dtype=torch.float64, requires_grad=True)
    a = s.alpha(t)
    (da,) = torch.autograd.grad(a.sum(), t)
    expected = -da / (1 - a.detach())
    torch.testing.assert_close(s.weight(t.detach()), expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", sorted(SCHEDULE_CLASSES))
def test_schedule_weight_is_elbo_weight_finite_differences(name):
    s = SCHEDULE_CLASSES[name]()
    h = 1e-6
    for t0 in (0.05, 0.2, 0.5, 0.8, 0.95):
        t = torch.tensor(t0, dtype=torch.float64)
        da = (s.alpha(t + h) - s.alpha(t - h)) / (2 * h)
        expected = float(-da / (1 - s.alpha(t)))
        assert float(s.weight(t)) == pytest.approx(expected, rel=1e-6)


def test_linear_and_cosine_closed_forms():
    t = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    torch.testing.assert_close(LinearSchedule().weight(t), 1 / t)
    torch.testing.assert_close(LinearSchedule().alpha(t), 1 - t)
    torch.testing.assert_close(CosineSchedule().weight(t), math.pi / 2 * torch.tan(math.pi / 2 * (1 - t)))


# --------------------------------------------------------------------------------------------------
# keyed noise


def test_mix_key_stable_and_63_bit():
    assert mix_key(1, 2, 3) == mix_key(1, 2, 3)
    keys = {mix_key(0, p, i) for p in range(3) for i in range(100)}
    assert len(keys) == 300
    assert all(0 <= k < 2**63 for k in keys)
    assert mix_key(1, 2) != mix_key(2, 1)


def test_uniform_same_key_same_noise_regardless_of_batch():
    nk = NoiseKeys(seed=5, group_size=4)
    whole = nk.uniform(torch.tensor([3, 9, 4, 7]), (6,), "p")
    assert whole.shape == (4, 6) and whole.dtype == torch.float32
    assert bool(((whole >= 0) & (whole < 1)).all())
    reordered = nk.uniform(torch.tensor([7, 4, 3]), (6,), "p")
    torch.testing.assert_close(reordered, whole[[3, 2, 0]], atol=0, rtol=0)
    alone = nk.uniform(torch.tensor([9]), (6,), "p")
    torch.testing.assert_close(alone, whole[1:2], atol=0, rtol=0)
    # a fresh NoiseKeys with the same seed gives the same noise (no hidden state)
    again = NoiseKeys(seed=5, group_size=99).uniform(torch.tensor([3, 9, 4, 7]), (6,), "p")
    torch.testing.assert_close(again, whole, atol=0, rtol=0)


def test_uniform_differs_across_ids_purposes_seeds():
    ids = torch.tensor([0, 1, 2])
    a = NoiseKeys(0, 4).uniform(ids, (16,), "x")
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])
    assert not torch.equal(a, NoiseKeys(0, 4).uniform(ids, (16,), "y"))
    assert not torch.equal(a, NoiseKeys(1, 4).uniform(ids, (16,), "x"))


def test_uniform_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    NoiseKeys(0, 4).uniform(torch.arange(5), (10,), "x")
    torch.testing.assert_close(torch.rand(3), expected)


@pytest.mark.parametrize("G", [1, 3, 8])
def test_stratified_time_antithetic_one_per_stratum(G):
    nk = NoiseKeys(seed=11, group_size=G)
    for group in range(4):
        ids = torch.arange(group * G, (group + 1) * G)
        t = nk.stratified_time(ids, "t", antithetic=True)
        assert t.shape == (G,)
        assert bool(((t >= 0) & (t < 1)).all())
        s = t.double().sort().values
        gaps = torch.cat([s[1:] - s[:-1], (1 + s[0] - s[-1]).reshape(1)])
        torch.testing.assert_close(gaps, torch.full((G,), 1.0 / G, dtype=torch.float64), atol=1e-6, rtol=0)
        # exactly one value per stratum [j/G, (j+1)/G) after removing the common offset
        offset = float(s[0])
        strata = torch.floor(((t.double() - offset) % 1.0) * G + 1e-4).long()
        assert sorted(strata.tolist()) == list(range(G))


def test_stratified_time_is_keyed_per_sample():
    nk = NoiseKeys(seed=2, group_size=8)
    ids = torch.arange(16, 24)
    whole = nk.stratified_time(ids, "t", antithetic=True)
    halves = torch.cat([nk.stratified_time(ids[:4], "t", True), nk.stratified_time(ids[4:], "t", True)])
    torch.testing.assert_close(halves, whole, atol=0, rtol=0)
    shuffled = nk.stratified_time(ids[[5, 0, 7]], "t", True)
    torch.testing.assert_close(shuffled, whole[[5, 0, 7]], atol=0, rtol=0)
    # groups get different offsets
    other = nk.stratified_time(torch.arange(24, 32), "t", True)
    assert not torch.allclose(other.sort().values, whole.sort().values)


def test_stratified_time_plain_is_uniform_per_sample():
    nk = NoiseKeys(seed=2, group_size=8)
    ids = torch.arange(10)
    t = nk.stratified_time(ids, "t", antithetic=False)
    torch.testing.assert_close(t, nk.uniform(ids, (), "t"), atol=0, rtol=0)
    assert t.shape == (10,)


def test_mask_tokens_only_eligible_and_exact_rule():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10, (3, 50), generator=g)
    eligible = torch.rand(3, 50, generator=g) < 0.5
    u = torch.rand(3, 50, generator=g)
    p = torch.tensor([0.0, 0.4, 1.0])
    noised, masked = mask_tokens(tokens, eligible, p, u, mask_id=99)
    assert masked.dtype == torch.bool
    assert torch.equal(masked, (u < p[:, None]) & eligible)
    assert not bool(masked[~eligible].any())
    assert not bool(masked[0].any())
    assert torch.equal(masked[2], eligible[2])
    assert bool((noised[masked] == 99).all())
    assert torch.equal(noised[~masked], tokens[~masked])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.85])
def test_mask_tokens_empirical_rate(p):
    nk = NoiseKeys(seed=0, group_size=1)
    B, L = 4, 5000
    u = nk.uniform(torch.arange(B), (L,), "m")
    tokens = torch.zeros(B, L, dtype=torch.long)
    eligible = torch.ones(B, L, dtype=torch.bool)
    eligible[:, ::2] = False  # half the positions are not eligible
    _, masked = mask_tokens(tokens, eligible, torch.full((B,), p), u, mask_id=1)
    rate = masked[eligible.expand(B, L)].float().mean().item()
    sd = math.sqrt(p * (1 - p) / (B * L / 2))
    assert abs(rate - p) < 5 * sd


# --------------------------------------------------------------------------------------------------
# MDLM objective: prepare


def test_objective_registered():
    assert OBJECTIVES.resolve("mdlm") is MDLMObjective


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_prepare_masks_only_supervised_positions(schedule):
    obj = objective(schedule)
    batch = make_batch(16, 32, supervised=0.5)
    inp = obj.prepare(batch, NoiseKeys(0, 16))
    masked = inp.tokens_BL == MASK_ID
    assert not bool(masked[~batch.loss_mask_BL].any())
    assert torch.equal(inp.tokens_BL[~masked], batch.tokens_BL[~masked])
    assert torch.equal(inp.targets_BL, batch.tokens_BL)
    assert bool(masked.any()), "some tokens get masked"
    assert inp.mask.kind == "bidirectional" and inp.mask.is_plain
    assert torch.equal(inp.positions_BL, torch.arange(32).expand(16, 32))
    assert inp.weights_BL.shape == (16, 32) and inp.weights_BL.dtype == torch.float32


def test_prepare_weights_linear_are_one_over_t():
    obj = objective("linear")
    batch = make_batch(16, 32)
    noise = NoiseKeys(3, 16)
    inp = obj.prepare(batch, noise)
    t = obj.sample_time(batch, noise)
    masked = inp.tokens_BL == MASK_ID
    expected = torch.where(masked, (1.0 / t)[:, None].expand(16, 32), torch.zeros(16, 32))
    torch.testing.assert_close(inp.weights_BL, expected, atol=0, rtol=1e-6)
    assert bool((inp.weights_BL[~masked] == 0).all())
    assert bool((inp.weights_BL[masked] >= 1).all())


def test_prepare_weights_cosine_follow_schedule():
    obj = objective("cosine")
    batch = make_batch(8, 16)
    noise = NoiseKeys(3, 8)
    inp = obj.prepare(batch, noise)
    t = obj.sample_time(batch, noise)
    masked = inp.tokens_BL == MASK_ID
    w = (math.pi / 2 * torch.tan(math.pi / 2 * (1 - t)))[:, None].expand(8, 16)
    torch.testing.assert_close(inp.weights_BL[masked], w[masked], atol=1e-6, rtol=1e-5)
    assert bool((inp.weights_BL[~masked] == 0).all())


@pytest.mark.parametrize("eps", [1e-3, 0.5])
@pytest.mark.parametrize("antithetic", [True, False])
def test_sample_time_in_eps_one(eps, antithetic):
    obj = objective(eps=eps, antithetic=antithetic)
    batch = make_batch(64, 2)
    t = obj.sample_time(batch, NoiseKeys(0, 64))
    assert t.shape == (64,)
    assert bool((t > eps).all()) and bool((t <= 1).all())
    # it covers the interval
    assert float(t.min()) < eps + 0.05 * (1 - eps) and float(t.max()) > 1 - 0.05 * (1 - eps)


def test_masking_rate_follows_schedule():
    """Per row, the masked fraction of supervised tokens is about 1 - alpha(t)."""
    obj = objective("cosine")
    batch = make_batch(8, 4000, supervised=1.0)
    noise = NoiseKeys(1, 8)
    inp = obj.prepare(batch, noise)
    p = 1 - obj.schedule.alpha(obj.sample_time(batch, noise))
    rate = (inp.tokens_BL == MASK_ID).float().mean(-1)
    sd = torch.sqrt(p * (1 - p) / 4000).clamp_min(1e-3)
    assert bool(((rate - p).abs() < 5 * sd).all()), (rate, p)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_expected_weight_per_supervised_token_is_one(schedule):
    """E_t E_mask[w(t) 1{masked}] = int_eps^1 -alpha'(t) dt ~= 1: the ELBO weight is normalised."""
    obj = objective(schedule)
    batch = make_batch(256, 64, supervised=1.0)
    inp = obj.prepare(batch, NoiseKeys(0, 256))
    assert float(inp.weights_BL.mean()) == pytest.approx(1.0, abs=0.08)


def test_prepare_deterministic_under_same_noise_keys():
    obj = objective()
    batch = make_batch(8, 24)
    a = obj.prepare(batch, NoiseKeys(7, 8))
    b = obj.prepare(batch, NoiseKeys(7, 8))
    assert torch.equal(a.tokens_BL, b.tokens_BL)
    assert torch.equal(a.weights_BL, b.weights_BL)
    c = obj.prepare(batch, NoiseKeys(8, 8))
    assert not torch.equal(a.tokens_BL, c.tokens_BL)


def test_prepare_does_not_modify_batch():
    batch = make_batch(4, 16)
    before = batch.tokens_BL.clone()
    objective().prepare(batch, NoiseKeys(0, 4))
    assert torch.equal(batch.tokens_BL, before)


# --------------------------------------------------------------------------------------------------
# MDLM objective: loss


def test_loss_matches_hand_computed_weighted_ce():
    obj = objective()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, V, generator=g, dtype=torch.float64)
    targets = torch.tensor([[1, 4, 0], [7, 7, 2]])
    weights = torch.tensor([[0.0, 2.0, 0.0], [0.5, 0.0, 10.0]])
    inputs = ModelInputs(targets.clone(), torch.arange(3).expand(2, 3), None, targets, weights)  # type: ignore[arg-type]
    out = obj.loss(output_of_logits(logits), inputs)

    expected, ce_sum = 0.0, 0.0
    for b in range(2):
        for i in range(3):
            if weights[b, i] == 0:
                continue
            row = [float(x) for j, x in enumerate(logits[b, i]) if j != MASK_ID]
            lse = math.log(sum(math.exp(x) for x in row))
            ce = lse - float(logits[b, i, targets[b, i]])
            expected += float(weights[b, i]) * ce
            ce_sum += ce
    assert float(out.loss_sum) == pytest.approx(expected, rel=1e-6)
    assert float(out.metrics["masked_ce_sum"]) == pytest.approx(ce_sum, rel=1e-6)
    assert int(out.metrics["num_masked"]) == 3
    assert out.loss_sum.dim() == 0


def test_loss_ignores_mask_token_logit():
    obj = objective()
    batch = make_batch(4, 16)
    inp = obj.prepare(batch, NoiseKeys(0, 4))
    logits = torch.randn(4, 16, V, generator=torch.Generator().manual_seed(1))
    base = obj.loss(output_of_logits(logits), inp).loss_sum
    huge = logits.clone()
    huge[..., MASK_ID] = 1e9
    torch.testing.assert_close(obj.loss(output_of_logits(huge), inp).loss_sum, base, atol=0, rtol=0)
    tiny = logits.clone()
    tiny[..., MASK_ID] = -1e9
    torch.testing.assert_close(obj.loss(output_of_logits(tiny), inp).loss_sum, base, atol=0, rtol=0)
    # and the loss does not modify the logits passed in
    assert float(huge[0, 0, MASK_ID]) == 1e9


def test_loss_equals_reference_on_prepared_batch():
    obj = objective()
    batch = make_batch(4, 16)
    inp = obj.prepare(batch, NoiseKeys(0, 4))
    logits = torch.randn(4, 16, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    masked_logits = logits.clone()
    masked_logits[..., MASK_ID] = float("-inf")
    ce = F.cross_entropy(masked_logits.reshape(-1, V), inp.targets_BL.reshape(-1), reduction="none")
    ce = ce.view(4, 16)
    expected = (ce * inp.weights_BL.double()).sum()
    torch.testing.assert_close(
        obj.loss(output_of_logits(logits), inp).loss_sum.double(), expected, rtol=1e-6, atol=1e-6
    )


def test_loss_gradient_zero_at_unmasked_positions():
    obj = objective()
    batch = make_batch(4, 16)
    inp = obj.prepare(batch, NoiseKeys(0, 4))
    logits = torch.randn(4, 16, V, generator=torch.Generator().manual_seed(3), requires_grad=True)
    obj.loss(output_of_logits(logits), inp).loss_sum.backward()
    grad = logits.grad
    masked = inp.weights_BL > 0
    assert bool((grad[~masked] == 0).all())
    assert bool((grad[masked].abs().sum(-1) > 0).all())
    # no gradient into the mask-token logit anywhere
    assert bool((grad[..., MASK_ID] == 0).all())
    # per masked position the gradient is w * (softmax - onehot) over the non-mask vocabulary
    b, i = masked.nonzero()[0].tolist()
    lg = logits.detach()[b, i].clone()
    lg[MASK_ID] = float("-inf")
    expect = torch.softmax(lg, -1) - F.one_hot(inp.targets_BL[b, i], V).float()
    torch.testing.assert_close(grad[b, i], inp.weights_BL[b, i] * expect, atol=1e-5, rtol=1e-5)


def test_loss_with_no_masked_positions_is_zero():
    obj = objective()
    inp = ModelInputs(
        torch.zeros(2, 4, dtype=torch.long),
        torch.arange(4).expand(2, 4),
        None,  # type: ignore[arg-type]
        torch.zeros(2, 4, dtype=torch.long),
        torch.zeros(2, 4),
    )
    logits = torch.randn(2, 4, V, requires_grad=True)
    out = obj.loss(output_of_logits(logits), inp)
    assert float(out.loss_sum.detach()) == 0.0 and int(out.metrics["num_masked"]) == 0
    out.loss_sum.backward()
    assert bool((logits.grad == 0).all())


def test_loss_deterministic_under_same_noise_keys():
    obj = objective()
    batch = make_batch(8, 16)
    logits = torch.randn(8, 16, V, generator=torch.Generator().manual_seed(4))
    a = obj.loss(output_of_logits(logits), obj.prepare(batch, NoiseKeys(1, 8))).loss_sum
    b = obj.loss(output_of_logits(logits), obj.prepare(batch, NoiseKeys(1, 8))).loss_sum
    assert torch.equal(a, b)


@pytest.mark.parametrize("antithetic", [True, False])
def test_split_batch_reproduces_whole_batch(antithetic):
    """Per-sample noise: a micro-batch split (or another rank layout) sees the same corruption."""
    obj = objective(antithetic=antithetic)
    batch = make_batch(8, 16, first_id=16)
    noise = NoiseKeys(5, group_size=8)
    logits = torch.randn(8, 16, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    whole = obj.prepare(batch, noise)
    halves = [obj.prepare(take(batch, sl), noise) for sl in (slice(0, 4), slice(4, 8))]
    assert torch.equal(torch.cat([h.tokens_BL for h in halves]), whole.tokens_BL)
    assert torch.equal(torch.cat([h.weights_BL for h in halves]), whole.weights_BL)

    total = obj.loss(output_of_logits(logits), whole)
    parts = [
        obj.loss(output_of_logits(logits[sl]), h) for sl, h in zip((slice(0, 4), slice(4, 8)), halves, strict=True)
    ]
    torch.testing.assert_close(parts[0].loss_sum + parts[1].loss_sum, total.loss_sum, rtol=1e-6, atol=1e-6)
    num_masked = int(parts[0].metrics["num_masked"]) + int(parts[1].metrics["num_masked"])
    assert num_masked == int(total.metrics["num_masked"])


def test_prepare_keeps_attention_inside_documents():
    """With document ids in the batch, the model gets a bidirectional mask restricted to documents."""
    batch = make_batch(2, 8)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [5, 5, 6, 6, 6, 6, 6, 6]])
    with_docs = Batch(batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B, doc)
    inputs = objective().prepare(with_docs, NoiseKeys(0, 2))
    assert inputs.mask.kind == "bidirectional" and inputs.mask.doc_ids_BL is doc
    plain = objective().prepare(batch, NoiseKeys(0, 2))
    assert plain.mask.is_plain
    torch.testing.assert_close(inputs.tokens_BL, plain.tokens_BL)  # the noise does not depend on documents
