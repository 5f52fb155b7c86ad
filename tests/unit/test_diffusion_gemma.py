"""DiffusionGemma against transformers' DiffusionGemmaForBlockDiffusion: a tiny random reference (float32)
saved and imported gives the same canvas logits (and encoder states) from one native forward over
[clean ; canvas] with a prefix_canvas mask, with and without left padding and self-conditioning logits;
an exported folder loads back in transformers with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf
from dllm.models.output import CanvasConditioned

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.diffusion_gemma")

V, P, C, W = 96, 7, 8, 4  # vocabulary, clean length, canvas length, sliding window (< P: windows matter)
TEXT = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=W,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=64,
    num_experts=4, top_k_experts=2, moe_intermediate_size=16,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000000.0},
    },
)  # fmt: skip
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, position_embedding_size=8, patch_size=2,
              pooling_kernel_size=1)  # fmt: skip


def _reference(tied: bool = True, vocab_size: int = V):
    """`tied=False`: an untied head, which unties the reference's encoder from its decoder too; the encoder is
    then given the decoder's values (the native model runs one stack for both)."""
    from transformers.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    text = {**TEXT, "vocab_size": vocab_size}
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=VISION, canvas_length=C, tie_word_embeddings=tied)
    model = DiffusionGemmaForBlockDiffusion(cfg).eval()
    with torch.no_grad():  # norms start at 1 and router scales at 1: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        decoder, encoder = model.model.decoder, model.model.encoder.language_model
        for dec, enc in zip(decoder.layers, encoder.layers, strict=True):  # buffers, not tied: set both alike
            dec.layer_scalar.fill_(float(torch.rand(())) + 0.5)
            enc.layer_scalar.copy_(dec.layer_scalar)
        if not tied:
            enc_state = encoder.state_dict()
            for k, v in decoder.state_dict().items():
                if k in enc_state:
                    enc_state[k].copy_(v)
    return model


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder).model_copy(update={"attention_backend": "sdpa"})
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


def _inputs(padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, V, (2, P), generator=g)
    valid = torch.ones(2, P, dtype=torch.bool)
    if padded:
        valid[1, :3] = False  # left padding of the second prompt
        clean[1, :3] = 0
    return {"clean": clean, "valid": valid, "canvas": torch.randint(0, V, (2, C), generator=g)}


def _ours(model: Transformer, x: dict[str, torch.Tensor], logits_BCV=None, on_B=None):
    tokens = torch.cat([x["clean"], x["canvas"]], dim=1)
    key_valid = torch.cat([x["valid"], torch.ones(2, C, dtype=torch.bool)], dim=1)
    mask = AttentionMask("prefix_canvas", key_valid_BL=key_valid, block_size=C, num_clean=P, canvas_start=P)
    if logits_BCV is not None:
        tokens = CanvasConditioned(tokens, logits_BCV, on_B)
    return model(tokens, torch.arange(P + C).expand(2, -1), mask)


def _theirs(hf, x: dict[str, torch.Tensor], logits_BCV=None, on_B=None):
    decoder_mask = torch.nn.functional.pad(x["valid"], (0, C), value=True)
    return hf(input_ids=x["clean"], attention_mask=x["valid"], decoder_input_ids=x["canvas"],
              decoder_attention_mask=decoder_mask, self_conditioning_logits=logits_BCV,
              self_conditioning_mask=on_B)  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dgemma") / "hf"
    hf = _reference()
    hf.save_pretrained(folder)
    return hf, _import(folder), folder


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("padded", [False, True])
def test_canvas_logits_match_transformers(pair, padded: bool):
    hf, ours, _ = pair
    x = _inputs(padded)
    with torch.no_grad():
        ref = _theirs(hf, x)
        out = _ours(ours, x)
        logits = out.logits()
    assert logits.shape == (2, P + C, V)
    assert _max_diff(logits[:, P:], ref.logits) <= 1e-4
    valid = x["valid"]  # the encoder's final states at the real (not padded) clean rows
    assert _max_diff(out.hidden_BLE[:, :P][valid], ref.encoder_last_hidden_state[valid]) <= 1e-4


@pytest.mark.parametrize("padded", [False, True])
def test_self_conditioning_matches_transformers(pair, padded: bool):
    hf, ours, _ = pair
    x = _inputs(padded)
    previous = torch.randn(2, C, V, generator=torch.Generator().manual_seed(2)) * 3
    on = torch.tensor([True, False])
    with torch.no_grad():
        for on_B in (None, on):
            ref = _theirs(hf, x, previous, on_B).logits
            assert _max_diff(_ours(ours, x, previous, on_B).logits()[:, P:], ref) <= 1e-4
        assert _max_diff(_theirs(hf, x, previous).logits, _theirs(hf, x).logits) > 1e-3  # the signal matters


def test_export_loads_back_in_transformers(pair, tmp_path: Path):
    hf, ours, _ = pair
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path / "out")).eval()
    x = _inputs(padded=True)
    with torch.no_grad():
        assert _max_diff(_theirs(back, x).logits, _theirs(hf, x).logits) <= 1e-5
    again = _import(tmp_path / "out")
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_untied_export_writes_every_weight(tmp_path: Path):
    """An untied head unties the reference's encoder as well: the export writes the encoder's weights, so
    transformers loads the folder with our logits (not a random encoder), and it imports back equal."""
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    hf = _reference(tied=False)
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    assert not ours.cfg.tie_embeddings
    x = _inputs(padded=True)
    with torch.no_grad():
        assert _max_diff(_ours(ours, x).logits()[:, P:], _theirs(hf, x).logits) <= 1e-4
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    back = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path / "out")).eval()
    assert not back.config.tie_word_embeddings
    with torch.no_grad():
        assert _max_diff(_theirs(back, x).logits, _ours(ours, x).logits()[:, P:]) <= 1e-4
    again = _import(tmp_path / "out")
    assert again.cfg == ours.cfg
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_parameter_count_and_dense_layout(pair):
    """count_params is exact for the imported MoE layout (global layers of their own shape, values from
    the key projection) and for a dense DiffusionGemma, which runs but has no Hugging Face layout (its
    stack without the canvas block is Gemma 4's text model: tests/unit/test_diffusion_gemma_gemma4.py)."""
    from dllm.config.model import ModelConfig
    from dllm.errors import ConfigError
    from dllm.models.sizing import count_params

    _, ours, folder = pair
    assert count_params(ours.cfg) == ours.num_params() and ours.cfg.canvas_length == C
    dense_cfg = ModelConfig(family="diffusion_gemma", preset="tiny", vocab_size=V, num_layers=6, local_window=W,
                            global_head_dim=32, global_num_kv_heads=1, attention_backend="sdpa")  # fmt: skip
    dense = Transformer(dense_cfg)
    dense.init_weights(torch.Generator().manual_seed(0))
    assert count_params(dense_cfg) == dense.num_params()
    with torch.no_grad():
        logits = _ours(dense, _inputs(padded=True)).logits()
    assert bool(torch.isfinite(logits[:, P:]).all()) and float(logits.abs().max()) <= 30.0  # soft-capped
    with pytest.raises(ConfigError, match="^--to-hf: a dense DiffusionGemma has no Hugging Face layout"):
        export_hf(dense.state_dict(), dense_cfg, folder.parent / "dense")


def _allowed(num_clean: int, canvas_len: int, block: int, start: int, window: int | None) -> torch.Tensor:
    """The prefix_canvas rule written out pair by pair: clean rows causal (within the window); canvas
    row j attends the clean rows before its block's clean position (the last window - 1 of them) and its block."""
    L, reach = num_clean + canvas_len, window or 10**9
    out = torch.zeros(L, L, dtype=torch.bool)
    for q in range(L):
        for kv in range(L):
            if q < num_clean:
                out[q, kv] = kv <= q and q - kv < reach
            elif kv < num_clean:
                s = start + (q - num_clean) // block * block
                out[q, kv] = kv < s and s - kv < reach
            else:
                out[q, kv] = (q - num_clean) // block == (kv - num_clean) // block
    return out


@pytest.mark.parametrize("layout", ["sampling", "training"])
@pytest.mark.parametrize("window", [None, 3])
def test_prefix_canvas_mask_and_backends(layout: str, window: int | None):
    from dllm.attention.backends import make_attention
    from dllm.attention.masks import dense_mask, mask_mod
    from dllm.config.registries import ATTENTION_BACKENDS

    num_clean, canvas_len, block, start = (5, 4, 4, 5) if layout == "sampling" else (8, 8, 4, 0)
    L = num_clean + canvas_len
    mask = AttentionMask("prefix_canvas", block_size=block, num_clean=num_clean, canvas_start=start, window=window)
    got = dense_mask(mask_mod(mask, L), 1, L, L, torch.device("cpu"))[0, 0]
    assert torch.equal(got, _allowed(num_clean, canvas_len, block, start, window))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, L, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    ref = make_attention("sdpa", False)(q, k, v, mask)
    for name in ATTENTION_BACKENDS.names():
        torch.testing.assert_close(make_attention(name, False)(q, k, v, mask), ref, atol=1e-10, rtol=1e-10)
