"""The native transformer: one single-device block stack for every family.

A family (llama, qwen2/3, qwen3_moe, olmoe, llada, llada_moe, dream, gpt2, bert, modernbert, qwen3_5,
qwen3_5_moe, diffusion_gemma) is a set of layout fields on ModelConfig (norm kind and position, positions, MLP kind,
biases, head, local attention layers, linear-attention layers: models/linear_attention.py, Gemma's
sandwich norms and experts beside the MLP: models/gemma.py), not a copy of this file;
`families/` maps each family's Hugging Face weight names onto these modules. The model is used
with whatever attention pattern the objective asks for and knows nothing about meshes, objectives or
samplers; parallelism is applied from outside (dllm.parallel.apply).

Shapes: B batch, L sequence, V vocabulary, H heads, K key/value heads, D head width, E hidden width,
N tokens (flattened), X experts, C canvas rows (DiffusionGemma).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from dllm.attention.backends import AttentionFn, make_attention
from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig, YarnRope
from dllm.config.registries import ACTIVATIONS, NORMS
from dllm.models.edit_flow import EditHead
from dllm.models.gemma import BesideDenseExperts, CanvasConditioning, rms_normalize
from dllm.models.layers import RMSNorm
from dllm.models.linear_attention import GatedDeltaNet
from dllm.models.moe import Experts, MoE
from dllm.models.output import CanvasConditioned, ModelOutput, SelfConditioned, token_logits


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    """The norm `model.norm` names (NORMS), over `dim` features (the hidden width by default)."""
    return NORMS.resolve(cfg.norm).of(cfg, dim or cfg.hidden_size)


def rope_cos_sin(positions_BL: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [B, 1, L, D] for the rotate-half RoPE convention (Hugging Face LLaMA layout).

    The sin table carries rotate-half's sign, [-sin, sin] per half, so that
    rotate_half(x) * sin == swap_halves(x) * signed_sin and `apply_rope` needs no negation."""
    freqs = positions_BL.float()[..., None] * inv_freq.float()[None, None, :]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]


def rope_inv_freq(head_dim: int, theta: float, fraction: float = 1.0) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/D), i < D/2, in float32. With `fraction` < 1 only the first
    fraction * D/2 frequencies are kept and the rest are 0, leaving those features unrotated (Gemma 4's
    proportional RoPE of its global layers)."""
    D = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, D - D % 2, 2, dtype=torch.float32) / D))
    inv_freq[int(fraction * D // 2) :] = 0.0
    return inv_freq


def yarn_inv_freq(rotary_dim: int, theta: float, yarn: YarnRope) -> torch.Tensor:
    """YaRN's inverse frequencies (Peng et al. 2023, Sec. 3.2-3.3): frequency i is kept if it turns more
    than beta_fast times over the pretraining context, divided by `factor` if it turns less than
    beta_slow times, and blended linearly in between (the ramp's ends rounded outwards)."""
    D, L0 = rotary_dim, yarn.original_max_seq_len

    def dim_of(rotations: float) -> float:  # the (fractional) index 2i whose wavelength fits `rotations` in L0
        return D * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(dim_of(yarn.beta_fast)), 0), min(math.ceil(dim_of(yarn.beta_slow)), D - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(D // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)  # 0: keep, 1: interpolate
    inv_freq = rope_inv_freq(D, theta)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(yarn: YarnRope | None) -> float:
    """YaRN's factor on cos and sin (Sec. 3.4): m(mscale) / m(mscale_all_dim), m(s) = 0.1 s ln(factor) + 1
    (m(1) when either is 0); 1.0 without YaRN."""
    if yarn is None:
        return 1.0

    def m(scale: float) -> float:
        return 0.1 * scale * math.log(yarn.factor) + 1.0

    return m(yarn.mscale) / m(yarn.mscale_all_dim) if yarn.mscale and yarn.mscale_all_dim else m(1.0)


def query_scale(positions_BL: torch.Tensor, beta: float, length: int) -> torch.Tensor:
    """Llama-4's attention temperature per query position, [B, 1, L, 1]: 1 + beta ln(1 + floor(p / length))."""
    return (1 + beta * torch.log1p(torch.floor(positions_BL.float() / length)))[:, None, :, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, computed in the tables' dtype (float32 for bf16 activations).
    Tables narrower than x rotate its first features only (partial RoPE); the rest pass unchanged."""
    R = cos.shape[-1]
    if x.shape[-1] > R:
        return torch.cat([apply_rope(x[..., :R], cos, signed_sin), x[..., R:]], dim=-1)
    if x.dtype != cos.dtype:
        return apply_rope(x.to(cos.dtype), cos, signed_sin).to(x.dtype)
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), signed_sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend: AttentionFn, local: bool = False) -> None:
        super().__init__()
        (K, D), E, H = cfg.layer_heads(local), cfg.hidden_size, cfg.num_heads
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, D
        self.output_gate = cfg.attn_output_gate  # q_proj also gives a gate per output feature (per head: [q, gate])
        self.q_proj = nn.Linear(E, H * D * (2 if self.output_gate else 1), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(E, K * D, bias=cfg.qkv_bias)
        values_are_keys = cfg.global_values_are_keys and not local  # Gemma 4's global layers
        self.v_proj = None if values_are_keys else nn.Linear(E, K * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=cfg.attn_out_bias)
        self.qk_norm_full = cfg.qk_norm_width == "full"  # OLMoE: one norm over all heads' features
        width_q, width_k = (H * D, K * D) if self.qk_norm_full else (D, D)
        norm = make_norm if cfg.norm == "rmsnorm_centered" else lambda c, dim: RMSNorm(dim, c.norm_eps)
        self.q_norm = norm(cfg, width_q) if cfg.qk_norm else None
        self.k_norm = norm(cfg, width_k) if cfg.qk_norm else None
        self.attend = attend  # one backend object per model, shared by its layers
        self.value_norm_eps = cfg.norm_eps if cfg.value_norm else None
        # the backends scale q.k by 1/sqrt(D); a model with another scale (Gemma 4: 1) scales q instead
        self.q_scale = None if cfg.attention_scale is None else cfg.attention_scale * math.sqrt(D)

    def forward(
        self,
        x_BLE: torch.Tensor,
        rope: tuple | None,
        mask: AttentionMask,
        num_queries: int | None = None,
        kv: Any = None,
    ) -> torch.Tensor:
        """Keys and values from all L positions; queries (and outputs) from the first `num_queries`.
        `kv` (a sampling.cache.LayerKV): this forward's keys/values are written into the cache, and
        attention reads the cached keys/values of the whole attended range."""
        B, L, _ = x_BLE.shape
        Q = L if num_queries is None else num_queries
        # heads from the projections' widths: under tensor parallelism a rank holds H/T and K/T of them
        q, k = self.q_proj(x_BLE[:, :Q]), self.k_proj(x_BLE)
        gate_BQF = None
        if self.output_gate:
            q, gate = q.view(B, Q, -1, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate_BQF = q.reshape(B, Q, -1), gate.reshape(B, Q, -1)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        v = k if self.v_proj is None else self.v_proj(x_BLE)  # values before the key norm and RoPE
        q = q.view(B, Q, -1, self.head_dim).transpose(1, 2)
        k = k.view(B, L, -1, self.head_dim).transpose(1, 2)
        v = v.view(B, L, -1, self.head_dim).transpose(1, 2)
        if self.value_norm_eps is not None:
            v = rms_normalize(v, self.value_norm_eps)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # (cos, sin) or (cos, sin, query scale [B, 1, L, 1])
            cos, sin = rope[0], rope[1]
            q, k = apply_rope(q, cos[:, :, :Q], sin[:, :, :Q]), apply_rope(k, cos, sin)
            if len(rope) > 2:
                q = q * rope[2][:, :, :Q].to(q.dtype)
        if self.q_scale is not None:
            q = q * self.q_scale
        if kv is not None:
            k, v = kv.update(k, v)
        out_BHQD = self.attend(q, k, v, mask)
        out_BQF = out_BHQD.transpose(1, 2).reshape(B, Q, -1)
        return self.o_proj(out_BQF if gate_BQF is None else out_BQF * torch.sigmoid(gate_BQF))


class MLP(nn.Module):
    """Gated (act(gate) * up, then down: SwiGLU) or plain (act(up), then down: GPT-2, BERT)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        super().__init__()
        E, inner = cfg.hidden_size, width or cfg.mlp_size
        self.gate_proj = nn.Linear(E, inner, bias=cfg.mlp_bias) if cfg.mlp == "gated" else None
        self.up_proj = nn.Linear(E, inner, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inner, E, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS.resolve(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attend: AttentionFn, index: int = 0) -> None:
        super().__init__()
        self.post_norm = cfg.norm_position == "post"
        self.local = cfg.layer_is_local(index)  # sliding-window attention with its own RoPE base
        self.input_layernorm = make_norm(cfg) if index or cfg.first_layer_attn_norm else nn.Identity()
        linear = cfg.layer_kind(index) == "linear"  # Gated DeltaNet instead of attention (the checkpoints' names)
        self.self_attn = None if linear else Attention(cfg, attend, self.local)
        self.linear_attn = GatedDeltaNet(cfg) if linear else None
        self.post_attention_layernorm = make_norm(cfg)  # the norm before the MLP
        routed = cfg.num_experts and index >= cfg.first_dense_layers
        beside = routed and cfg.moe_layout == "beside_dense"
        self.mlp = MoE(cfg, MLP) if routed and not beside else MLP(cfg)
        # Gemma: norms on the sub-layers' outputs, experts beside the dense MLP, a per-layer output scalar
        self.attn_out_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.mlp_out_norm = make_norm(cfg) if cfg.sandwich_norm else None
        self.beside = BesideDenseExperts(cfg, Experts(cfg), lambda: make_norm(cfg)) if beside else None
        self.register_buffer("layer_scale", torch.ones(1) if cfg.layer_scale else None)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple | None,
        mask: AttentionMask,
        num_queries: int | None = None,
        kv: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's output for the first `num_queries` positions (all by default), and the MoE
        router's auxiliary loss (None for a dense MLP)."""
        x_q = x if num_queries is None else x[:, :num_queries]
        if self.post_norm:  # BERT: normalise after each residual add
            x_q = self.input_layernorm(x_q + self._mix(x, rope, mask, num_queries, kv))
            y, aux = self._mlp(x_q)
            return self.post_attention_layernorm(x_q + y), aux
        h = self._mix(self.input_layernorm(x), rope, mask, num_queries, kv)
        x_q = x_q + (h if self.attn_out_norm is None else self.attn_out_norm(h))
        y, aux = self._mlp(self.post_attention_layernorm(x_q))
        if self.beside is not None:
            y, aux = self.beside(y, x_q)
        if self.mlp_out_norm is not None:
            y = self.mlp_out_norm(y)
        x_q = x_q + y
        return (x_q if self.layer_scale is None else x_q * self.layer_scale), aux

    def _mix(self, x: torch.Tensor, rope: tuple | None, mask: AttentionMask, num_queries: int | None, kv: Any):
        """The token mixer: attention, or the linear-attention layer (which computes every row)."""
        if self.self_attn is not None:
            return self.self_attn(x, rope, mask, num_queries, kv)
        assert self.linear_attn is not None
        out = self.linear_attn(x, mask, kv)
        return out if num_queries is None else out[:, :num_queries]

    def _mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mlp(x) if isinstance(self.mlp, MoE) else (self.mlp(x), None)


class MLMHead(nn.Module):
    """BERT's prediction head transform: dense, activation, norm (the decoder is the output matrix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.head_dense_bias)
        self.act = ACTIVATIONS.resolve(cfg.activation)
        self.norm = make_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class Transformer(nn.Module):
    """tokens [B, L] + positions [B, L] + mask -> ModelOutput (final hidden [B, L, E], head, aux)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vocab_size is not None, "resolve model.vocab_size from the tokenizer first"
        self.cfg = cfg
        E, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(V, E)
        self.embed_positions = nn.Embedding(cfg.max_seq_len, E) if cfg.position == "learned" else None
        self.embed_norm = make_norm(cfg) if cfg.embedding_norm else None
        self.self_cond_proj = nn.Linear(E, E, bias=False) if cfg.self_condition else None
        self.canvas_cond = CanvasConditioning(cfg, lambda: make_norm(cfg)) if cfg.canvas_conditioning else None
        self.embed_multiplier = math.sqrt(E) if cfg.embed_scale else None  # Gemma
        attend = make_attention(cfg.attention_backend, cfg.flex_compile)  # a compile failure is met once
        self.layers = nn.ModuleList(Block(cfg, attend, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg) if cfg.final_norm else None
        self.head_transform = MLMHead(cfg) if cfg.head == "mlm" else None
        self.head_bias = nn.Parameter(torch.zeros(V)) if cfg.head == "mlm" else None
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(E, V, bias=False)
        self.edit_head = EditHead(E) if cfg.edit_head else None  # Edit Flows rates (models/edit_flow.py)
        self.register_buffer("inv_freq", self._inv_freq(local=False), persistent=False)
        local_inv_freq = self._inv_freq(local=True) if self._local_table() else None
        self.register_buffer("inv_freq_local", local_inv_freq, persistent=False)  # None: the global table
        # the last block computes only `mask.num_outputs` rows; off when a rank's rows are not the
        # sequence's first positions (sequence parallelism shards the residual stream)
        self.trim_last_block = True

    def _inv_freq(self, local: bool) -> torch.Tensor:
        """The RoPE table of local or global layers: `rotary_fraction` of their head width (partial RoPE: the
        first features), their base, YaRN-scaled on the global layers when the model has it, and the global
        layers' proportional fraction (Gemma 4)."""
        cfg = self.cfg
        _, D = cfg.layer_heads(local)
        R = int(D * cfg.rotary_fraction)
        if local:
            return rope_inv_freq(R, cfg.local_rope_theta or cfg.rope_theta)
        if cfg.rope_yarn is not None:
            return yarn_inv_freq(R, cfg.rope_theta, cfg.rope_yarn)
        return rope_inv_freq(R, cfg.rope_theta, cfg.global_rope_fraction)

    def _local_table(self) -> bool:
        """Whether the local layers need RoPE tables of their own (another base, head width or fraction)."""
        cfg = self.cfg
        if not any(layer.local for layer in self.layers):
            return False
        same_width = cfg.layer_heads(True)[1] == cfg.layer_heads(False)[1] and cfg.global_rope_fraction == 1
        return not same_width or cfg.local_rope_theta not in (None, cfg.rope_theta)

    def _rope(self, positions_BL: torch.Tensor) -> tuple | None:
        """RoPE tables of the global layers: YaRN's cos/sin factor folded in, the query temperature appended."""
        cfg = self.cfg
        if cfg.position != "rope":
            return None
        cos, sin = rope_cos_sin(positions_BL, self.inv_freq)
        factor = yarn_attention_factor(cfg.rope_yarn)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        if cfg.query_scale_beta is None:
            return cos, sin
        assert cfg.query_scale_length is not None  # checked by ModelConfig
        return cos, sin, query_scale(positions_BL, cfg.query_scale_beta, cfg.query_scale_length)

    def forward(
        self,
        tokens_BL: torch.Tensor | SelfConditioned,
        positions_BL: torch.Tensor,
        mask: AttentionMask | None = None,
        cache: Any = None,
    ) -> ModelOutput:
        """Final hidden states [B, L, E] (row i: position i's state, never shifted: a caller that
        predicts i from i-1 reads the decode profile), the output head and the router's aux loss.

        `tokens_BL` may carry a previous pass's predictions (`SelfConditioned`) for a model built with
        `self_condition`. `mask.num_outputs`: only the first N rows' outputs are used, so the last
        block computes queries, attention and MLP for those only (BD3LM's noisy half).
        `cache` (sampling.cache.KVCache): the tokens are the canvas slice starting at
        `cache.query_start`; they attend to cached keys/values of [0, cache.key_end) (the mask's
        `query_offset` must say where the slice sits)."""
        mask = mask if mask is not None else AttentionMask()
        # prefix_canvas: the token rows after the clean ones are the canvas (a cached forward starts at query_offset)
        x = self.embed(tokens_BL, positions_BL, mask.input_clean_rows)
        rope = self._rope(positions_BL)
        local_rope, local_mask = self._local_attention(positions_BL, rope, mask)
        last, aux = len(self.layers) - 1, []
        for i, layer in enumerate(self.layers):
            num_queries = mask.num_outputs if i == last and self.trim_last_block else None
            layer_rope, layer_mask = (local_rope, local_mask) if layer.local else (rope, mask)
            x, layer_aux = layer(x, layer_rope, layer_mask, num_queries, None if cache is None else cache.layer(i))
            if layer_aux is not None:
                aux.append(layer_aux)
        if self.norm is not None:
            x = self.norm(x)
        aux_losses = {"router_loss": torch.stack(aux).mean()} if aux else {}
        return ModelOutput(x, self.head, aux_losses, edit=self.edit_head, logit_softcap=self.cfg.final_logit_softcap)

    def _local_attention(
        self, positions_BL: torch.Tensor, rope: tuple | None, mask: AttentionMask
    ) -> tuple[tuple | None, AttentionMask]:
        """RoPE tables and mask of the sliding-window layers (ModernBERT's local attention): built once
        per forward and shared by those layers, so a backend derives the windowed mask once."""
        window = self.cfg.local_window
        if window is None or not any(layer.local for layer in self.layers):
            return rope, mask
        if self.inv_freq_local is not None and rope is not None:
            rope = rope_cos_sin(positions_BL, self.inv_freq_local)
        return rope, dataclasses.replace(mask, window=min(window, mask.window or window))

    def embed(
        self,
        tokens_BL: torch.Tensor | SelfConditioned | CanvasConditioned,
        positions_BL: torch.Tensor,
        num_clean: int | None = None,
    ) -> torch.Tensor:
        """Token (+ self-conditioning) (+ learned position) embeddings, normalised if the family does.
        `num_clean`: the rows after it are a canvas (DiffusionGemma), whose embeddings pass through the
        canvas self-conditioning block."""
        previous_BL, canvas = None, None
        if isinstance(tokens_BL, SelfConditioned):
            tokens_BL, previous_BL = tokens_BL.ids_BL, tokens_BL.previous_BL
        elif isinstance(tokens_BL, CanvasConditioned):
            tokens_BL, canvas = tokens_BL.ids_BL, tokens_BL
        x = self.embed_tokens(tokens_BL)
        if self.embed_multiplier is not None:  # the factor rounded to the weights' dtype first, as Gemma does
            x = x * x.new_tensor(self.embed_multiplier)
        if self.canvas_cond is not None and num_clean is not None:
            canvas_BCE = self.canvas_cond(
                x[:, num_clean:], canvas, self.embed_tokens.weight, self.embed_multiplier or 1.0
            )
            x = torch.cat([x[:, :num_clean], canvas_BCE], dim=1)
        if self.self_cond_proj is not None and previous_BL is not None:
            on_BL1 = (previous_BL >= 0).unsqueeze(-1).to(x.dtype)
            x = x + self.self_cond_proj(self.embed_tokens(previous_BL.clamp_min(0))) * on_BL1
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions_BL)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        return x

    def head(self, hidden_BLE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(features, output weight [V, E], output bias [V] or None): logits = features @ weight.T + bias.
        The chunked cross-entropy takes these instead of logits."""
        if self.head_transform is not None:
            hidden_BLE = self.head_transform(hidden_BLE)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden_BLE, weight, self.head_bias

    def logits(self, hidden_BLE: torch.Tensor, exclude_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`models.output.token_logits` of final hidden states (float32 at least, soft-capped, `exclude_ids` -inf)."""
        return token_logits(self.head, hidden_BLE, self.cfg.final_logit_softcap, exclude_ids)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * layers)
        (GPT-2 / Megatron practice) so the residual stream does not grow with depth; norms 1, biases 0."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("router.scale", "per_expert_scale")):
                p.fill_(1.0)  # Gemma 4's router scales start neutral
            elif name.endswith(("bias", "A_log")) or name.startswith("self_cond_proj"):
                p.zero_()  # self-conditioning starts as a no-op; linear layers' decay rate A = exp(A_log) = 1
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")) else std
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * s)
        for m in self.modules():
            if isinstance(m, RMSNorm):  # a zero-centred norm stores scale 1 as weight 0
                m.weight.fill_(1.0 - m.offset)
            if isinstance(m, MoE) and m.expert_bias is not None:
                m.expert_bias.zero_()  # routing starts unbiased
            if isinstance(m, GatedDeltaNet):
                m.dt_bias.fill_(1.0)  # at a = 0 a state keeps exp(-softplus(1)) ~ 0.27 of itself per token
        for name, b in self.named_buffers():
            if name.endswith("layer_scale"):
                b.fill_(1.0)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.inv_freq.copy_(self._inv_freq(local=False).to(self.inv_freq.device))
        if self.inv_freq_local is not None:
            self.inv_freq_local.copy_(self._inv_freq(local=True).to(self.inv_freq_local.device))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; `exclude_embeddings` leaves out the embeddings and an untied LM head."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
            n -= self.embed_positions.weight.numel() if self.embed_positions is not None else 0
            n -= self.lm_head.weight.numel() if self.lm_head is not None else 0
        return n
