"""How big a model is before it is built: parameter counts from the config alone.

The preflight refuses a run whose weights and optimizer state cannot fit in memory, and `dllm convert`
refuses a config.json that describes an absurd model, before either allocates anything. Counting from
the config (Python integers, never overflowing) is exact for the native Transformer; a test checks
it against `Transformer.num_params()` for every family.
"""

from __future__ import annotations

import os

from dllm.config.model import ModelConfig

TRAIN_BYTES_PER_PARAM = 16
"""float32 weight + gradient + AdamW's two moments."""


def _norm_params(cfg: ModelConfig, dim: int) -> int:
    return dim * (2 if cfg.norm == "layernorm" and cfg.norm_bias else 1)


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def block_params(cfg: ModelConfig, index: int = 0) -> int:
    """Parameters of transformer block `index`: its token mixer (attention of its kind, or a linear-attention
    layer), its norms, the MLP and/or the experts (shared ones too)."""
    local, E = cfg.layer_is_local(index), cfg.hidden_size
    matrices = 3 if cfg.mlp == "gated" else 2
    dense = (matrices - 1) * _linear(E, cfg.mlp_size, cfg.mlp_bias) + _linear(cfg.mlp_size, E, cfg.mlp_bias)
    experts = E * cfg.num_experts + cfg.num_experts * 3 * cfg.expert_size * E
    S, bias = cfg.num_shared_experts * cfg.expert_size, cfg.mlp_bias  # the shared experts: one MLP
    experts += 2 * _linear(E, S, bias) + _linear(S, E, bias) + (E if cfg.shared_expert_gate else 0) if S else 0
    if not cfg.num_experts or index < cfg.first_dense_layers:
        mlp = dense
    elif cfg.moe_layout == "beside_dense":  # Gemma 4: router scales and three more norms
        mlp = dense + experts + E + cfg.num_experts + 3 * _norm_params(cfg, E)
    else:
        mlp = experts if cfg.num_experts else dense
    norms = (4 if cfg.sandwich_norm else 2) * _norm_params(cfg, E)
    if cfg.layer_kind(index) == "linear":
        return _linear_attention_params(cfg) + norms + mlp
    (K, D), H = cfg.layer_heads(local), cfg.num_heads
    gate = 2 if cfg.attn_output_gate else 1
    values = 0 if cfg.global_values_are_keys and not local else _linear(E, K * D, cfg.qkv_bias)
    attn = _linear(E, gate * H * D, cfg.qkv_bias) + _linear(E, K * D, cfg.qkv_bias) + values
    qk_norm = (H + K) * D if cfg.qk_norm_width == "full" else 2 * D
    attn += _linear(H * D, E, cfg.attn_out_bias) + (qk_norm if cfg.qk_norm else 0)
    return attn + norms + mlp


def _linear_attention_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet layer: q/k/v, z, a, b and output projections, the convolution, A_log, dt_bias, norm."""
    E, H, V = cfg.hidden_size, cfg.linear_value_heads, cfg.linear_value_dim
    C = 2 * cfg.linear_key_heads * cfg.linear_key_dim + H * V
    return E * C + 2 * E * H * V + 2 * E * H + C * cfg.linear_conv_kernel + 2 * H + V


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the model `cfg` describes (cfg.vocab_size must be resolved)."""
    assert cfg.vocab_size is not None, "resolve model.vocab_size first"
    E, V = cfg.hidden_size, cfg.vocab_size
    n = V * E + sum(count * block_params(cfg, i) for i, count in cfg.layer_classes())
    n += 2 * E * cfg.mlp_size + E * cfg.mlp_size + _norm_params(cfg, E) if cfg.canvas_conditioning else 0
    n += cfg.max_seq_len * E if cfg.position == "learned" else 0
    n += _norm_params(cfg, E) if cfg.embedding_norm else 0
    n += E * E if cfg.self_condition else 0
    n += (E * 3 + 3) + (E * E + E) if cfg.edit_head else 0  # Edit Flows: rate and insertion projections
    n += _norm_params(cfg, E) if cfg.final_norm else 0
    n -= 0 if cfg.first_layer_attn_norm else _norm_params(cfg, E)
    n += _linear(E, E, cfg.head_dense_bias) + _norm_params(cfg, E) + V if cfg.head == "mlm" else 0
    n += 0 if cfg.tie_embeddings else V * E
    return n


def format_bytes(n: float) -> str:
    """1.5 GB, 300 MB, ... (decimal units, as free and df print with -H)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / 1e3:,.1f} kB"


def host_memory_bytes() -> int:
    """Physical memory of this machine (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
