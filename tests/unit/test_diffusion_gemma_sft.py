"""The diffusiongemma_native_sft objective: its one-pass loss over [clean ; canvas of every response
block] equals a reference written here for the same keyed noise, block by block through transformers'
DiffusionGemmaForBlockDiffusion (encoder over the clean prefix, decoder over that block's canvas, with
and without self-conditioning logits); its checks are one-line errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm.config.objectives import DiffusionGemmaSFTConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, uniform_token_ids
from dllm.diffusion.objectives import TokenIds
from dllm.errors import ConfigError, DataError
from dllm.training.trainer import run_model
from tests.unit.test_diffusion_gemma import C, V, _reference, pair  # noqa: F401 (the pair fixture)

L, S, PAD = 16, 4, 0  # row length, block size, pad id
IDS = TokenIds(mask_id=V - 1, eos_id=1, pad_id=PAD, num_tokens=V)


def _batch() -> Batch:
    """Row 0: prompt of 3, response to the end (a partial last block); row 1: prompt of 5, response of
    8, then padding."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, V - 1, (2, L), generator=g)
    sup = torch.zeros(2, L, dtype=torch.bool)
    sup[0, 3:] = True
    sup[1, 5:13] = True
    tokens[1, 13:] = PAD
    return Batch(tokens, sup, torch.tensor([7, 8]))


def _reference_canvas(batch: Batch, cfg: DiffusionGemmaSFTConfig, noise: NoiseKeys) -> torch.Tensor:
    """The corruption written out token by token: t = 1 - (1 - eps) u per (row, block from the response
    start), a supervised token replaced by its uniform id when its hit draw is below t."""
    K = -(-L // S)
    u_BK = noise.stratified_blocks(batch.sample_ids_B, K, "dgemma.t", cfg.antithetic)
    ids_BL = uniform_token_ids(noise.uniform(batch.sample_ids_B, (L,), "dgemma.ids"), V, IDS.mask_id)
    hit_BL = noise.uniform(batch.sample_ids_B, (L,), "dgemma.hit")
    canvas = batch.tokens_BL.clone()
    for b in range(2):
        start = int(batch.loss_mask_BL[b].nonzero()[0])
        for j in range(L):
            t = 1.0 - (1.0 - cfg.eps) * float(u_BK[b, (j - start) // S]) if j >= start else 0.0
            if batch.loss_mask_BL[b, j] and float(hit_BL[b, j]) < t:
                canvas[b, j] = ids_BL[b, j]
    return canvas


def _ce(logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    logits_NV = logits_NV.clone()
    logits_NV[:, IDS.mask_id] = float("-inf")  # the objective never predicts the mask id
    return F.cross_entropy(logits_NV, targets_N, reduction="sum")


def _reference_loss(hf, batch: Batch, canvas: torch.Tensor, cfg: DiffusionGemmaSFTConfig, on_B: torch.Tensor) -> float:
    """Per row: the encoder's next-token loss over the whole row, and per response block the decoder over
    that block's canvas after the encoder's clean prefix (a second pass on the first one's logits where on)."""
    total = 0.0
    for b in range(2):
        x, sup = batch.tokens_BL[b : b + 1], batch.loss_mask_BL[b]
        valid = (torch.arange(L) < int(sup.nonzero()[-1]) + 1)[None]
        enc = hf(input_ids=x, attention_mask=valid, decoder_input_ids=canvas[b : b + 1, :1])
        hidden = enc.encoder_last_hidden_state[0]
        enc_logits = torch.tanh(hf.lm_head(hidden) / 30.0) * 30.0
        next_sup = sup[1:]
        total += cfg.encoder_loss_weight * float(_ce(enc_logits[:-1][next_sup], x[0, 1:][next_sup]))
        start, end = int(sup.nonzero()[0]), int(sup.nonzero()[-1]) + 1
        for s in range(start, end, S):
            e = min(s + S, L)
            kwargs = dict(input_ids=x[:, :s], attention_mask=valid[:, :s], decoder_input_ids=canvas[b : b + 1, s:e],
                          decoder_attention_mask=valid[:, :e])  # fmt: skip
            logits = hf(**kwargs).logits
            if bool(on_B[b]):
                logits = hf(**kwargs, self_conditioning_logits=logits).logits
            block_sup = sup[s:e]
            total += float(_ce(logits[0][block_sup], x[0, s:e][block_sup]))
    return total


@pytest.mark.parametrize("self_condition_prob", [0.0, 0.5])
def test_loss_equals_the_blockwise_reference(pair, self_condition_prob: float):  # noqa: F811
    from dllm.config.registries import OBJECTIVES

    hf, ours, _ = pair
    cfg = DiffusionGemmaSFTConfig(block_size=S, encoder_loss_weight=0.3, self_condition_prob=self_condition_prob)
    objective = OBJECTIVES.resolve(cfg.name)(cfg, IDS, chunked_loss=True)
    batch, noise = _batch(), NoiseKeys(seed=9, group_size=2)
    inputs = objective.prepare(batch, noise)
    canvas = _reference_canvas(batch, cfg, noise)
    assert torch.equal(inputs.tokens_BL[:, L:], canvas) and not torch.equal(canvas, batch.tokens_BL)
    on_B = torch.zeros(2, dtype=torch.bool) if inputs.self_cond_rows_B is None else inputs.self_cond_rows_B
    if self_condition_prob:
        assert bool(on_B.any()) and not bool(on_B.all())  # seed chosen so that one row is conditioned
    with torch.no_grad():
        got = float(objective.loss(run_model(ours, inputs), inputs).loss_sum)
        want = _reference_loss(hf, batch, canvas, cfg, on_B)
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), (got, want)
    assert objective.normalizer(batch) == int(batch.loss_mask_BL.sum())


def test_the_first_pass_runs_when_no_example_of_the_batch_is_drawn(pair):  # noqa: F811
    """Every rank runs both passes whenever the objective draws self-conditioning (the forward holds
    collectives under FSDP, expert and context parallelism); undrawn examples add exactly 0, so the step
    equals the plain one-pass step bit for bit."""
    import dataclasses

    from dllm.config.registries import OBJECTIVES

    _, ours, _ = pair
    cfg = DiffusionGemmaSFTConfig(block_size=S, self_condition_prob=0.5)
    objective = OBJECTIVES.resolve(cfg.name)(cfg, IDS, chunked_loss=True)
    inputs = objective.prepare(_batch(), NoiseKeys(seed=9, group_size=2))
    none_drawn = dataclasses.replace(inputs, self_cond_rows_B=torch.zeros(2, dtype=torch.bool))
    calls = []
    hook = ours.register_forward_pre_hook(lambda module, args: calls.append(type(args[0]).__name__))
    try:
        with torch.no_grad():
            got = run_model(ours, none_drawn).hidden_BLE
            plain = run_model(ours, dataclasses.replace(inputs, self_cond_rows_B=None)).hidden_BLE
    finally:
        hook.remove()
    assert calls == ["Tensor", "CanvasConditioned", "Tensor"]
    assert torch.equal(got, plain)


def test_supervision_must_be_one_suffix():
    from dllm.diffusion.objectives.diffusion_gemma import DiffusionGemmaSFT

    objective = DiffusionGemmaSFT(DiffusionGemmaSFTConfig(block_size=S), IDS)
    batch = _batch()
    sup = batch.loss_mask_BL.clone()
    sup[0, 8] = False  # two runs in row 0 (two records packed in a row)
    with pytest.raises(
        DataError, match="^objective diffusiongemma_native_sft: row 0 .* one record supervised in one suffix"
    ):
        objective.prepare(Batch(batch.tokens_BL, sup, batch.sample_ids_B), NoiseKeys(0, 2))
    tokens = batch.tokens_BL.clone()
    tokens[1, 14] = 5  # a token after row 1's response that is not padding
    with pytest.raises(DataError, match="row 1"):
        objective.prepare(Batch(tokens, batch.loss_mask_BL, batch.sample_ids_B), NoiseKeys(0, 2))
    full = torch.ones_like(sup)  # full supervision is a suffix from 0
    objective.prepare(Batch(batch.tokens_BL, full, batch.sample_ids_B), NoiseKeys(0, 2))
    docs = torch.zeros(2, L, dtype=torch.long)
    docs[1, 13:] = 1  # padding as its own document is fine
    objective.prepare(Batch(batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B, docs), NoiseKeys(0, 2))
    docs[0, 10:] = 1  # two documents in row 0 (packed text) are not
    with pytest.raises(DataError, match="row 0 .* not one record"):
        objective.prepare(Batch(batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B, docs), NoiseKeys(0, 2))


@pytest.mark.parametrize(
    "model,objective,extra,message",
    [
        ({"family": "llama"}, {}, {}, "^model.family: diffusiongemma_native_sft trains DiffusionGemma"),
        ({"canvas_length": 4096}, {"block_size": 4096}, {}, "^objective.block_size: 4096 exceeds data.seq_len"),
        ({"canvas_length": 16}, {}, {}, r"^objective.block_size: 8 differs from the 16 tokens of the model's canvas"),
        ({"num_experts": 4, "router_aux_loss_coef": 0.01}, {}, {}, "^model.router_aux_loss_coef: .* routers frozen"),
        ({}, {}, {"lora": {"targets": ["router.proj"]}}, "^lora.targets: .* routers frozen"),
    ],
)
def test_config_checks_are_one_line(model, objective, extra, message):
    from dllm.config.rules import check_objective
    from dllm.config.spec import RunSpec
    from tests.helpers import tiny_train_values

    values = tiny_train_values()
    values["model"] = {"family": "diffusion_gemma", "preset": "tiny", "router_aux_loss_coef": 0.0, "canvas_length": 8,
                       **model}  # fmt: skip
    values["objective"] = {"name": "diffusiongemma_native_sft", "block_size": 8, **objective}
    spec = RunSpec.model_validate({**values, **extra})
    with pytest.raises(ConfigError, match=message) as e:
        check_objective(spec)
    assert "\n" not in str(e.value)


def test_profile_and_frozen_routers(pair):  # noqa: F811
    """Runs record prefix_canvas decoding with the block size (a folder not trained here: its canvas length),
    which resolves the sampler to canvas_denoise in canvases of that size (a mask policy is refused in one
    line); the build's freeze leaves the routers out of training and the rest in."""
    from dllm.config.profile import build_profile
    from dllm.config.sampler import SamplerConfig, resolve_sampler
    from dllm.models.gemma import freeze_routers
    from dllm.models.transformer import Transformer

    profile = build_profile(DiffusionGemmaSFTConfig(block_size=S), shift_logits=False, max_length=64,
                            mask_id=IDS.mask_id, pad_id=PAD, eos_id=1, num_tokens=V)  # fmt: skip
    assert (profile.attention, profile.block_size, profile.corruption) == ("prefix_canvas", S, "uniform")
    cfg = resolve_sampler(SamplerConfig(gen_length=6), profile)
    assert (cfg.generation, cfg.block_length, cfg.gen_length, cfg.total_steps) == ("canvas_denoise", S, 8, 2 * 48)
    with pytest.raises(ConfigError, match="^sampler.policy: no effect on canvas_denoise") as e:
        resolve_sampler(SamplerConfig(policy="uniform"), profile)
    assert "\n" not in str(e.value)
    folder = build_profile(None, shift_logits=False, max_length=64, mask_id=IDS.mask_id, pad_id=PAD, eos_id=1,
                           num_tokens=V, canvas_length=C)  # fmt: skip
    assert (folder.attention, folder.block_size) == ("prefix_canvas", C)  # a DiffusionGemma folder not trained here
    _, ours, _ = pair
    model = Transformer(ours.cfg)
    freeze_routers(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".beside.router." in n for n in frozen)
    assert len(frozen) == 3 * ours.cfg.num_layers  # proj, scale, per_expert_scale of every layer


def test_two_training_steps_end_to_end(tmp_path):
    """A tiny MoE DiffusionGemma trains with the objective through the real build on prompt/completion
    records, one per row (the routers frozen, self-conditioning drawn): the loss is finite and the
    routers do not move while the rest does."""
    import json

    from dllm.config.loading import load_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare
    from tests.helpers import PREPARE, tiny_train_values, write_yaml
    from tests.unit.test_training import _trainer

    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sources = [{"path": "data/sft.jsonl", "format": "prompt_completion"}]
    write_yaml(tmp_path / "prepare.yaml", {**PREPARE, "sources": sources, "layout": "indexed"})
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    model = {"family": "diffusion_gemma", "num_experts": 4, "router_aux_loss_coef": 0.0, "canvas_length": 8,
             "local_window": 8}  # fmt: skip
    values = tiny_train_values(model=model, objective={"name": "diffusiongemma_native_sft", "block_size": 8},
                               training={"steps": 2})  # fmt: skip
    trainer, run_dir = _trainer(write_yaml(tmp_path / "train.yaml", values))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for _ in range(2):
        stats = trainer.train_step(trainer.loader.next_step())
        assert torch.isfinite(torch.tensor(stats.loss))
    after = dict(trainer.model.named_parameters())
    moved = {n for n, p in before.items() if not torch.equal(p, after[n].detach())}
    assert moved and not any(".router." in n for n in moved)
    assert any(".experts." in n for n in moved)
    # a checkpoint holds what trained; loading it for inference rebuilds the frozen routers from the config
    from dllm.checkpoint.loading import load_for_inference

    trainer.checkpoints.save(trainer.step, trainer.model, trainer.optimizer, trainer.state_dict())
    loaded = dict(load_for_inference(run=run_dir).model.named_parameters())
    assert all(torch.equal(loaded[n].detach(), p.detach()) for n, p in after.items())


def test_tensor_parallelism_is_refused_for_gemma_layers():
    from dllm.config.rules import check_tensor_parallel
    from dllm.config.spec import RunSpec
    from tests.helpers import tiny_train_values

    values = tiny_train_values(model={"family": "diffusion_gemma", "preset": "tiny"}, topology={"tp_size": 2})
    with pytest.raises(ConfigError, match="^topology.tp_size: diffusion_gemma's Gemma 4 layers .* set tp_size: 1$"):
        check_tensor_parallel(RunSpec.model_validate(values))
