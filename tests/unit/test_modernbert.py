"""ModernBERT checkpoints: a tiny random transformers ModernBertForMaskedLM, saved and imported, gives the
same logits (bidirectional; global and sliding-window layers with their own RoPE bases; with and without
padding); the exported folder loads back in transformers with the same logits and the same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")

V, L = 96, 20


def _hf_model(**extra):
    cfg = transformers.ModernBertConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2,
        local_attention=8, global_attn_every_n_layers=3, **extra,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},  # far apart
    )  # fmt: skip
    cfg._attn_implementation = "eager"  # the plain reference (additive float masks)
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(cfg)
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


@pytest.mark.parametrize("extra", [{}, {"norm_bias": True, "attention_bias": True, "mlp_bias": True,
                                        "classifier_bias": True, "tie_word_embeddings": False}])  # fmt: skip
def test_modernbert_logits_match_transformers(extra: dict, tmp_path: Path):
    hf = _hf_model(**extra)
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    cfg = ours.cfg
    assert cfg.family == "modernbert" and cfg.local_window == 5 and cfg.local_rope_theta == 100.0
    assert [cfg.layer_is_local(i) for i in range(4)] == [False, True, True, False]
    x = torch.randint(3, V, (2, L), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L).expand(2, L)
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x, pos, AttentionMask("bidirectional")).logits(), want, atol=1e-4, rtol=0)
        # padding: the second row holds 13 tokens; padded keys are never attended
        valid = torch.ones(2, L, dtype=torch.bool)
        valid[1, 13:] = False
        want = hf(x, attention_mask=valid.long()).logits
        got = ours(x, pos, AttentionMask("bidirectional", key_valid_BL=valid)).logits()
        torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=0)
        assert not torch.allclose(got[1, :13], ours(x, pos).logits()[1, :13], atol=1e-3)  # padding mattered


def test_modernbert_window_and_rope_bases_matter(tmp_path: Path):
    """The parity above is not an accident of a window wider than the sequence or equal RoPE bases."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    x = torch.randint(3, V, (1, L), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(L)[None]
    with torch.no_grad():
        base = ours(x, pos).logits()
        for change in ({"local_window": None, "attention_pattern": None}, {"local_rope_theta": None}):
            other = Transformer(ours.cfg.model_copy(update=change))
            other.load_state_dict(ours.state_dict())
            assert not torch.allclose(other.eval()(x, pos).logits(), base, atol=1e-3), change


def test_modernbert_export_round_trip(tmp_path: Path):
    from safetensors.torch import load_file

    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    original, exported = (
        load_file(str(tmp_path / "hf" / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert original.keys() == exported.keys()
    for k, v in original.items():
        assert torch.equal(v, exported[k]), k
    back = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(back).__name__ == "ModernBertForMaskedLM"
    assert back.config.layer_types == hf.config.layer_types and back.config.sliding_window == hf.config.sliding_window
    x = torch.randint(3, V, (2, L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)
