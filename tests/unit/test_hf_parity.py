"""Hugging Face checkpoints in and out: tiny random transformers models, saved and imported, give the
same logits as transformers (causal, and bidirectional with is_causal=False); exported folders load
back in transformers with the same logits. LLaDA and Dream (remote-code layouts) round-trip through
their name maps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")

V, L = 96, 12
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _hf_model(family: str):
    t = transformers
    builders = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**COMMON, tie_word_embeddings=False)),
        "llama_tied_bias": lambda: t.LlamaForCausalLM(
            t.LlamaConfig(**COMMON, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)
        ),
        "qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**COMMON)),
        "qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**COMMON, head_dim=8)),
        "qwen3_moe": lambda: t.Qwen3MoeForCausalLM(
            t.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        ),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
        ),  # fmt: skip
        "bert": lambda: t.BertForMaskedLM(
            t.BertConfig(
                vocab_size=V,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                max_position_embeddings=64,
            )  # fmt: skip
        ),
    }
    torch.manual_seed(0)
    model = builders[family]()
    with torch.no_grad():  # transformers zero-initialises biases and norms: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


@pytest.fixture
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    return x, torch.arange(L).expand(2, L)


FAMILIES = ["llama", "llama_tied_bias", "qwen2", "qwen3", "qwen3_moe", "gpt2", "bert"]


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers(family: str, tmp_path: Path, tokens):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    x, pos = tokens
    with torch.no_grad():
        if family == "bert":  # an encoder: bidirectional is its native mode
            torch.testing.assert_close(
                ours(x, pos, AttentionMask("bidirectional")).logits(), hf(x).logits, atol=1e-4, rtol=0
            )
            return
        torch.testing.assert_close(ours(x, pos, AttentionMask("causal")).logits(), hf(x).logits, atol=1e-4, rtol=0)
        bidir_ref = hf(x, attention_mask=torch.ones_like(x), is_causal=False).logits
        if family != "gpt2":  # GPT-2's attention ignores is_causal; its causal parity is checked above
            torch.testing.assert_close(
                ours(x, pos, AttentionMask("bidirectional")).logits(), bidir_ref, atol=1e-4, rtol=0
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_back_in_transformers(family: str, tmp_path: Path, tokens):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    back = auto.from_pretrained(str(tmp_path / "out")).eval()
    x, _ = tokens
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_remote_code_layouts_round_trip(family: str, tmp_path: Path, tokens):
    """No transformers class exists for these: export in their layout, import, same logits."""
    cfg = ModelConfig(family=family, preset="tiny", vocab_size=V, max_seq_len=64)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    folder = export_hf(model.state_dict(), cfg, tmp_path / family)
    again = _import(folder)
    assert again.cfg.family == family and again.cfg.shift_logits == (family == "dream")
    x, pos = tokens
    with torch.no_grad():
        torch.testing.assert_close(again(x, pos).logits(), model(x, pos).logits(), atol=0, rtol=0)


def test_llada_checkpoint_names(tmp_path: Path):
    cfg = ModelConfig(family="llada", preset="tiny", vocab_size=V)
    model = Transformer(cfg)
    export_hf(model.state_dict(), cfg, tmp_path / "llada")
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "llada" / "model.safetensors")))
    expected = {"model.transformer.wte.weight", "model.transformer.ln_f.weight", "model.transformer.ff_out.weight"}
    block = "model.transformer.blocks.0."
    expected |= {block + n for n in ("attn_out.weight", "ff_proj.weight", "up_proj.weight", "ff_out.weight",
                                     "attn_norm.weight", "ff_norm.weight")}  # fmt: skip
    assert expected <= keys


def test_dream_shift_is_applied_by_the_loss_not_the_model(tokens):
    """Dream predicts token i from the state at i-1. The model returns unshifted states (its decode
    profile says `shift`); the MDLM loss reads state i-1 for target i, position 0 its own state."""
    from dllm.config.objectives import MDLMConfig
    from dllm.data.loader import Batch
    from dllm.diffusion.corruption import NoiseKeys
    from dllm.diffusion.objectives import MDLMObjective, TokenIds

    cfg = ModelConfig(family="dream", preset="tiny", vocab_size=V)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    x, pos = tokens
    unshifted = Transformer(cfg.model_copy(update={"shift_logits": False}))
    unshifted.load_state_dict(model.state_dict())
    with torch.no_grad():
        out = model(x, pos, AttentionMask("bidirectional"))
        torch.testing.assert_close(out.hidden_BLE, unshifted(x, pos, AttentionMask("bidirectional")).hidden_BLE)
    ids = TokenIds(mask_id=V - 1, eos_id=1, pad_id=0, num_tokens=V - 1)
    batch = Batch(x, torch.ones_like(x, dtype=torch.bool), torch.arange(2))
    obj = MDLMObjective(MDLMConfig(), ids, chunked_loss=False, shift_logits=True)
    inputs = obj.prepare(batch, NoiseKeys(0, 2))
    assert inputs.loss_rows.tolist() == [[0] + list(range(L - 1))] * 2
    with torch.no_grad():
        out = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask)
        shifted = torch.cat([out.logits()[:, :1], out.logits()[:, :-1]], dim=1)  # row i: the state at i-1
        sel = inputs.weights_BL > 0
        logits = shifted[sel].index_fill(-1, torch.tensor([ids.mask_id]), float("-inf"))
        ce = torch.nn.functional.cross_entropy(logits, inputs.targets_BL[sel], reduction="none")
        want = (ce * inputs.weights_BL[sel]).sum()
        torch.testing.assert_close(obj.loss(out, inputs).loss_sum, want, atol=1e-4, rtol=1e-5)


def test_moe_aux_loss_and_routing(tokens):
    cfg = ModelConfig(family="qwen3_moe", preset="tiny", vocab_size=V, num_experts=4, num_experts_per_tok=2)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    x, pos = tokens
    out = model(x, pos)
    logits, aux = out.logits(), out.aux["router_loss"]
    assert aux.ndim == 0
    # balanced routing gives 1 (uniform load and probabilities); anything else is larger
    assert float(aux.detach()) >= 1.0 - 1e-4
    (logits.sum() + aux).backward()
    assert model.layers[0].mlp.gate.weight.grad is not None


def test_sharded_checkpoint_imports(tmp_path: Path, tokens):
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    ours = _import(tmp_path / "hf")
    x, pos = tokens
    with torch.no_grad():
        torch.testing.assert_close(ours(x, pos, AttentionMask("causal")).logits(), hf(x).logits, atol=1e-4, rtol=0)
