"""Objective-specific behaviour of bd3lm, fast_dllm_v2, uniform and ar, their config rules, and a
convergence check of every objective on a generated deterministic task."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.loading import validate_config
from dllm.config.model import ModelConfig
from dllm.config.objectives import ARConfig, BD3LMConfig, FastDLLMv2Config, MDLMConfig, UniformConfig
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.data.loader import Batch
from dllm.data.prepare import prepare
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, FastDLLMv2Objective, TokenIds, UniformObjective
from dllm.diffusion.objectives.ar import ARObjective
from dllm.diffusion.objectives.block import pad_blocks_with_eos, shifted_rows
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.output import SelfConditioned
from dllm.training.metrics import read_metrics
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)


def _batch(B: int = 4, L: int = 16, seed: int = 0, supervised: float = 0.8) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V - 3, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) < supervised
    return Batch(tokens, mask, torch.arange(B))


def test_bd3lm_with_clean_noisy_half_equals_block_causal_attention():
    """x_t = x_0: the clean half is block-causal attention on x_0, and so is the noisy half (a noisy
    block sees itself plus the clean earlier blocks: the same keys)."""
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V)).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    x0 = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        both = model(torch.cat([x0, x0], 1), pos.repeat(1, 2), AttentionMask("block_diffusion", block_size=4)).logits()
        ref = model(x0, pos, AttentionMask("block_causal", block_size=4)).logits()
    torch.testing.assert_close(both[:, 16:], ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(both[:, :16], ref, atol=1e-5, rtol=0)


def test_bd3lm_layout_times_and_clipped_interval():
    obj = BD3LMObjective(BD3LMConfig(block_size=4, eps_min=0.3, eps_max=0.8), IDS)
    batch = _batch(B=64, L=16, supervised=1.0)
    inp = obj.prepare(batch, NoiseKeys(0, 64))
    assert inp.tokens_BL.shape == (64, 32) and torch.equal(inp.tokens_BL[:, 16:], batch.tokens_BL)
    assert torch.equal(inp.positions_BL[0], torch.arange(16).repeat(2))
    assert inp.mask.kind == "block_diffusion" and inp.mask.block_size == 4
    masked = inp.tokens_BL[:, :16] == IDS.mask_id
    # per block the masking rate follows one t in [0.3, 0.8): loss weight 1/t is the same within a block
    w = inp.weights_BL.view(64, 4, 4)
    block_t = 1.0 / w.max(-1).values[w.max(-1).values > 0]
    assert bool((block_t >= 0.3 - 1e-6).all()) and bool((block_t < 0.8 + 1e-6).all())
    rate = masked.float().mean().item()
    assert 0.45 < rate < 0.65  # E[t] = 0.55
    assert torch.equal(inp.weights_BL > 0, masked)


def test_eos_fills_the_last_block_of_padded_samples():
    tokens = torch.tensor([[5, 6, 7, 8, 9, IDS.pad_id, IDS.pad_id, IDS.pad_id, IDS.pad_id, IDS.pad_id]])
    sup = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    out = pad_blocks_with_eos(Batch(tokens, sup, torch.tensor([0]), doc), block=4, ids=IDS)
    E, P = IDS.eos_id, IDS.pad_id
    assert out.tokens_BL.tolist() == [[5, 6, 7, 8, 9, E, E, E, P, P]]
    assert out.loss_mask_BL.long().tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert out.doc_ids_BL.tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]]


def test_shifted_rows_point_at_the_previous_token():
    rows = shifted_rows(8, 4, torch.device("cpu")).tolist()
    # inside a block: i - 1 (noisy half); at a block start: the clean previous token L + i - 1
    assert rows == [0, 0, 1, 2, 8 + 3, 4, 5, 6]


@pytest.mark.parametrize("shared_clean", [True, False], ids=["3L", "two_rows"])
def test_fast_dllm_v2_complementary_masks_cover_every_token_once(shared_clean: bool):
    obj = FastDLLMv2Objective(FastDLLMv2Config(block_size=4, sub_block_size=2), IDS, shared_clean=shared_clean)
    batch = _batch(B=6, L=16)
    inp = obj.prepare(batch, NoiseKeys(0, 6))
    if shared_clean:  # [x_t^1 ; x_t^2 ; x_0] in one row
        assert inp.tokens_BL.shape == (6, 48) and inp.mask.views == 2
        assert torch.equal(inp.tokens_BL[:, 32:], batch.tokens_BL)
        first, second = inp.tokens_BL[:, :16] == IDS.mask_id, inp.tokens_BL[:, 16:32] == IDS.mask_id
        assert bool((inp.weights_BL[:, [0, 16]] == 0).all())
    else:
        assert inp.tokens_BL.shape == (12, 32)
        masked = inp.tokens_BL[:, :16] == IDS.mask_id
        first, second = masked[:6], masked[6:]
    assert not bool((first & second).any())
    assert torch.equal(first | second, batch.loss_mask_BL)
    assert inp.loss_rows is not None and bool((inp.weights_BL[:, 0] == 0).all())
    assert obj.normalizer(batch) == int(batch.loss_mask_BL[:, 1:].sum()) == int((inp.weights_BL > 0).sum())


def test_fast_dllm_v2_shared_clean_stream_equals_two_rows():
    """One clean stream for both views (3L rows) is the two-row layout (2 x 2L) computed once: the same
    noise, targets and predicting states, so the same loss and gradient, with documents and padding."""
    cfg = ModelConfig(preset="tiny", vocab_size=V, num_layers=3)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    batch = _batch(B=3, L=24, seed=4)
    doc = torch.zeros(3, 24, dtype=torch.long)
    doc[0, 10:], doc[2, 17:] = 1, 1  # documents start inside blocks
    batch = Batch(batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B, doc)
    results = []
    for shared in (True, False):
        obj = FastDLLMv2Objective(FastDLLMv2Config(block_size=4, sub_block_size=2), IDS, shared_clean=shared)
        inputs = obj.prepare(batch, NoiseKeys(3, 3))
        out = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask)
        loss = obj.loss(out, inputs)
        model.zero_grad()
        loss.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.loss_sum.detach(), int(loss.metrics["num_masked"]), grads))
    (loss_a, n_a, grads_a), (loss_b, n_b, grads_b) = results
    assert n_a == n_b == obj.normalizer(batch)
    torch.testing.assert_close(loss_a, loss_b, atol=1e-4, rtol=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        torch.testing.assert_close(g, grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("block", [False, True])
def test_uniform_corruption_never_uses_the_mask_token(block: bool):
    if block:
        obj = BD3LMObjective(BD3LMConfig(block_size=4, corruption="uniform"), IDS)
    else:
        obj = UniformObjective(UniformConfig(self_condition_prob=0.5), IDS)
    batch = _batch(B=64, L=16, supervised=1.0)
    inp = obj.prepare(batch, NoiseKeys(0, 64))
    assert not bool((inp.tokens_BL == IDS.mask_id).any())
    changed = inp.tokens_BL[:, :16] != batch.tokens_BL
    assert 0.2 < changed.float().mean().item() < 0.6  # random replacements (some equal the original)
    assert bool((inp.weights_BL == 1.0).all())  # x0 prediction at every supervised position
    if not block:
        rows = inp.self_cond_rows_B
        assert rows is not None and 10 < int(rows.sum()) < 54


def test_self_conditioning_changes_the_second_pass():
    cfg = ModelConfig(preset="tiny", vocab_size=V, self_condition=True)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    x = torch.randint(0, V, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        plain = model(x, pos).logits()
        assert torch.equal(model(SelfConditioned(x, x), pos).logits(), plain)  # zero-initialised: a no-op at first
        model.self_cond_proj.weight.normal_()
        cond = model(SelfConditioned(x, torch.where(torch.tensor([[True], [False]]), x, -1)), pos).logits()
    assert not torch.allclose(cond[0], plain[0]) and torch.allclose(cond[1], plain[1])


# -- config rules ----------------------------------------------------------------------------------


def _spec(tmp_path: Path, objective: dict, **model) -> RunSpec:
    values = {"model": {"preset": "tiny", **model}, "data": {"path": "x", "seq_len": 32}, "objective": objective,
              "training": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2}}  # fmt: skip
    return validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path)


@pytest.mark.parametrize(
    ("objective", "model", "message"),
    [
        ({"name": "bd3lm", "block_size": 12}, {}, r"objective.block_size: 12 does not divide data.seq_len 32"),
        ({"name": "fast_dllm_v2", "block_size": 8}, {"shift_logits": True}, r"model.shift_logits: fast_dllm_v2"),
        ({"name": "bd3lm", "block_size": 8}, {"family": "bert"}, None),
        ({"name": "fast_dllm_v2", "block_size": 8}, {"family": "bert"}, "bert is an encoder"),
        ({"name": "uniform", "self_condition_prob": 0.5}, {}, "set model.self_condition: true"),
        ({"name": "ar"}, {"shift_logits": True}, r"model.shift_logits: ar shifts predictions itself"),
        ({"name": "ar"}, {"family": "qwen3"}, None),
    ],
)
def test_objective_rules(tmp_path: Path, objective: dict, model: dict, message: str | None):
    spec = _spec(tmp_path, objective, **model)
    if message is None:
        resolve_run_spec(spec, check_data=False)
        return
    with pytest.raises(ConfigError, match=message):
        resolve_run_spec(spec, check_data=False)


@pytest.mark.parametrize(
    ("objective", "message"),
    [
        ({"name": "bd3lm", "eps_min": 0.5, "eps_max": 0.4}, "eps_min 0.5 must be below eps_max 0.4"),
        ({"name": "fast_dllm_v2", "block_size": 8, "sub_block_size": 3}, "sub_block_size 3 must divide"),
        ({"name": "mdlm", "block_size": 8}, r"objective.block_size: unknown field"),
        ({"name": "nope"}, "objective"),
    ],
)
def test_objective_config_errors(tmp_path: Path, objective: dict, message: str):
    with pytest.raises(ConfigError, match=message):
        _spec(tmp_path, objective)


@pytest.mark.parametrize(
    ("shared_clean", "model", "topology", "shares"),
    [
        (None, {}, {}, True),
        (False, {}, {}, False),
        (True, {}, {}, True),
        (None, {"family": "qwen3_5", "num_layers": 4}, {}, False),  # linear-attention layers: two rows
        (None, {}, {"context": {"mode": "bp", "bp_size": 2}}, False),  # a context group shards 2L rows
        (True, {"family": "qwen3_5", "num_layers": 4}, {}, "the linear-attention layers of qwen3_5"),
        (True, {}, {"context": {"mode": "bp", "bp_size": 2}}, "topology.context splits the two-row layout"),
    ],
)
def test_fast_dllm_v2_shared_clean_stream_where_the_layers_allow(tmp_path: Path, shared_clean, model, topology, shares):
    from dllm.config.rules import check_objective, model_rows, shares_clean_stream

    values = {"model": {"preset": "tiny", **model}, "data": {"path": "x", "seq_len": 32}, "topology": topology,
              "objective": {"name": "fast_dllm_v2", "block_size": 8, "shared_clean": shared_clean},
              "training": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2}}  # fmt: skip
    spec = validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path)
    if isinstance(shares, str):
        with pytest.raises(ConfigError, match=shares):
            check_objective(spec)
        return
    check_objective(spec)
    assert shares_clean_stream(spec) is shares
    assert model_rows(spec, 32) == (96 if shares else 64)


def test_objective_name_defaults_to_mdlm(tmp_path: Path):
    assert _spec(tmp_path, {"eps": 0.01}).objective.name == "mdlm"


# -- convergence ---------------------------------------------------------------------------------

CYCLE = "abcdefghijklmnop"


@pytest.fixture(scope="module")
def cyclic_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rotations of a 16-letter cycle: every masked letter follows from any neighbour."""
    root = tmp_path_factory.mktemp("cyclic")
    rows = (json.dumps({"text": CYCLE[i % 16 :] + CYCLE[: i % 16]}) + "\n" for i in range(400))
    (root / "d.jsonl").write_text("".join(rows))
    spec = validate_config(PrepareSpec, {"sources": [{"path": "d.jsonl"}], "output": "p", "seq_len": 32},
                           source="prepare.yaml", base_dir=root)  # fmt: skip
    prepare(spec, root)
    return root


CONVERGENCE = {
    "mdlm": ({"name": "mdlm"}, {}, 2.3),  # the 1/t-weighted ELBO stays higher on fully masked rows
    "bd3lm": ({"name": "bd3lm", "block_size": 8}, {}, 1.5),
    "fast_dllm_v2": ({"name": "fast_dllm_v2", "block_size": 8, "sub_block_size": 4}, {}, 1.0),
    "uniform": ({"name": "uniform", "self_condition_prob": 0.25}, {"self_condition": True}, 1.0),
    "ar": ({"name": "ar"}, {}, 0.5),  # the next letter of a cycle follows from the one before
}


@pytest.mark.parametrize("name", sorted(CONVERGENCE))
def test_objective_converges_on_a_deterministic_task(cyclic_data: Path, name: str):
    objective, model, threshold = CONVERGENCE[name]
    values = {
        "run": {"name": name}, "model": {"preset": "tiny", **model}, "data": {"path": "p", "seq_len": 32},
        "objective": objective, "training": {"steps": 120, "global_batch_size": 16, "micro_batch_size": 16},
        "optimizer": {"lr": 3e-3}, "scheduler": {"warmup_steps": 5}, "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=cyclic_data))
    losses = train_from_run_dir(prepare_run_dir(spec))
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert all(math.isfinite(x) for x in losses)
    assert end < threshold < start, f"{name}: loss {start:.3f} -> {end:.3f}, threshold {threshold}"


@pytest.mark.parametrize("backend", ["sdpa", "blockwise", "auto"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_last_layer_skips_unused_outputs_exactly(backend: str, family: str):
    """BD3LM reads only x_t's hidden states: computing just those in the last block changes nothing."""
    model = Transformer(ModelConfig(family=family, preset="tiny", vocab_size=V, attention_backend=backend))
    model.init_weights(torch.Generator().manual_seed(0))
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16).repeat(2).expand(2, 32)
    mask = AttentionMask("block_diffusion", block_size=4, doc_ids_BL=torch.tensor([[0] * 10 + [1] * 6] * 2))
    full = model(x, pos, mask).hidden_BLE
    part = model(x, pos, dataclasses.replace(mask, num_outputs=16)).hidden_BLE
    torch.testing.assert_close(part, full[:, :16], atol=1e-5, rtol=0)
    g_full = torch.autograd.grad(full[:, :16].sum(), model.embed_tokens.weight)[0]
    g_part = torch.autograd.grad(part.sum(), model.embed_tokens.weight)[0]
    torch.testing.assert_close(g_part, g_full, atol=1e-5, rtol=1e-4)


def test_bd3lm_asks_for_the_noisy_half_only():
    inp = BD3LMObjective(BD3LMConfig(block_size=4), IDS).prepare(_batch(), NoiseKeys(0, 4))
    assert inp.mask.num_outputs == 16 and inp.loss_rows is None
    shifted = BD3LMObjective(BD3LMConfig(block_size=4, shift=True), IDS).prepare(_batch(), NoiseKeys(0, 4))
    assert shifted.mask.num_outputs is None  # the shift reads clean positions too


def test_ar_loss_is_next_token_cross_entropy_on_supervised_tokens():
    """The ar objective: causal attention, hidden i-1 predicts token i, unsupervised targets (a prompt)
    and position 0 carry no loss; the mask token is no prediction. Checked against a plain computation."""
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V)).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    batch = _batch(B=3, L=12, seed=4, supervised=0.6)
    obj = ARObjective(ARConfig(), IDS, chunked_loss=False)
    inp = obj.prepare(batch, NoiseKeys(0, 3))
    assert inp.mask.kind == "causal" and torch.equal(inp.tokens_BL, batch.tokens_BL)
    assert obj.normalizer(batch) == int(batch.loss_mask_BL[:, 1:].sum()) == int((inp.weights_BL > 0).sum())
    out = model(inp.tokens_BL, inp.positions_BL, inp.mask)
    loss = obj.loss(out, inp).loss_sum
    logits = model(batch.tokens_BL, inp.positions_BL, AttentionMask("causal")).logits()[:, :-1]
    logits[..., IDS.mask_id] = float("-inf")
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.tokens_BL[:, 1:], reduction="none")
    torch.testing.assert_close(loss, (ce * batch.loss_mask_BL[:, 1:]).sum(), atol=1e-4, rtol=1e-5)
    # the future never leaks: changing the last token leaves every other prediction unchanged
    changed = batch.tokens_BL.clone()
    changed[:, -1] = (changed[:, -1] + 1) % (V - 3)
    other = model(changed, inp.positions_BL, inp.mask).hidden_BLE
    torch.testing.assert_close(other[:, :-1], out.hidden_BLE[:, :-1], atol=0, rtol=0)


CERTAIN = {
    "mdlm": (MDLMObjective, MDLMConfig, {}),
    "bd3lm": (BD3LMObjective, BD3LMConfig, {"block_size": 4}),
    "fast_dllm_v2": (FastDLLMv2Objective, FastDLLMv2Config, {"block_size": 4, "sub_block_size": 2}),
}


@pytest.mark.parametrize("name", sorted(CERTAIN))
def test_certainty_forcing_adds_the_entropy_of_the_rows_predicted_right(name: str):
    """objective.certainty: the loss is the plain objective's plus weight x the tempered entropy of the loss's
    rows whose target is the model's argmax; the chunked head equals the plain one (loss and gradients)."""
    cls, cfg_cls, fields = CERTAIN[name]
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, num_layers=2))
    model.init_weights(torch.Generator().manual_seed(0))
    # rows of an alternating pair of ids, a few steps of the plain loss on them: the model gets some right
    tokens = torch.tensor([5, 6]).repeat(3, 8)
    batch = Batch(tokens, torch.rand(3, 16, generator=torch.Generator().manual_seed(1)) < 0.9, torch.arange(3))
    plain_obj = cls(cfg_cls(**fields), IDS)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(6):
        inputs = plain_obj.prepare(batch, NoiseKeys(step, 3))
        plain_obj.loss(model(inputs.tokens_BL, inputs.positions_BL, inputs.mask), inputs).loss_sum.backward()
        optimizer.step()
        optimizer.zero_grad()
    results = {}
    for variant, certainty, chunked in (("off", None, True), ("chunked", 0.8, True), ("plain", 0.8, False)):
        section = None if certainty is None else {"weight": certainty, "temperature": 0.5}
        obj = cls(cfg_cls(**fields, certainty=section), IDS, chunked_loss=chunked)
        inputs = obj.prepare(batch, NoiseKeys(10, 3))
        loss = obj.loss(model(inputs.tokens_BL, inputs.positions_BL, inputs.mask), inputs)
        model.zero_grad()
        loss.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[variant] = (loss.loss_sum.detach(), loss.metrics, grads)
    (off, _, _), (on, metrics, grads), (plain, plain_metrics, plain_grads) = results.values()
    assert 0 < int(metrics["num_certain"]) <= int(metrics["num_masked"])
    torch.testing.assert_close(on, off + 0.8 * metrics["certain_entropy_sum"].to(on.dtype), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(on, plain, atol=1e-4, rtol=1e-5)
    assert int(plain_metrics["num_certain"]) == int(metrics["num_certain"])
    for n, g in grads.items():
        torch.testing.assert_close(g, plain_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_certainty_forcing_trains_and_reports_its_rows(cyclic_data: Path):
    """A run with objective.certainty logs the share of its masked rows predicted right and their entropy;
    on a task it learns, more rows become right and the entropy of the right ones falls."""
    values = {
        "run": {"name": "certain"}, "model": {"preset": "tiny"}, "data": {"path": "p", "seq_len": 32},
        "objective": {"name": "fast_dllm_v2", "block_size": 8, "sub_block_size": 4, "certainty": {"weight": 1.0}},
        "training": {"steps": 60, "global_batch_size": 16, "micro_batch_size": 16},
        "optimizer": {"lr": 3e-3}, "scheduler": {"warmup_steps": 5}, "checkpointing": {"save_final": False},
        "logging": {"progress": "off", "tensorboard": "off"},
    }  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=cyclic_data))
    run_dir = prepare_run_dir(spec)
    losses = train_from_run_dir(run_dir)
    records = [r for r in read_metrics(run_dir) if "certain_frac" in r]
    assert len(losses) == 60 and [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]  # logged every 10
    early, late = records[:1], records[-2:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(late, "certain_frac") > mean(early, "certain_frac") + 0.3
    assert mean(late, "certain_entropy") < mean(early, "certain_entropy")
