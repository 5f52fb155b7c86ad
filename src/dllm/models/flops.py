"""Model FLOPs of a training step, counted from the config and the layout the objective trains.

Only matrix products are counted (as torch.utils.flop_counter does): the linear layers, the attention
scores and values, and the LM head. A product of [m, k] and [k, n] is 2*m*k*n FLOPs; backward
computes the gradients of both operands, twice the forward, so a trained product costs 3x its
forward (PaLM, Chowdhery et al. 2022, appendix B: 6N per token plus 12 * layers * H * D * keys for
attention). Attention counts every (query, key) pair of the row, whatever the mask: the dense cost,
as PaLM counts causal attention, so a sparse kernel (FlexAttention, blockwise) that skips masked
pairs reports the same model FLOPs and a higher utilisation.

The layout says what one forward sees: `row_len` tokens per row (2L for the [x_t ; x_0] layout of
block objectives, 3L for fast_dllm_v2's two views over one clean stream), `rows` rows per data sequence
(fast_dllm_v2 in its two-row layout: 2), and the
last layer's queries (`last_queries`: BD3LM's loss reads only the noisy half, so the last block
computes queries, attention output and MLP for those L rows only, see Transformer.forward). The LM
head runs on the rows in the loss only (the masked positions, see diffusion weighted_ce), so its
FLOPs are counted per head row, apart from the body.

Not counted: MoE experts a token was not routed to (top-k experts count), the detached first pass of
self-conditioning, and the frozen-weight gradients LoRA skips (its backward is counted in full).

Shapes: E hidden, H query heads, K key/value heads, D head width, F MLP width, V vocabulary,
X experts, T tokens of a row, Q the last layer's queries.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm.config.model import ModelConfig

TRAIN_FACTOR = 3
"""Forward + backward of a matrix product: the forward once, its two operand gradients twice."""


@dataclass(frozen=True)
class Layout:
    """What one training forward sees per data sequence of `seq_len` tokens."""

    seq_len: int
    """Tokens of one data sequence (data.seq_len)."""
    row_len: int
    """Tokens of one model row (seq_len, 2 * seq_len for the [x_t ; x_0] layout, 3 * seq_len for two views)."""
    rows: int = 1
    """Model rows per data sequence (fast_dllm_v2's complementary views in two rows: 2)."""
    last_queries: int | None = None
    """Rows of the last layer's queries (the mask's num_outputs); None: all row_len."""


def _linear(n: int, fan_in: int, fan_out: int) -> int:
    return 2 * n * fan_in * fan_out


def _mlp(cfg: ModelConfig, n: int, index: int = 0) -> int:
    E = cfg.hidden_size
    dense = (3 if cfg.mlp == "gated" else 2) * _linear(n, E, cfg.mlp_size)
    if not cfg.num_experts or index < cfg.first_dense_layers:
        return dense
    experts = cfg.num_experts_per_tok + cfg.num_shared_experts  # the shared ones see every token
    routed = _linear(n, E, cfg.num_experts) + experts * 3 * _linear(n, E, cfg.expert_size)
    routed += _linear(n, E, 1) if cfg.num_shared_experts and cfg.shared_expert_gate else 0
    return routed + (dense if cfg.moe_layout == "beside_dense" else 0)  # Gemma 4: experts beside the dense MLP


def layer_forward_flops(cfg: ModelConfig, T: int, Q: int, index: int = 0) -> int:
    """Block `index`'s forward over a row of T tokens whose first Q compute queries (and outputs)."""
    if cfg.layer_kind(index) == "linear":
        return _linear_attention(cfg, T) + _mlp(cfg, Q, index)
    local = cfg.layer_is_local(index)
    (K, D), E, H = cfg.layer_heads(local), cfg.hidden_size, cfg.num_heads
    gate = 2 if cfg.attn_output_gate else 1
    values = 0 if cfg.global_values_are_keys and not local else _linear(T, E, K * D)
    projections = _linear(Q, E, gate * H * D) + _linear(T, E, K * D) + values + _linear(Q, H * D, E)
    attention = 2 * 2 * Q * T * H * D  # q k^T and p v
    return projections + attention + _mlp(cfg, Q, index)


def _linear_attention(cfg: ModelConfig, T: int) -> int:
    """A Gated DeltaNet layer over T tokens (every row: a recurrence computes them all): projections, the
    convolution, and the chunked delta rule, per token and value head about 2C(K + V) within its chunk of
    C = 64 and 3 K x V products with the state (an estimate: the triangular solve is left out)."""
    E, H, K, V = cfg.hidden_size, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    C = 2 * cfg.linear_key_heads * K + H * V
    projections = _linear(T, E, C + H * V + 2 * H) + _linear(T, H * V, E)
    rule = 2 * T * H * (2 * 64 * (K + V) + 3 * K * V)
    return projections + 2 * T * C * cfg.linear_conv_kernel + rule


def body_forward_flops(cfg: ModelConfig, layout: Layout) -> int:
    """Forward FLOPs of the block stack for one data sequence (embeddings are lookups: 0)."""
    T = layout.row_len
    Q = T if layout.last_queries is None else layout.last_queries
    last = cfg.num_layers - 1
    per_row = sum(n * layer_forward_flops(cfg, T, T, i) for i, n in cfg.layer_classes(last))
    per_row += layer_forward_flops(cfg, T, Q, last)
    return layout.rows * per_row


def head_forward_flops(cfg: ModelConfig) -> int:
    """Forward FLOPs of the output head for one row in the loss (BERT's transform, then the logits)."""
    assert cfg.vocab_size is not None, "resolve model.vocab_size first"
    E = cfg.hidden_size
    transform = _linear(1, E, E) if cfg.head == "mlm" else 0
    return transform + _linear(1, E, cfg.vocab_size)


def train_flops(cfg: ModelConfig, layout: Layout, num_sequences: int, num_head_rows: int) -> int:
    """Model FLOPs of forward + backward over `num_sequences` data sequences whose loss reads
    `num_head_rows` hidden rows through the head."""
    forward = num_sequences * body_forward_flops(cfg, layout) + num_head_rows * head_forward_flops(cfg)
    return TRAIN_FACTOR * forward


def train_flops_per_token(cfg: ModelConfig, layout: Layout, head_rows_per_token: float = 1.0) -> float:
    """Model FLOPs per data token, when a fraction `head_rows_per_token` of the tokens go through the head
    (1.0: every position predicted, the usual convention for comparing models)."""
    body = TRAIN_FACTOR * body_forward_flops(cfg, layout) / layout.seq_len
    return body + TRAIN_FACTOR * head_rows_per_token * head_forward_flops(cfg)
