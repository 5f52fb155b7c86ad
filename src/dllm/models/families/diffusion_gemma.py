"""DiffusionGemma (transformers' `diffusion_gemma`): a Gemma 4 stack used as encoder and as decoder.

The reference runs one stack of shared weights twice. The encoder runs it causally over the clean
sequence (sliding-window layers see the last `sliding_window` keys) and keeps every layer's keys and
values; the decoder runs it over the noised canvas, whose queries attend bidirectionally to the whole
canvas and to the encoder's cached keys (in sliding layers only the last `sliding_window - 1` of
them, what the sliding cache keeps). Only the decoder's canvas embeddings pass through the
self-conditioning block; logits are the tied head's, soft-capped.

Here that is one forward of the native Transformer over [clean ; canvas] with a `prefix_canvas`
AttentionMask (`num_clean` = clean length; `canvas_start` = num_clean for one canvas after the clean
stream): clean rows attend causally and never see the canvas, so their keys and values are exactly
the encoder's, and canvas rows attend to the clean rows the decoder's cache would hold plus their
canvas block. Positions are the reference's: the clean rows 0..P-1, the canvas P..P+C-1. The model
embeds the canvas rows (after `num_clean`) through the self-conditioning block, taking the previous
step's logits from `CanvasConditioned` tokens. Canvas rows' outputs are the decoder's logits, clean
rows' the encoder's (its next-token loss). The reference's forward takes `input_ids` + `attention_mask`
(the clean stream, left-padded), `decoder_input_ids` (the canvas), `decoder_attention_mask` (clean
mask + canvas) and optionally `self_conditioning_logits` / `self_conditioning_mask`: here the tokens,
`key_valid_BL` and `CanvasConditioned(ids, logits, on_B)`. Training lays every response block of a
row out at once (`canvas_start` 0, blocks aligned by `canvas_origin_B`, diffusion/objectives/
diffusion_gemma.py); decoding keeps the clean rows' keys and values in a KV cache, as the reference's
encoder cache (sampling/canvas_denoiser.py).

On disk only the decoder's text weights are read (the encoder's are tied to them; a differing copy is
refused); the vision tower is not part of the native model and is skipped. Every reference layer has
a dense MLP and routed experts beside it.

The same family reads Gemma 4's text model (transformers' `gemma4_text`, Gemma4ForCausalLM, or the text
part of the multimodal `gemma4` folder; dense, or MoE with `enable_moe_block`): a DiffusionGemma stack
without the self-conditioning block (`canvas_conditioning: false`), which computes exactly Gemma 4's
causal LM and exports back to a `gemma4_text` folder. AR-to-diffusion conversion switches the block on
(`model.canvas_conditioning: true` over such a checkpoint; models/pretrained.py adds it freshly
initialised). A dense model with the block has no Hugging Face layout (Gemma 4 has no self-conditioning
block, DiffusionGemma has experts in every layer), so its export is refused.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict, drop_tied_head

_LAYER = "model.decoder.layers.{}"
_RENAMES = (
    (r"embed_tokens\.weight", "model.decoder.embed_tokens.weight"),
    (r"norm\.weight", "model.decoder.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"canvas_cond\.(.+)", "model.decoder.self_conditioning.{}"),
    (r"layers\.(\d+)\.attn_out_norm\.weight", f"{_LAYER}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", f"{_LAYER}.pre_feedforward_layernorm.weight"),
    (r"layers\.(\d+)\.mlp_out_norm\.weight", f"{_LAYER}.post_feedforward_layernorm.weight"),
    (r"layers\.(\d+)\.layer_scale", f"{_LAYER}.layer_scalar"),
    (r"layers\.(\d+)\.beside\.dense_out_norm\.weight", f"{_LAYER}.post_feedforward_layernorm_1.weight"),
    (r"layers\.(\d+)\.beside\.experts_in_norm\.weight", f"{_LAYER}.pre_feedforward_layernorm_2.weight"),
    (r"layers\.(\d+)\.beside\.experts_out_norm\.weight", f"{_LAYER}.post_feedforward_layernorm_2.weight"),
    (r"layers\.(\d+)\.beside\.(router|experts)\.(.+)", f"{_LAYER}.{{}}.{{}}"),
    (r"layers\.(\d+)\.(self_attn|mlp|input_layernorm)\.(.+)", f"{_LAYER}.{{}}.{{}}"),
)
_ENCODER = re.compile(r"model\.encoder\.language_model\.(.+)")
# Gemma 4's text weights: Gemma4ForCausalLM's (model.*), or the multimodal folder's language model
_GEMMA4_TEXT = re.compile(r"model\.(?:language_model\.)?((?:embed_tokens|layers|norm)\..+)")
_GEMMA4_TYPES = ("gemma4_text", "gemma4")
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu"}


def _layer_types(tc: dict[str, Any]) -> list[str]:
    """The reference's default: five sliding layers to one full, the last always full."""
    n = tc["num_hidden_layers"]
    types = list(tc.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    types[-1] = "full_attention"
    return types


def _global_shape(tc: dict[str, Any], types: list[str], values_are_keys: bool) -> tuple[Any, Any]:
    """(head width, key/value heads) of the full-attention layers: per_layer_config, else the global_* keys."""
    per_layer = tc.get("per_layer_config") or {}
    overrides = [per_layer.get(str(i)) or per_layer.get(i) or {} for i, t in enumerate(types) if t == "full_attention"]
    if any(o != overrides[0] for o in overrides) or any(
        per_layer.get(str(i)) or per_layer.get(i) for i, t in enumerate(types) if t != "full_attention"
    ):
        raise ConfigError(
            "model.init_from: per-layer shapes other than one for all full-attention layers are not supported"
        )
    head_dim = overrides[0].get("head_dim", tc.get("global_head_dim", 512))
    # without per_layer_config the reference gives full layers num_global_key_value_heads only when their values
    # are their keys (attention_k_eq_v; DiffusionGemma's always are)
    global_kv = tc.get("num_global_key_value_heads") if values_are_keys else None
    kv_heads = overrides[0].get("num_key_value_heads", global_kv)
    return head_dim, kv_heads


def _rope(tc: dict[str, Any]) -> dict[str, Any]:
    params = tc.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    local, full = params.get("sliding_attention") or {}, params.get("full_attention") or {}
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("model.init_from: sliding layers with RoPE other than default are not supported")
    kind, fraction = full.get("rope_type", "default"), full.get("partial_rotary_factor", 1.0)
    if (
        kind not in ("default", "proportional")
        or full.get("factor", 1.0) != 1.0
        or (kind == "default" and fraction != 1)
    ):
        raise ConfigError(f"model.init_from: full-attention RoPE {kind!r} with these settings is not supported")
    return {
        "local_rope_theta": local.get("rope_theta", 10000.0),
        "rope_theta": full.get("rope_theta", 1000000.0),
        "global_rope_fraction": fraction,
    }


def _text_fields(hf: dict[str, Any], tc: dict[str, Any], values_are_keys: bool) -> dict[str, Any]:
    """The fields DiffusionGemma's and Gemma 4's text configs share (the stack, its attention and RoPE)."""
    if tc.get("use_bidirectional_attention") == "all":
        raise ConfigError("model.init_from: a Gemma 4 stack with bidirectional attention is not supported")
    types = _layer_types(tc)
    head_dim, kv_heads = _global_shape(tc, types, values_are_keys)
    return {
        "vocab_size": tc["vocab_size"], "hidden_size": tc["hidden_size"], "num_layers": tc["num_hidden_layers"],
        "num_heads": tc["num_attention_heads"], "num_kv_heads": tc.get("num_key_value_heads"),
        "head_dim": tc.get("head_dim"), "intermediate_size": tc["intermediate_size"],
        "max_seq_len": tc.get("max_position_embeddings", 131072), "norm_eps": tc.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True) and tc.get("tie_word_embeddings", True)),
        "activation": _ACTIVATIONS[tc.get("hidden_activation", "gelu_pytorch_tanh")],
        "qkv_bias": bool(tc.get("attention_bias")), "attn_out_bias": bool(tc.get("attention_bias")),
        "attention_pattern": ["global" if t == "full_attention" else "local" for t in types],
        "local_window": tc.get("sliding_window", 512), "global_head_dim": head_dim, "global_num_kv_heads": kv_heads,
        "global_values_are_keys": values_are_keys, **_rope(tc),
    }  # fmt: skip


def _config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("model_type") in _GEMMA4_TYPES:
        return _gemma4_from_hf(hf)
    tc = hf["text_config"]
    if not tc.get("num_experts"):
        raise KeyError("num_experts")
    return {
        **_text_fields(hf, tc, values_are_keys=True), "num_experts": tc["num_experts"],
        "num_experts_per_tok": tc["top_k_experts"], "moe_intermediate_size": tc["moe_intermediate_size"],
        "final_logit_softcap": tc.get("final_logit_softcapping", 30.0), "canvas_length": hf.get("canvas_length", 256),
    }  # fmt: skip


def _gemma4_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's text model (the multimodal folder's text_config): the stack without a self-conditioning block.
    Gemma4TextConfig's defaults where a key is absent (per-layer embeddings on, no soft-capping)."""
    tc = hf["text_config"] if hf.get("model_type") == "gemma4" else hf
    refused = (
        (tc.get("hidden_size_per_layer_input", 256), "per-layer input embeddings (hidden_size_per_layer_input "
         f"{tc.get('hidden_size_per_layer_input', 256)}, Gemma 4's small sizes) are not supported; use a Gemma 4 "
         "text model without them (hidden_size_per_layer_input 0)"),
        (tc.get("num_kv_shared_layers", 0), f"num_kv_shared_layers {tc.get('num_kv_shared_layers')}: layers that "
         "reuse an earlier layer's keys and values are not supported"),
        (tc.get("final_logit_softcapping") is None, "final_logit_softcapping null: a Gemma 4 model without "
         "logit soft-capping is not supported (DiffusionGemma caps its logits)"),
    )  # fmt: skip
    for bad, message in refused:
        if bad:
            raise ConfigError(f"model.init_from: {message}")
    values_are_keys = bool(tc.get("attention_k_eq_v", False))
    fields = {**_text_fields(hf, tc, values_are_keys), "canvas_conditioning": False,
              "final_logit_softcap": tc["final_logit_softcapping"]}  # fmt: skip
    if tc.get("enable_moe_block"):
        fields.update(num_experts=tc["num_experts"], num_experts_per_tok=tc["top_k_experts"],
                      moe_intermediate_size=tc["moe_intermediate_size"])  # fmt: skip
    return fields


def _text_config(cfg: ModelConfig) -> dict[str, Any]:
    """The text config keys DiffusionGemma and Gemma 4 share."""
    types = ["sliding_attention" if cfg.layer_is_local(i) else "full_attention" for i in range(cfg.num_layers)]
    kv_heads, head_dim = cfg.layer_heads(local=False)
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.mlp_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
        "hidden_activation": {v: k for k, v in _ACTIVATIONS.items()}[cfg.activation], "layer_types": types,
        "sliding_window": cfg.local_window or 512, "num_experts": cfg.num_experts or None,
        "top_k_experts": cfg.num_experts_per_tok if cfg.num_experts else None,
        "moe_intermediate_size": cfg.expert_size if cfg.num_experts else None,
        "final_logit_softcapping": cfg.final_logit_softcap,
        "per_layer_config": {str(i): {"head_dim": head_dim, "num_key_value_heads": kv_heads}
                             for i, t in enumerate(types) if t == "full_attention"},
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": cfg.global_rope_fraction,
                               "rope_theta": cfg.rope_theta},
        },
    }  # fmt: skip


def _config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Gemma 4's text model without a self-conditioning block, else DiffusionGemma (which has experts)."""
    if cfg.num_experts and cfg.moe_layout != "beside_dense":
        raise ConfigError("--to-hf: Gemma 4 layers run their experts beside the dense MLP; this model's replace it")
    if cfg.layer_is_local(cfg.num_layers - 1):
        raise ConfigError("--to-hf: Gemma 4's last layer attends globally (transformers makes it so); this model's "
                          "is a sliding-window layer")  # fmt: skip
    if not cfg.canvas_conditioning:
        return {
            **_text_config(cfg), "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"],
            "attention_k_eq_v": cfg.global_values_are_keys, "enable_moe_block": bool(cfg.num_experts),
            "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "use_double_wide_mlp": False,
        }  # fmt: skip
    if not cfg.num_experts:
        raise ConfigError(
            "--to-hf: a dense DiffusionGemma has no Hugging Face layout (transformers' DiffusionGemma has experts "
            "in every layer, Gemma 4's text model no self-conditioning block); sample or serve it from its run "
            "(dllm generate --run RUN), which holds all of it"
        )
    if not cfg.global_values_are_keys:
        raise ConfigError("--to-hf: DiffusionGemma's full-attention layers take their values from the key "
                          "projection; this model's have a value projection")  # fmt: skip
    text = {"model_type": "diffusion_gemma_text", **_text_config(cfg)}
    return {"text_config": text, "tie_word_embeddings": cfg.tie_embeddings, "canvas_length": cfg.canvas_length or 256}


def _from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """Gemma 4's text weights under the decoder's names; of a DiffusionGemma, the decoder's text weights (the
    encoder's are tied to them: a copy that differs is refused)."""
    if not cfg.canvas_conditioning:
        renamed = {}
        for k, v in sd.items():
            m = _GEMMA4_TEXT.fullmatch(k)
            renamed[f"model.decoder.{m.group(1)}" if m else k] = v
        return drop_tied_head(renamed, cfg)
    out: StateDict = {}
    for k, v in sd.items():
        m = _ENCODER.fullmatch(k)
        if m is None:
            out[k] = v
            continue
        twin = sd.get(f"model.decoder.{m.group(1)}")
        if twin is not None and v.device.type != "meta" and not torch.equal(v, twin):
            raise ConfigError(
                f"model.init_from: encoder weight {k} differs from the decoder's; the stacks must be tied"
            )
    return drop_tied_head(out, cfg)


def _hf_name(name: str, cfg: ModelConfig) -> str:
    """Gemma4ForCausalLM's names (model.*) without a self-conditioning block, DiffusionGemma's (model.decoder.*)
    with it: of weights and of an adapter's modules alike."""
    return name if cfg.canvas_conditioning else re.sub(r"^model\.decoder\.", "model.", name)


def _to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """DiffusionGemma's encoder text weights written as copies of the decoder's (Gemma 4's text model has no
    encoder): the layer scalars always (buffers the reference never ties), and every weight when the head is
    untied, since `tie_word_embeddings: false` also unties the reference's encoder from its decoder."""
    if not cfg.canvas_conditioning:
        return sd
    shared = [k for k in sd if k.startswith("model.decoder.") and ".self_conditioning." not in k]
    for k in shared if not cfg.tie_embeddings else [k for k in shared if k.endswith("layer_scalar")]:
        sd[k.replace("model.decoder.", "model.encoder.language_model.", 1)] = sd[k].clone()
    return sd


def _causal_lm(cfg: ModelConfig) -> bool:
    """Without the canvas block the stack is Gemma 4's causal LM (exported as Gemma4ForCausalLM)."""
    return not cfg.canvas_conditioning


DIFFUSION_GEMMA = Family(
    "diffusion_gemma", ("diffusion_gemma", *_GEMMA4_TYPES), "DiffusionGemmaForBlockDiffusion", _causal_lm,
    _config_from_hf, _config_to_hf, _RENAMES, from_hf_extra=_from_hf, to_hf_extra=_to_hf, hf_name=_hf_name,
    ignore_hf=(r"model\.encoder\.(vision_tower|embed_vision)\..*",
               r"model\.(vision_tower|embed_vision|audio_tower|embed_audio)\..*"),
)  # fmt: skip
