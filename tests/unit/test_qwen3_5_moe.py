"""Qwen3.5-MoE (the hybrid with routed experts and a gated shared expert): a small random transformers
Qwen3_5MoeForCausalLM (linear and full attention layers, 4 experts, top-2, a shared expert) saved and imported
gives the same logits (float32, 1e-4), unpadded and with left or right padding; an export loads back in
transformers with the same logits and re-imports bit for bit; the multimodal release's layout imports; the
parameter count is transformers'; greedy decoding with the cache equals transformers' `generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf
from dllm.models.sizing import count_params

transformers = pytest.importorskip("transformers")

V, L = 96, 80  # longer than one chunk (64) of the gated delta rule


def _hf_model():
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():  # zero-initialised norms and router: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[torch.nn.Module, Transformer, Path]:
    folder = tmp_path_factory.mktemp("qwen3_5_moe") / "hf"
    hf = _hf_model()
    hf.save_pretrained(folder)
    return hf, _import(folder), folder


def _tokens(B: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))


def test_config_and_size(pair):
    hf, ours, folder = pair
    cfg = ours.cfg
    assert cfg.family == "qwen3_5_moe" and [cfg.layer_kind(i) for i in range(4)] == ["linear"] * 3 + ["global"]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.num_shared_experts) == (4, 2, 16, 2)
    assert cfg.shared_expert_gate and cfg.norm_topk_prob and cfg.router_score == "softmax"
    assert count_params(cfg) == ours.num_params() == sum(p.numel() for p in hf.parameters())
    from safetensors.torch import load_file

    on_disk = load_file(folder / "model.safetensors").keys()  # transformers saves the experts one by one
    assert (
        "model.layers.0.mlp.experts.3.gate_proj.weight" in on_disk
        and "model.layers.0.mlp.shared_expert.up_proj.weight" in on_disk
    )


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    x = _tokens()
    with torch.no_grad():
        got = ours(x, torch.arange(L).expand(2, L), AttentionMask("causal")).logits()
        want = hf(x).logits
    diff = float((got - want).abs().max())
    print(f"qwen3_5_moe logits max|diff| unpadded {diff:.1e}")
    assert diff <= 1e-4


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_match_transformers(pair, side: str):
    hf, ours, _ = pair
    x = _tokens()
    valid = torch.ones(2, L, dtype=torch.bool)
    pad = torch.arange(L) < 9 if side == "left" else torch.arange(L) >= L - 9
    valid[1] = ~pad
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        got = ours(x, positions, AttentionMask("causal", key_valid_BL=valid)).logits()
        want = hf(x, attention_mask=valid.long(), position_ids=positions).logits
    diff = float((got[valid] - want[valid]).abs().max())
    print(f"qwen3_5_moe logits max|diff| {side}-padded {diff:.1e}")
    assert diff <= 1e-4


def test_export_loads_back_in_transformers(pair, tmp_path: Path):
    from safetensors.torch import load_file

    hf, ours, _ = pair
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert (
        "model.layers.0.mlp.experts.3.down_proj.weight" in names
        and "model.layers.0.mlp.shared_expert_gate.weight" in names
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    x = _tokens()
    with torch.no_grad():
        diff = float((back(x).logits - hf(x).logits).abs().max())
    print(f"qwen3_5_moe export reloaded in transformers: logits max|diff| {diff:.1e}")
    assert diff <= 1e-5
    again = _import(tmp_path / "out")
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_multimodal_layout_imports_its_text_model(pair, tmp_path: Path):
    """A qwen3_5_moe (image-text) folder: text_config, weights under model.language_model, a vision tower."""
    from safetensors.torch import load_file, save_file

    hf, ours, folder = pair
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": False}  # fmt: skip
    sd = {
        k.replace("model.", "model.language_model.", 1): v for k, v in load_file(folder / "model.safetensors").items()
    }
    sd |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    (tmp_path / "vl").mkdir()
    save_file(sd, str(tmp_path / "vl" / "model.safetensors"))
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config))
    again = _import(tmp_path / "vl")
    assert again.cfg.family == "qwen3_5_moe"
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_greedy_decoding_with_the_cache_equals_transformers(pair):
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    hf, ours, _ = pair
    prompts = [[5, 17, 33, 2, 60, 41], [7, 8, 9], [11]]
    cfg = SamplerConfig(generation="causal", gen_length=8, temperature=0.0, stop_at_eos=False)
    got = generate(ours, prompts, cfg, SpecialIds(mask_id=V - 1, pad_id=0, eos_id=V - 2, num_tokens=V))
    with torch.no_grad():  # the causal loop never predicts the mask id: nor may transformers here
        want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                            suppress_tokens=[V - 1])[0, len(p) :].tolist() for p in prompts]  # fmt: skip
    assert got.sequences == want


def test_a_layout_without_its_gated_shared_expert_does_not_export(tmp_path: Path):
    from dllm.config.model import ModelConfig
    from dllm.errors import ConfigError

    cfg = ModelConfig(family="qwen3_5_moe", preset="tiny", vocab_size=V, num_layers=4, shared_expert_gate=False)
    model = Transformer(cfg)
    with pytest.raises(ConfigError, match="one sigmoid-gated shared expert"):
        export_hf(model.state_dict(), cfg, tmp_path / "out")


def test_a_shared_expert_gate_without_shared_experts_is_refused():
    from pydantic import ValidationError

    from dllm.config.model import ModelConfig

    with pytest.raises(ValidationError, match="shared_expert_gate gates the shared experts"):
        ModelConfig(family="qwen3_5_moe", preset="tiny", vocab_size=V, num_shared_experts=0)
