"""GPT-2: learned positions, LayerNorm, Conv1D weights stored [in, out] and q, k, v fused in `c_attn`.

On import the Conv1D weights are transposed and `c_attn` is split into three pseudo keys
`attn.c_attn.{q,k,v}`, so that the rename table stays 1:1; export fuses and transposes them back.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict, drop_tied_head

_GPT2_RENAMES = (
    (r"embed_tokens\.weight", "transformer.wte.weight"),
    (r"embed_positions\.weight", "transformer.wpe.weight"),
    (r"norm\.(weight|bias)", "transformer.ln_f.{}"),
    (r"layers\.(\d+)\.input_layernorm\.(weight|bias)", "transformer.h.{}.ln_1.{}"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", "transformer.h.{}.ln_2.{}"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.q.{}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.k.{}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.v.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "transformer.h.{}.attn.c_proj.{}"),
    (r"layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", "transformer.h.{}.mlp.c_fc.{}"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", "transformer.h.{}.mlp.c_proj.{}"),
    (r"lm_head\.weight", "lm_head.weight"),
)
_CONV1D = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
_C_ATTN = re.compile(r"(transformer\.h\.\d+\.attn\.c_attn)\.(weight|bias)")


def _gpt2_from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        if re.search(r"\.attn\.(masked_)?bias$", k):  # causal-mask buffers of old checkpoints
            continue
        k = k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"  # GPT2Model-only files
        v = v.t().contiguous() if _CONV1D.fullmatch(k) else v
        m = _C_ATTN.fullmatch(k)
        if m:
            for part, chunk in zip("qkv", v.chunk(3, dim=0), strict=True):
                out[f"{m.group(1)}.{part}.{m.group(2)}"] = chunk.contiguous()
        else:
            out[k] = v
    return drop_tied_head(out, cfg)


def _gpt2_to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        m = re.fullmatch(r"(transformer\.h\.\d+\.attn\.c_attn)\.([qkv])\.(weight|bias)", k)
        if m and m.group(2) == "q":
            k = f"{m.group(1)}.{m.group(3)}"
            v = torch.cat([sd[f"{m.group(1)}.{p}.{m.group(3)}"] for p in "qkv"], dim=0)
        elif m:
            continue
        out[k] = v.t().contiguous() if _CONV1D.fullmatch(k) else v
    return out


def _gpt2_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise ConfigError("model.init_from: GPT-2 attention variants (scale by layer index) are not supported")
    act = hf.get("activation_function", "gelu_new")
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["n_embd"], "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"], "intermediate_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "max_seq_len": hf.get("n_positions", 1024), "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "activation": "gelu" if act == "gelu" else "gelu_tanh",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }  # fmt: skip


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": cfg.mlp_size, "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu" if cfg.activation == "gelu" else "gelu_new",
        "tie_word_embeddings": cfg.tie_embeddings,
    }  # fmt: skip


GPT2 = Family(
    "gpt2", ("gpt2",), "GPT2LMHeadModel", True, _gpt2_config_from_hf, _gpt2_config_to_hf, _GPT2_RENAMES,
    from_hf_extra=_gpt2_from_hf, to_hf_extra=_gpt2_to_hf,
)  # fmt: skip
