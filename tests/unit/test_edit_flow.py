"""Edit Flows: the model's edit head, the edit_flow objective (loss form, supervision, batching)."""

from __future__ import annotations

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.config.objectives import EditFlowConfig
from dllm.config.profile import build_profile
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.edit_schedule import cumulative_weight, kappa_and_weight
from dllm.diffusion.objectives.base import TokenIds
from dllm.diffusion.objectives.edit_flow import EditFlowObjective
from dllm.models import Transformer
from dllm.models.edit_flow import DELETE, INSERT
from dllm.models.output import ModelOutput

V = 24
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)


def _model(dtype=torch.float32, seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, edit_head=True, attention_backend="sdpa"))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype)


def _batch(B: int = 4, L: int = 12, seed: int = 0) -> Batch:
    """Rows: a prompt of 0..3 unsupervised tokens, a supervised completion, unsupervised padding."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V - 3, (B, L), generator=g)
    col = torch.arange(L)
    prompt = torch.randint(0, 4, (B, 1), generator=g)
    end = prompt + torch.randint(2, L - 3, (B, 1), generator=g)
    return Batch(tokens, (col >= prompt) & (col < end), torch.arange(B))


def _loss(model, obj, batch, noise, hidden_grad: bool = False):
    inp = obj.prepare(batch, noise)
    out = model(inp.tokens_BL, inp.positions_BL, inp.mask)
    if hidden_grad:
        leaf = out.hidden_BLE.detach().requires_grad_(True)
        out = ModelOutput(leaf, out.head, out.aux, edit=out.edit)
    return obj.loss(out, inp), inp, out


def test_edit_head_gives_non_negative_rates_and_insertion_features():
    model = _model()
    tokens = torch.randint(0, V, (2, 7))
    out = model(tokens, torch.arange(7).expand(2, 7))
    rates, ins = out.edit(out.hidden_BLE)
    assert rates.shape == (2, 7, 3) and (rates >= 0).all() and ins.shape == out.hidden_BLE.shape
    assert (
        Transformer(ModelConfig(preset="tiny", vocab_size=V)).forward(tokens, torch.arange(7).expand(2, 7)).edit is None
    )


def test_parameter_count_includes_the_edit_head():
    from dllm.models.sizing import count_params

    cfg = ModelConfig(preset="tiny", vocab_size=V, edit_head=True)
    assert count_params(cfg) == Transformer(cfg).num_params()


def test_kappa_schedules():
    t = torch.tensor([0.0, 0.5, 0.9])
    k, w = kappa_and_weight("cubic", t)
    torch.testing.assert_close(k, t**3)
    torch.testing.assert_close(w, 3 * t**2 / (1 - t**3))
    k, w = kappa_and_weight("linear", t)
    torch.testing.assert_close(w, 1 / (1 - t))
    for name in ("cubic", "linear"):  # K = -log(1 - kappa) is the integral of w (trapezoid check), inf at 1
        grid = torch.linspace(0.0, 0.9, 20001, dtype=torch.float64)
        integral = torch.trapezoid(kappa_and_weight(name, grid)[1], grid)
        assert abs(float(integral) - cumulative_weight(name, 0.9)) < 1e-6
        assert cumulative_weight(name, 0.0) == 0.0 and cumulative_weight(name, 1.0) == float("inf")


@pytest.mark.parametrize("kappa", ["cubic", "linear"])
def test_time_sampling_by_weight_estimates_the_same_loss(kappa):
    """With t drawn so that K(t) is uniform and every row weighted K(1 - eps) / (1 - eps), the weighted mean
    of any f(kappa(t)) over a stratified batch matches uniform t weighted by w(t) (both estimate
    E_{t ~ U[0, 1 - eps]} w(t) f(t)), and the weight is the same for every row."""
    G, eps = 4096, 1e-3
    batch = Batch(torch.zeros(G, 4, dtype=torch.long), torch.ones(G, 4, dtype=torch.bool), torch.arange(G))
    estimates = {}
    for how in ("weight", "uniform"):
        obj = EditFlowObjective(EditFlowConfig(kappa=kappa, eps=eps, x0="empty", time_sampling=how), IDS)
        inp = obj.prepare(batch, NoiseKeys(0, G))
        keep = (
            (inp.tokens_BL[:, 1:] != IDS.pad_id).sum(-1).double()
        )  # x_t: the kept columns of x_1 (4 kappa on average)
        estimates[how] = float((inp.row_weight_B.double() * (4 - keep)).mean())  # mean of w * remaining edits
        if how == "weight":
            assert torch.allclose(inp.row_weight_B, inp.row_weight_B[0]) and float(
                inp.row_weight_B[0]
            ) == pytest.approx(cumulative_weight(kappa, 1 - eps) / (1 - eps), rel=1e-5)
    exact = 4 * ((1 - eps) ** 3 if kappa == "cubic" else 1 - eps) / (1 - eps)
    assert estimates["weight"] == pytest.approx(exact, rel=0.05)
    assert estimates["uniform"] == pytest.approx(exact, rel=0.25)  # the same mean, far noisier


@pytest.mark.parametrize("x0", ["empty", "uniform"])
def test_prepare_builds_x_t_and_exactly_the_remaining_edits(x0):
    """Applying every remaining edit to x_t (in the input layout) gives x_1; the prompt is kept."""
    obj = EditFlowObjective(EditFlowConfig(x0=x0), IDS)
    batch = _batch(B=6, seed=1)
    inp = obj.prepare(batch, NoiseKeys(0, 6))
    for b in range(6):
        sup = batch.loss_mask_BL[b]
        P = int(sup.long().argmax())
        row = inp.tokens_BL[b][inp.mask.key_valid_BL[b]].tolist()
        assert row[0] == IDS.mask_id and row[1 : 1 + P] == batch.tokens_BL[b, :P].tolist()
        sel = inp.edit_row_N == b
        slots = [[tok] for tok in row]  # per position: what it becomes (+ what is inserted after it)
        for pos, kind, tok in zip(inp.edit_pos_N[sel].tolist(), inp.edit_kind_N[sel].tolist(),
                                  inp.edit_token_N[sel].tolist(), strict=True):  # fmt: skip
            assert pos >= P + (kind != INSERT)  # nothing inside the prompt is edited
            if kind == INSERT:
                slots[pos].append(tok)
            elif kind == DELETE:
                slots[pos][0] = None
            else:
                slots[pos][0] = tok
        result = [t for s in slots for t in s if t is not None]
        assert result[1 + P :] == batch.tokens_BL[b][sup].tolist()
        if x0 == "empty":
            assert set(inp.edit_kind_N[sel].tolist()) <= {INSERT}


def test_loss_is_finite_and_gradient_only_reaches_supervised_positions():
    model, obj = _model(), EditFlowObjective(EditFlowConfig(x0="uniform"), IDS)
    batch = _batch(B=4, seed=2)
    loss, inp, out = _loss(model, obj, batch, NoiseKeys(0, 4), hidden_grad=True)
    assert torch.isfinite(loss.loss_sum) and int(loss.metrics["num_edits"]) > 0
    loss.loss_sum.backward()
    touched = out.hidden_BLE.grad.abs().sum(-1) > 0  # [B, L]
    allowed = inp.rate_on_BL3.amax(-1) > 0
    assert not (touched & ~allowed).any()  # prompt (but the insertion anchor) and padding: zero gradient
    assert (touched == allowed).all()
    prompt = batch.loss_mask_BL.long().argmax(-1)
    for b in range(4):  # the positions before the last prefix token get no gradient
        assert not touched[b, : int(prompt[b])].any()
        assert not touched[b, ~inp.mask.key_valid_BL[b]].any()


@pytest.mark.parametrize("x0", ["empty", "uniform"])
def test_batched_loss_equals_one_sequence_at_a_time(x0):
    torch.manual_seed(0)
    model, obj = _model(torch.float64), EditFlowObjective(EditFlowConfig(x0=x0), IDS)
    batch, noise = _batch(B=4, seed=3), NoiseKeys(0, 4)
    with torch.no_grad():
        full = _loss(model, obj, batch, noise)[0].loss_sum
        rows = sum(
            _loss(
                model,
                obj,
                Batch(batch.tokens_BL[b : b + 1], batch.loss_mask_BL[b : b + 1], batch.sample_ids_B[b : b + 1]),
                noise,
            )[0].loss_sum  # fmt: skip
            for b in range(4)
        )
    torch.testing.assert_close(full, rows, atol=1e-6, rtol=0)


def test_loss_matches_a_hand_computation_for_one_insertion_row():
    """Empty prompt, x_1 = [5, 6]: the loss is w(t) times the sum of the allowed intensities minus, per
    remaining insertion, w * (log lambda + log Q_ins(token)), recomputed here from the model's outputs."""
    obj = EditFlowObjective(EditFlowConfig(x0="empty", antithetic=False), IDS)
    batch = Batch(torch.tensor([[5, 6, 0, 0]]), torch.tensor([[True, True, False, False]]), torch.tensor([0]))
    model = _model(torch.float64)
    inp = obj.prepare(batch, NoiseKeys(0, 1))
    out = model(inp.tokens_BL, inp.positions_BL, inp.mask)
    rates, ins = out.edit(out.hidden_BLE)
    w = float(inp.row_weight_B[0])
    expected = w * (rates[0] * inp.rate_on_BL3[0].double()).sum()
    assert inp.edit_weight_N.tolist() == [w] * inp.edit_weight_N.numel() and w > 0
    for pos, kind, tok in zip(inp.edit_pos_N.tolist(), inp.edit_kind_N.tolist(), inp.edit_token_N.tolist(),
                              strict=True):  # fmt: skip
        feat = ins[0, pos] if kind == INSERT else out.hidden_BLE[0, pos]
        logits = model.logits(feat[None])[0]
        logits[IDS.mask_id] = float("-inf")
        expected = expected - w * (rates[0, pos, kind].log() + (logits.log_softmax(-1)[tok] if kind != DELETE else 0))
    torch.testing.assert_close(obj.loss(out, inp).loss_sum, expected, atol=1e-9, rtol=0)
    assert inp.edit_kind_N.numel() == 2 - (inp.tokens_BL.shape[1] - 1)  # x_t holds the kept part of x_1
    assert set(inp.edit_kind_N.tolist()) <= {INSERT}


def test_short_overfit_decreases_the_loss():
    torch.manual_seed(0)
    model, obj = _model(), EditFlowObjective(EditFlowConfig(x0="uniform"), IDS)
    batch = _batch(B=4, seed=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        loss = _loss(model, obj, batch, NoiseKeys(step, 4))[0].loss_sum / batch.num_targets
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert sum(losses[-8:]) / 8 < 0.7 * sum(losses[:8]) / 8


def test_profile_says_edit_flow():
    p = build_profile(EditFlowConfig(), shift_logits=False, max_length=64, mask_id=1, pad_id=2, eos_id=3, num_tokens=V)
    assert p.generation == "edit_flow" and p.objective == "edit_flow" and p.attention == "bidirectional"
    from dllm.config.sampler import SamplerConfig, resolve_sampler

    p = build_profile(EditFlowConfig(kappa="linear", eps=0.01), shift_logits=False, max_length=64, mask_id=1, pad_id=2,
                      eos_id=3, num_tokens=V)  # fmt: skip
    assert (p.edit_kappa, p.edit_eps) == ("linear", 0.01)
    cfg = resolve_sampler(SamplerConfig(), p)  # tau-leaping follows the training's schedule and ends at 1 - eps
    assert cfg.edit_kappa == "linear" and cfg.edit_end_time == pytest.approx(0.99)
    cfg = resolve_sampler(SamplerConfig(edit_kappa="cubic", edit_end_time=1.0), p)
    assert cfg.edit_kappa == "cubic" and cfg.edit_end_time == 1.0


def test_same_noise_keys_same_inputs_and_padding_rows_add_nothing():
    """The registry contract for this objective (tests/contracts/test_registries.py OWN_CONTRACT)."""
    obj, model = EditFlowObjective(EditFlowConfig(x0="uniform"), IDS), _model(torch.float64)
    batch = _batch(B=4, seed=6)
    a, b, c = (obj.prepare(batch, NoiseKeys(s, 6)) for s in (3, 3, 4))
    assert torch.equal(a.tokens_BL, b.tokens_BL) and torch.equal(a.edit_pos_N, b.edit_pos_N)
    assert a.tokens_BL.shape != c.tokens_BL.shape or not torch.equal(a.tokens_BL, c.tokens_BL)
    pad = Batch(torch.full((2, 12), IDS.pad_id), torch.zeros(2, 12, dtype=torch.bool), torch.tensor([90, 91]))
    padded = Batch(*(torch.cat([x, y]) for x, y in zip(
        (batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B), (pad.tokens_BL, pad.loss_mask_BL, pad.sample_ids_B),
        strict=True)))  # fmt: skip
    assert obj.normalizer(padded) == obj.normalizer(batch) > 0
    with torch.no_grad():
        loss_a = _loss(model, obj, batch, NoiseKeys(0, 6))[0].loss_sum
        loss_p, inp_p, _ = _loss(model, obj, padded, NoiseKeys(0, 6))
    assert (inp_p.edit_row_N < 4).all()  # a row without a completion has no edits and no rates
    assert int(inp_p.rate_on_BL3[4:].sum()) == 0
    torch.testing.assert_close(loss_p.loss_sum, loss_a, atol=1e-9, rtol=0)


@pytest.mark.parametrize(
    ("model", "message"),
    [({}, "set model.edit_head: true"), ({"edit_head": True, "shift_logits": True}, "model.shift_logits: edit_flow"),
     ({"edit_head": True}, None),
     ({"edit_head": True, "topology": {"context": {"mode": "cp", "cp_size": 2}}}, "edit_flow rows change length")],
)  # fmt: skip
def test_config_rules(tmp_path, model, message):
    from dllm.config.loading import validate_config
    from dllm.config.spec import RunSpec
    from dllm.errors import ConfigError
    from dllm.training.preflight import resolve_run_spec

    topology = model.pop("topology", {})
    values = {"model": {"preset": "tiny", **model}, "topology": topology, "data": {"path": "x", "seq_len": 32},
              "objective": {"name": "edit_flow"},
              "training": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2}}  # fmt: skip
    spec = validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path)
    if message is None:
        resolve_run_spec(spec, check_data=False)
        return
    with pytest.raises(ConfigError, match=message):
        resolve_run_spec(spec, check_data=False)
