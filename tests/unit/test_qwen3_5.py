"""Qwen3.5 (the hybrid text model): a small random transformers Qwen3_5ForCausalLM (linear and full
attention layers), saved and imported, gives the same logits (float32, 1e-4), unpadded and with left or
right padding; an export loads back in transformers with the same logits; the multimodal release's
layout imports; what the recurrent layers cannot do is refused in one line. Block diffusion on the
hybrid: a noisy block in training reads what it reads when decoded, cached block decoding equals
uncached decoding token for token, and Fast-dLLM v2 trains it."""

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


def _native(seed: int = 0, dtype: torch.dtype = torch.float64) -> Transformer:
    """A random native qwen3_5 (three linear layers, one attention layer); float64 so that paths that add in
    different orders cannot flip a greedy choice."""
    cfg = ModelConfig(family="qwen3_5", preset="tiny", vocab_size=V, num_layers=4, init_std=0.2)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # a spread of decays and conv taps, not the initial constants
        for layer in model.layers[:3]:
            layer.linear_attn.A_log.normal_(0, 1, generator=torch.Generator().manual_seed(1))
            layer.linear_attn.dt_bias.normal_(0, 1, generator=torch.Generator().manual_seed(2))
    return model.to(dtype).eval()


def test_native_model_trains_and_refuses_what_a_recurrence_cannot_do():
    model = _native(dtype=torch.float32).train()
    x, pos = _tokens(), torch.arange(L).expand(2, L)
    out = model(x, pos, AttentionMask("causal"))
    out.logits().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    with pytest.raises(ValueError, match="no sliding window"):
        model(x, pos, AttentionMask("causal", window=4))
    with pytest.raises(ValueError, match="per-row offsets"):
        model(x, pos, AttentionMask("causal", query_offset_B=torch.zeros(2, dtype=torch.long)))


@pytest.mark.parametrize("kind", ["causal", "block_diffusion"])
def test_documents_restart_the_linear_layers(kind: str):
    """Two documents in a row: the second one's outputs are those of the second document alone."""
    model, n, b = _native(), 24, 4
    x = _tokens()[:, :n]
    docs = (torch.arange(n) >= 8).long().expand(2, n)  # a document of 8 tokens, then one of 16

    x_t = torch.where(torch.arange(n) % 3 == 0, V - 1, x)

    def run(tokens: torch.Tensor, noisy: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        m = tokens.shape[1]
        pos = torch.arange(m) if doc_ids is None else torch.cat([torch.arange(8), torch.arange(m - 8)])
        if kind == "causal":
            return model(tokens, pos.expand(2, m), AttentionMask("causal", doc_ids_BL=doc_ids)).hidden_BLE
        mask = AttentionMask("block_diffusion", block_size=b, doc_ids_BL=doc_ids)
        return model(torch.cat([noisy, tokens], 1), pos.repeat(2).expand(2, 2 * m), mask).hidden_BLE

    with torch.no_grad():
        both, alone = run(x, x_t, docs), run(x[:, 8:], x_t[:, 8:], None)
    if kind == "causal":
        torch.testing.assert_close(both[:, 8:], alone, atol=1e-10, rtol=0)
    else:  # noisy and clean halves of the second document
        torch.testing.assert_close(both[:, 8:n], alone[:, : n - 8], atol=1e-10, rtol=0)
        torch.testing.assert_close(both[:, n + 8 :], alone[:, n - 8 :], atol=1e-10, rtol=0)


def test_noisy_block_in_training_reads_what_decoding_reads():
    """Block diffusion's 2L layout: the outputs of noisy block k equal those of a forward over the clean
    blocks before it followed by that noisy block (the canvas at decoding time, block-causal mask)."""
    model, b, n = _native(), 4, 16
    clean = _tokens()[:, :n]
    noisy = torch.where(torch.rand(2, n, generator=torch.Generator().manual_seed(3)) < 0.5, V - 1, clean)
    pos = torch.arange(n).repeat(2).expand(2, 2 * n)
    with torch.no_grad():
        both = model(torch.cat([noisy, clean], 1), pos, AttentionMask("block_diffusion", block_size=b)).hidden_BLE
        for k in range(n // b):
            canvas = torch.cat([clean[:, : k * b], noisy[:, k * b : (k + 1) * b]], 1)
            mask = AttentionMask("block_causal", block_size=b)
            alone = model(canvas, torch.arange((k + 1) * b).expand(2, -1), mask).hidden_BLE
            torch.testing.assert_close(both[:, k * b : (k + 1) * b], alone[:, k * b :], atol=1e-10, rtol=0)
        # the linear layers run the clean half causally: each clean row is what a causal pass over x_0 gives
        linear_only = _native()
        linear_only.layers = linear_only.layers[:3]  # the attention layer is block-causal on x_0, not causal
        got = linear_only(torch.cat([noisy, clean], 1), pos, AttentionMask("block_diffusion", block_size=b))
        want = linear_only(clean, torch.arange(n).expand(2, n), AttentionMask("causal"))
        torch.testing.assert_close(got.hidden_BLE[:, n:], want.hidden_BLE, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shift,sub_block", [("off", None), ("on", None), ("on", 2)])
def test_cached_block_decoding_equals_uncached(shift: str, sub_block: int | None):
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    model = _native()
    special = SpecialIds(mask_id=V - 1, pad_id=V - 2, eos_id=V - 3, num_tokens=V - 3)
    # prompts of different lengths: the canvas pads them (a document of their own) to whole blocks
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]

    def run(cache: str, rows: list[list[int]]):
        cfg = SamplerConfig(gen_length=12, block_length=4, steps=12, stop_at_eos=False, shift=shift, cache=cache,
                            attention="block", policy="low_confidence", sub_block_length=sub_block)  # fmt: skip
        return generate(model, rows, cfg, special, generator=torch.Generator().manual_seed(0))

    plain, cached = run("none", prompts), run("block", prompts)
    assert cached.sequences == plain.sequences
    assert cached.counters.cached_tokens > 0 and cached.counters.query_tokens < plain.counters.query_tokens
    for i, prompt in enumerate(prompts):  # a padded row decodes as the prompt alone
        assert run("block", [prompt]).sequences[0] == plain.sequences[i], i


def test_fast_dllm_v2_trains_the_hybrid():
    """A few steps of Fast-dLLM v2 on a fixed batch: the loss falls."""
    from dllm.config.objectives import FastDLLMv2Config
    from dllm.data.loader import Batch
    from dllm.diffusion.corruption import NoiseKeys
    from dllm.diffusion.objectives import TokenIds
    from dllm.diffusion.objectives.block import FastDLLMv2Objective

    torch.manual_seed(0)
    cfg = ModelConfig(family="qwen3_5", preset="tiny", vocab_size=V, num_layers=4)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = TokenIds(mask_id=V - 1, eos_id=1, pad_id=0, num_tokens=V - 1)
    # linear-attention layers take one x_t per row (training/build.py passes shared_clean=False for them)
    obj = FastDLLMv2Objective(
        FastDLLMv2Config(block_size=8, sub_block_size=4), ids, chunked_loss=False, shared_clean=False
    )
    pattern = torch.arange(32) % 7 + 2  # a learnable sequence
    batch = Batch(pattern.expand(4, 32).clone(), torch.ones(4, 32, dtype=torch.bool), torch.arange(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        inputs = obj.prepare(batch, NoiseKeys(step, 4))
        out = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask)
        loss = obj.loss(out, inputs).loss_sum / obj.normalizer(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    print("fast_dllm_v2 losses", [round(v, 3) for v in losses[:3]], [round(v, 3) for v in losses[-3:]])
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_greedy_decoding_equals_transformers(pair):
    """The causal loop on the imported model (its ragged cache keeps the linear layers' states per row; more in
    tests/unit/test_hybrid_decoding.py) gives transformers' greedy continuation, which runs its own cache."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    hf, ours, _ = pair
    prompts = [[5, 17, 33, 2, 60, 41], [7, 8, 9, 10, 11, 12]]
    cfg = SamplerConfig(generation="causal", gen_length=8, temperature=0.0, stop_at_eos=False)
    got = generate(ours, prompts, cfg, SpecialIds(mask_id=V - 1, pad_id=0, eos_id=V - 2, num_tokens=V))
    with torch.no_grad():
        # the mask id (V - 1) is never a prediction of the causal loop: nor of transformers here
        want = hf.generate(
            torch.tensor(prompts), max_new_tokens=8, do_sample=False, eos_token_id=None, suppress_tokens=[V - 1]
        )
    assert got.sequences == want[:, 6:].tolist()


def test_a_bidirectional_canvas_is_refused():
    from dllm.config.sampler import SamplerConfig
    from dllm.errors import ConfigError
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    cfg = SamplerConfig(gen_length=4, block_length=4, steps=4, attention="bidirectional", shift="off")
    with pytest.raises(ConfigError, match="sampler.attention: a model with linear-attention layers"):
        generate(_native(), [[1, 2]], cfg, SpecialIds(mask_id=V - 1, pad_id=V - 2, eos_id=V - 3, num_tokens=V))


def test_the_hybrid_does_not_share_canvas_forwards():
    """The linear layers read a forward's last block as the noisy one, so a canvas right-padded to a longer
    one's length would decode its padding as the noisy block; and the batch's ragged cache keeps per-row states
    for causal decoding only. So the hybrid's requests run as calls of their own (the server takes turns between
    them)."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import shares_forwards

    model = _native()
    for cache in ("none", "block"):
        cfg = SamplerConfig(gen_length=8, block_length=4, shift="on", attention="block", cache=cache)
        assert not shares_forwards(cfg, model)  # a model without linear layers: tests/unit/test_canvas_batch.py
