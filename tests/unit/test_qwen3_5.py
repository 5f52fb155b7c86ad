"""Qwen3.5 (the hybrid text model): a small random transformers Qwen3_5ForCausalLM (linear and full
attention layers), saved and imported, gives the same logits (float32, 1e-4), unpadded and with left or
right padding; an export loads back in transformers with the same logits; the multimodal release's
layout imports; what the recurrent layers cannot do is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf
from dllm.models.sizing import count_params

transformers = pytest.importorskip("transformers")

V, L = 96, 80  # longer than one chunk (64) of the gated delta rule


def _hf_model():
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
        linear_num_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # zero-initialised norms and ones: make every weight matter
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
    folder = tmp_path_factory.mktemp("qwen3_5") / "hf"
    hf = _hf_model()
    hf.save_pretrained(folder)
    return hf, _import(folder), folder


def _tokens(B: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))


def test_config_and_size(pair):
    hf, ours, _ = pair
    cfg = ours.cfg
    assert cfg.family == "qwen3_5" and [cfg.layer_kind(i) for i in range(4)] == ["linear"] * 3 + ["global"]
    assert cfg.rotary_dim == 4 and cfg.attn_output_gate and cfg.norm == "rmsnorm_centered"
    assert count_params(cfg) == ours.num_params() == sum(p.numel() for p in hf.parameters())


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    x = _tokens()
    with torch.no_grad():
        got = ours(x, torch.arange(L).expand(2, L), AttentionMask("causal")).logits()
        want = hf(x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_logits_match_transformers(pair, side: str):
    """transformers zeroes padding's inputs to the linear layers; ours also keeps the state through it, so
    a padded row gives its unpadded logits (left padding exactly what an unpadded row gives)."""
    hf, ours, _ = pair
    x = _tokens()
    valid = torch.ones(2, L, dtype=torch.bool)
    pad = torch.arange(L) < 9 if side == "left" else torch.arange(L) >= L - 9
    valid[1] = ~pad
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        got = ours(x, positions, AttentionMask("causal", key_valid_BL=valid)).logits()
        want = hf(x, attention_mask=valid.long(), position_ids=positions).logits
        alone = ours(x[1:, valid[1]], torch.arange(L - 9)[None], AttentionMask("causal")).logits()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1, valid[1]], alone[0], atol=1e-5, rtol=0)


def test_export_loads_back_in_transformers(pair, tmp_path: Path):
    hf, ours, _ = pair
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)
    again = _import(tmp_path / "out")
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_multimodal_layout_imports_its_text_model(pair, tmp_path: Path):
    """A qwen3_5 (image-text) folder: text_config, weights under model.language_model, a vision tower."""
    from safetensors.torch import load_file, save_file

    hf, ours, folder = pair
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": False}  # fmt: skip
    sd = {
        k.replace("model.", "model.language_model.", 1): v for k, v in load_file(folder / "model.safetensors").items()
    }
    sd |= {"model.visual.patch_embed.proj.weight": torch.zeros(4, 3), "mtp.fc.weight": torch.zeros(2, 2)}
    (tmp_path / "vl").mkdir()
    save_file(sd, str(tmp_path / "vl" / "model.safetensors"))
    (tmp_path / "vl" / "config.json").write_text(json.dumps(config))
    again = _import(tmp_path / "vl")
    x = _tokens()
    with torch.no_grad():
        pos = torch.arange(L).expand(2, L)
        torch.testing.assert_close(again(x, pos, AttentionMask("causal")).logits(),
                                   ours(x, pos, AttentionMask("causal")).logits(), atol=0, rtol=0)  # fmt: skip


def test_native_model_trains_and_refuses_what_a_recurrence_cannot_do():
    cfg = ModelConfig(family="qwen3_5", preset="tiny", vocab_size=V, num_layers=4)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    x, pos = _tokens(), torch.arange(L).expand(2, L)
    out = model(x, pos, AttentionMask("causal"))
    out.logits().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="linear-attention layers run causally"):
        model(x, pos, AttentionMask("bidirectional"))
    with pytest.raises(ValueError, match="documents"):
        model(x, pos, AttentionMask("causal", doc_ids_BL=torch.zeros(2, L, dtype=torch.long)))
