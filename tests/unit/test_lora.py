"""LoRA adapters (models/lora.py) on the tiny native transformer, and the PEFT folder format.

Shapes: B batch, L sequence, V vocabulary.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.model import LoraConfig, ModelConfig
from dllm.models import Transformer
from dllm.models.lora import (
    LoraLinear,
    apply_lora,
    init_lora,
    load_adapter,
    load_lora_state_dict,
    lora_state_dict,
    merge_lora,
    save_adapter,
    target_matches,
)

V, B, L = 64, 2, 8
SPEC = LoraConfig(rank=4, alpha=8.0, dropout=0.0, targets=["q_proj", "v_proj"])
ADAPTED = [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]


def build(seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, V, (B, L), generator=g),
        torch.arange(L).expand(B, L),
        torch.randint(0, V, (B, L), generator=g),
    )


def adapted_and_trained(steps: int = 3) -> tuple[Transformer, dict[str, torch.Tensor]]:
    """An adapted model after a few AdamW steps, and the base state dict from before."""
    model = build()
    base_sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_lora(model, SPEC, torch.Generator().manual_seed(7)) == ADAPTED
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    tokens_BL, positions_BL, targets_BL = data()
    for _ in range(steps):
        loss = F.cross_entropy(model(tokens_BL, positions_BL).logits().flatten(0, 1), targets_BL.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), base_sd


def test_target_patterns():
    name = "layers.0.self_attn.q_proj"
    assert target_matches(name, "q_proj") and target_matches(name, "*.q_proj")
    assert target_matches(name, "self_attn.q_proj") and target_matches(name, r"re:layers\.\d+\.self_attn\.q_proj")
    assert not target_matches(name, "proj") and not target_matches(name, "re:q_proj")


def test_initial_output_equals_base_and_only_adapters_train():
    base, model = build(), build()
    apply_lora(model, SPEC, torch.Generator().manual_seed(7))
    tokens_BL, positions_BL, _ = data()
    torch.testing.assert_close(
        model(tokens_BL, positions_BL).logits(), base(tokens_BL, positions_BL).logits(), atol=0, rtol=0
    )
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{m}.lora_{ab}.weight" for m in ADAPTED for ab in "AB")
    assert isinstance(model.layers[0].self_attn.q_proj, LoraLinear)
    # base keys unchanged: a base checkpoint loads with only the adapter keys missing
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert sorted(missing) == trainable and unexpected == []


def test_training_changes_only_adapters():
    model, base_sd = adapted_and_trained()
    sd = model.state_dict()
    for key, before in base_sd.items():
        assert torch.equal(sd[key], before), key  # bit-identical
    assert all(float(model.get_submodule(m).lora_B.weight.detach().abs().sum()) > 0 for m in ADAPTED)


def test_merge_equals_adapted_forward_and_has_base_keys():
    model, base_sd = adapted_and_trained()
    tokens_BL, positions_BL, _ = data(seed=5)
    adapted_BLV = model(tokens_BL, positions_BL).logits()
    assert merge_lora(model) == ADAPTED
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    assert list(model.state_dict()) == list(base_sd)
    torch.testing.assert_close(model(tokens_BL, positions_BL).logits(), adapted_BLV, atol=1e-5, rtol=1e-5)


def test_state_dict_and_folder_round_trip(tmp_path):
    model, _ = adapted_and_trained()
    tokens_BL, positions_BL, _ = data(seed=5)
    want_BLV = model(tokens_BL, positions_BL).logits()
    sd = lora_state_dict(model)
    assert sorted(sd) == sorted(f"{m}.lora_{ab}.weight" for m in ADAPTED for ab in "AB")
    other = build()
    apply_lora(other, SPEC, torch.Generator().manual_seed(99))
    load_lora_state_dict(other, sd)
    torch.testing.assert_close(other(tokens_BL, positions_BL).logits(), want_BLV, atol=0, rtol=0)
    with pytest.raises(ValueError, match="missing keys"):
        load_lora_state_dict(other, {k: v for k, v in sd.items() if "lora_A" in k})
    save_adapter(model, tmp_path / "adapter", SPEC, base_model_name_or_path="tiny")
    fresh = build()
    assert load_adapter(fresh, tmp_path / "adapter") == SPEC
    torch.testing.assert_close(fresh(tokens_BL, positions_BL).logits(), want_BLV, atol=0, rtol=0)
    assert sorted(n for n, p in fresh.named_parameters() if p.requires_grad) == sorted(sd)


def test_meta_device_flow_matches_eager():
    """build.py's order: model on meta -> apply_lora -> to_empty -> base weights -> init_lora."""
    eager = build()
    apply_lora(eager, SPEC, torch.Generator().manual_seed(7))
    with torch.device("meta"):
        model = Transformer(ModelConfig(preset="tiny", vocab_size=V))
    apply_lora(model, SPEC, torch.Generator().manual_seed(7))
    model.to_empty(device="cpu")
    model.init_buffers()
    missing, _ = model.load_state_dict(build().state_dict(), strict=False)
    assert len(missing) == 2 * len(ADAPTED)
    init_lora(model, torch.Generator().manual_seed(7))
    for (k, a), (k2, b) in zip(model.state_dict().items(), eager.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, p in eager.named_parameters() if p.requires_grad
    ]


def test_errors():
    with pytest.raises(ValueError, match=r"\['nope', 'x_proj'\]"):
        apply_lora(build(), LoraConfig(rank=4, alpha=8.0, targets=["nope", "x_proj"]), torch.Generator())
    with pytest.warns(UserWarning, match="'nope'"):
        apply_lora(build(), LoraConfig(rank=4, alpha=8.0, targets=["nope", "q_proj"]), torch.Generator())
    model = build()
    apply_lora(model, SPEC, torch.Generator())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, SPEC, torch.Generator())
    with pytest.raises(ValueError, match="greater than 0"):
        LoraConfig(rank=0, alpha=8.0)


def test_peft_folder_layout(tmp_path):
    from safetensors.torch import load_file

    model, _ = adapted_and_trained()
    save_adapter(model, tmp_path, SPEC, rename_module=lambda p: "model." + p)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["lora_dropout"] == 0.0 and config["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{key}.lora_A.weight"].shape == (4, 64)  # [r, in]
    assert tensors[f"{key}.lora_B.weight"].shape == (64, 4)  # [out, r]
    assert len(tensors) == 2 * len(ADAPTED)


def hf_llama_like(model: Transformer):
    """A transformers LlamaForCausalLM with the native model's config and weights (names: "model." + native)."""
    transformers = pytest.importorskip("transformers")
    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.mlp_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.dim_per_head,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict({"model." + k: v for k, v in model.state_dict().items()}, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf


def test_peft_loads_the_folder_onto_hf_llama(tmp_path):
    peft = pytest.importorskip("peft")
    model, _ = adapted_and_trained()
    save_adapter(model, tmp_path, SPEC, rename_module=lambda p: "model." + p)
    merged = build()
    load_adapter(merged, tmp_path, rename_module=lambda p: "model." + p)
    merge_lora(merged)
    hf = peft.PeftModel.from_pretrained(hf_llama_like(build()), str(tmp_path)).eval()
    tokens_BL, positions_BL, _ = data(seed=5)
    want_BLV = model(tokens_BL, positions_BL, AttentionMask("causal")).logits()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens_BL).logits, want_BLV, atol=1e-4, rtol=1e-4)
        merged_hf = hf.merge_and_unload()
        got = {k.removeprefix("model."): v for k, v in merged_hf.state_dict().items() if k != "lm_head.weight"}
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6)
