"""The network section: family layouts, size presets, LoRA adapters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dllm.config.base import Float, Int, PathOrHubId, Section
from dllm.config.registries import ACTIVATIONS, ATTENTION_BACKENDS, DRAFTERS, FAMILIES, NORMS

# Size presets for the native transformer. A preset fills the fields the user did not set.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # for unit tests: ~0.4M parameters with the byte tokenizer
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    # the demo: ~0.8M parameters, the most this corpus can learn in ~3 minutes on 2 CPU cores
    "demo": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2},
    "small": {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8},
    "350m": {"hidden_size": 1024, "num_layers": 24, "num_heads": 16, "num_kv_heads": 16},
}

# Architecture defaults per family: the layout of the one native block stack, not a copy of it.
# A family fills the fields left unset, then a size preset, then the user's values win.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"qkv_bias": True, "rope_theta": 1000000.0},
    "qwen3": {"qk_norm": True, "rope_theta": 1000000.0},
    "qwen3_moe": {"qk_norm": True, "rope_theta": 1000000.0, "num_experts": 8, "num_experts_per_tok": 2},
    "llada": {"rope_theta": 500000.0, "norm_eps": 1e-5, "tie_embeddings": False},
    "dream": {"qkv_bias": True, "rope_theta": 1000000.0, "shift_logits": True},
    "gpt2": {
        "norm": "layernorm", "norm_bias": True, "mlp": "plain", "activation": "gelu_tanh", "position": "learned",
        "qkv_bias": True, "attn_out_bias": True, "mlp_bias": True, "norm_eps": 1e-5,
    },
    "bert": {
        "norm": "layernorm", "norm_bias": True, "norm_position": "post", "embedding_norm": True,
        "final_norm": False, "mlp": "plain", "activation": "gelu", "position": "learned", "qkv_bias": True,
        "attn_out_bias": True, "mlp_bias": True, "head": "mlm", "norm_eps": 1e-12,
    },
    "llada_moe": {
        "qk_norm": True, "rope_theta": 50000.0, "norm_eps": 1e-5, "tie_embeddings": False, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": False,
    },
    "olmoe": {
        "qk_norm": True, "qk_norm_width": "full", "norm_eps": 1e-5, "tie_embeddings": False, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": False,
    },
    # Qwen3.5 (dense text): three Gated DeltaNet layers to one gated full-attention layer, zero-centred norms
    "qwen3_5": {
        "norm": "rmsnorm_centered", "qk_norm": True, "rope_theta": 10000000.0, "rotary_fraction": 0.25,
        "attn_output_gate": True, "attention_pattern": ["linear", "linear", "linear", "global"],
        "tie_embeddings": False,
    },
    # Nemotron-Labs-Diffusion (NVIDIA): a Ministral 3 decoder (YaRN RoPE, Llama-4 query temperature), untied head
    "nemotron_labs_diffusion": {
        "rope_theta": 1000000.0, "norm_eps": 1e-5, "tie_embeddings": False, "query_scale_beta": 0.1,
        "query_scale_length": 16384, "rope_yarn": {"factor": 16.0, "original_max_seq_len": 16384},
    },
    "modernbert": {
        "norm": "layernorm", "norm_eps": 1e-5, "embedding_norm": True, "first_layer_attn_norm": False,
        "activation": "gelu", "head": "mlm", "head_dense_bias": False, "rope_theta": 160000.0,
        "attention_pattern": ["global", "local", "local"], "local_window": 65, "local_rope_theta": 10000.0,
    },
}  # fmt: skip


class YarnRope(Section):
    """YaRN RoPE scaling (Peng et al. 2023): slow frequencies interpolated by `factor`, fast ones kept."""

    factor: Float = Field(gt=1)
    """Context extension: inverse frequencies below the ramp are divided by it."""
    original_max_seq_len: Int = Field(gt=0)
    """Pretraining context; the ramp between kept and interpolated frequencies is placed on it."""
    beta_fast: Float = Field(default=32.0, gt=0)
    """Rotations over original_max_seq_len above which a frequency is kept (extrapolated)."""
    beta_slow: Float = Field(default=1.0, gt=0)
    """Rotations below which a frequency is fully interpolated."""
    mscale: Float = Field(default=1.0, ge=0)
    """cos/sin are scaled by m(mscale) / m(mscale_all_dim), m(s) = 0.1 s ln(factor) + 1 (1 when equal)."""
    mscale_all_dim: Float = Field(default=1.0, ge=0)
    """Denominator's mscale of that attention factor."""


class ModelConfig(Section):
    """The network: one block stack whose family fields describe llama, qwen, gpt2, bert, ... layouts."""

    family: Literal[FAMILIES.names()] = "llama"  # type: ignore[valid-type]
    """Architecture family: fills the layout fields below and names the Hugging Face weight layout."""
    preset: str | None = None
    """Size preset that fills the size fields left unset here (tiny, demo, small, 350m)."""
    init_from: PathOrHubId | None = None
    """Start from these weights: a Hugging Face folder or hub id (org/name[@revision]), or a `dllm convert` folder."""
    vocab_size: Int | None = Field(default=None, gt=0)
    """Vocabulary size; null means the tokenizer's size rounded up to a multiple of 64."""
    hidden_size: Int = Field(default=256, gt=0)
    """Width of the residual stream."""
    num_layers: Int = Field(default=4, gt=0)
    """Number of transformer blocks."""
    num_heads: Int = Field(default=4, gt=0)
    """Attention query heads."""
    num_kv_heads: Int | None = Field(default=None, gt=0)
    """Key/value heads for grouped-query attention; null means num_heads (multi-head)."""
    head_dim: Int | None = Field(default=None, gt=0)
    """Width of one attention head; null means hidden_size / num_heads."""
    intermediate_size: Int | None = Field(default=None, gt=0)
    """Hidden width of the MLP; null means 8/3 * hidden_size rounded up to 64 (gated) or 4 * hidden (plain)."""
    max_seq_len: Int = Field(default=2048, gt=0)
    """Longest sequence the model is used with (RoPE positions, or the learned position table)."""
    rope_theta: Float = Field(default=10000.0, gt=0)
    """RoPE base frequency (of the global layers when attention_pattern has local ones)."""
    attention_pattern: tuple[Literal["global", "local", "linear"], ...] | None = Field(default=None, min_length=1)
    """Per-layer mixers, repeated: global, local (sliding window) or linear (Gated DeltaNet); null: all global."""
    local_window: Int | None = Field(default=None, gt=0)
    """Sliding window of the `local` layers: a query attends keys fewer than this many positions away."""
    local_rope_theta: Float | None = Field(default=None, gt=0)
    """RoPE base frequency of the `local` layers; null: rope_theta."""
    rope_yarn: YarnRope | None = None
    """YaRN scaling of the global layers' RoPE (Ministral 3, Nemotron-Labs-Diffusion); null: plain RoPE."""
    query_scale_beta: Float | None = Field(default=None, gt=0)
    """Llama-4 attention temperature: queries at position p times 1 + beta ln(1 + floor(p / query_scale_length))."""
    query_scale_length: Int | None = Field(default=None, gt=0)
    """Positions per step of that temperature (Ministral 3: its 16384-token pretraining context)."""
    rotary_fraction: Float = Field(default=1.0, gt=0, le=1)
    """Fraction of each head's width that RoPE rotates (the first ones; Qwen3.5: 0.25); the rest carry no position."""
    attn_output_gate: bool = False
    """Gate attention outputs per feature by sigmoid(x W_g) before o_proj (Qwen3.5; q_proj is twice as wide)."""
    linear_num_key_heads: Int | None = Field(default=None, gt=0)
    """Query/key heads of the linear-attention layers; null: num_kv_heads."""
    linear_num_value_heads: Int | None = Field(default=None, gt=0)
    """Value heads (recurrent states) of the linear-attention layers, a multiple of the key heads; null: num_heads."""
    linear_key_head_dim: Int | None = Field(default=None, gt=0)
    """Query/key width per head of the linear-attention layers; null: the attention head width."""
    linear_value_head_dim: Int | None = Field(default=None, gt=0)
    """Value width per head of the linear-attention layers; null: the attention head width."""
    linear_conv_kernel: Int = Field(default=4, gt=0)
    """Taps of the causal depthwise convolution on the linear layers' queries, keys and values."""
    norm: Literal[NORMS.names()] = "rmsnorm"  # type: ignore[valid-type]
    """Normalisation layers: RMSNorm (llama, qwen), zero-centred RMSNorm (qwen3_5: scale 1 + w) or LayerNorm."""
    norm_bias: bool = False
    """LayerNorm with a bias."""
    norm_eps: Float = Field(default=1e-6, gt=0)
    """Epsilon of the normalisation layers."""
    norm_position: Literal["pre", "post"] = "pre"
    """Norm before each sub-layer (pre-LN, modern) or after the residual add (post-LN, BERT)."""
    embedding_norm: bool = False
    """Normalise the embeddings before the first block (BERT)."""
    final_norm: bool = True
    """A norm after the last block (pre-LN models)."""
    first_layer_attn_norm: bool = True
    """A norm before the first block's attention (ModernBERT has none: its embedding norm comes just before)."""
    position: Literal["rope", "learned"] = "rope"
    """Positions: rotary (RoPE) or a learned absolute table of max_seq_len rows (gpt2, bert)."""
    mlp: Literal["gated", "plain"] = "gated"
    """MLP: gated (SwiGLU-style gate * up) or plain (up, activation, down)."""
    activation: Literal[ACTIVATIONS.names()] = "silu"  # type: ignore[valid-type]
    """MLP activation."""
    qk_norm: bool = False
    """RMSNorm on queries and keys (Qwen3-style)."""
    qk_norm_width: Literal["head", "full"] = "head"
    """The q/k RMSNorm normalises each head (Qwen3, LLaDA-MoE) or all heads at once (OLMoE)."""
    qkv_bias: bool = False
    """Bias on the query/key/value projections (Qwen2-style)."""
    attn_out_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    """Biases in the MLP."""
    head: Literal["linear", "mlm"] = "linear"
    """Output head: linear, or BERT's MLM head (dense, activation, norm, then the decoder with a bias)."""
    head_dense_bias: bool = True
    """Bias on the MLM head's dense layer (BERT has one; ModernBERT's classifier_bias is off)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head weights."""
    shift_logits: bool = False
    """Position i predicts token i from the hidden state at i-1 (Dream and other AR-initialised models)."""
    num_experts: Int = Field(default=0, ge=0)
    """Mixture of experts: experts per MoE layer; 0 is a dense MLP."""
    num_experts_per_tok: Int = Field(default=2, gt=0)
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: Int | None = Field(default=None, gt=0)
    """Hidden width of one expert; null means intermediate_size."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    router_aux_loss_coef: Float = Field(default=0.001, ge=0)
    """Weight of the load-balancing loss (Switch Transformer) added to the training loss."""
    self_condition: bool = False
    """Add an input for self-conditioning (the embedding of a previous pass's predictions, zero-initialised)."""
    edit_head: bool = False
    """Add the Edit Flows head: per-position insert/delete/substitute rates and an insertion projection."""
    init_std: Float = Field(default=0.02, gt=0)
    """Standard deviation of the normal weight initialisation."""
    attention_backend: Literal[ATTENTION_BACKENDS.names()] = "auto"  # type: ignore[valid-type]
    """sdpa (dense mask, the reference), flex (BlockMask), blockwise (exact, block-sparse), auto (per device)."""
    flex_compile: bool = True
    """FlexAttention through torch.compile (false: eager, for tests and debugging)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_presets(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        family = data.get("family", "llama")
        merged = dict(FAMILY_DEFAULTS.get(family, {}))
        name = data.get("preset")
        if name is not None:
            if name not in MODEL_PRESETS:
                raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
            merged.update(MODEL_PRESETS[name])
        return {**merged, **data}

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "set head_dim or change one of them"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
        if self.position == "rope" and self.dim_per_head % 2:
            raise ValueError(f"head width {self.dim_per_head} must be even for RoPE")
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")
        if self.num_experts and self.mlp != "gated":
            raise ValueError("mixture-of-experts layers use gated experts; set mlp: gated")
        if self.attention_pattern is not None and "local" in self.attention_pattern and self.local_window is None:
            raise ValueError("attention_pattern has local layers but local_window is not set")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(f"linear_num_value_heads {self.linear_value_heads} is not a multiple of "
                             f"linear_num_key_heads {self.linear_key_heads}")  # fmt: skip
        if (self.query_scale_beta is None) != (self.query_scale_length is None):
            raise ValueError("query_scale_beta and query_scale_length go together: set both or neither")
        if self.position != "rope" and (self.rope_yarn is not None or self.query_scale_beta is not None):
            raise ValueError("rope_yarn and query_scale_beta act on RoPE attention; set position: rope or drop them")
        if self.position == "rope" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rotary_fraction {self.rotary_fraction} of head width {self.dim_per_head} "
                             f"rotates {self.rotary_dim} features; RoPE needs an even number >= 2")  # fmt: skip
        return self

    def layer_kind(self, index: int) -> Literal["global", "local", "linear"]:
        """The token mixer of layer `index` (attention_pattern, repeated over the layers)."""
        pattern = self.attention_pattern
        return "global" if pattern is None else pattern[index % len(pattern)]

    @property
    def has_linear_layers(self) -> bool:
        return any(self.layer_kind(i) == "linear" for i in range(self.num_layers))

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates (the first ones)."""
        return int(self.dim_per_head * self.rotary_fraction)

    @property
    def linear_key_heads(self) -> int:
        return self.linear_num_key_heads or self.kv_heads

    @property
    def linear_value_heads(self) -> int:
        return self.linear_num_value_heads or self.num_heads

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim or self.dim_per_head

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim or self.dim_per_head

    def layer_is_local(self, index: int) -> bool:
        """Layer `index` attends through the sliding window (attention_pattern, repeated over the layers)."""
        return self.layer_kind(index) == "local"

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def mlp_size(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        if self.mlp == "plain":
            return 4 * self.hidden_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.mlp_size


class LoraConfig(Section):
    """LoRA adapters (Hu et al. 2021): only the adapters train and are checkpointed."""

    rank: Int = Field(default=8, gt=0)
    """Rank r of each adapter."""
    alpha: Float = Field(default=16.0, gt=0)
    """Scale numerator: the adapter output is multiplied by alpha / rank."""
    dropout: Float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter input (0 keeps resumes bit-identical)."""
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Linear layers to adapt: module-name suffixes, globs (`*.mlp.*`) or `re:<regex>`."""

    @property
    def scale(self) -> float:
        """The factor on the adapter output: alpha / rank."""
        return self.alpha / self.rank

    @model_validator(mode="after")
    def _no_head(self) -> LoraConfig:
        if any(t.split(".")[-1].lstrip("*") in ("lm_head", "head_transform") for t in self.targets):
            raise ValueError("adapters on the output head are not supported (its weight is used directly)")
        return self


DrafterArchitecture = Literal["dllm", "dflash"]
"""The drafter architectures training builds (dflash2 drafters are loaded from the public layout only)."""


class DynamicConvConfig(Section):
    """DFlash2's grouped dynamic causal convolutions around each block's attention and MLP (public keys
    conv_kernel_size, conv_group_size)."""

    kernel_size: Int = Field(gt=0)
    """Taps: a row mixes itself and the kernel_size - 1 rows before it in its draft block."""
    group_size: Int = Field(gt=0)
    """Channels per group: the dynamic part of the kernel is one weight per group, tap and row."""


class SelectorConfig(Section):
    """DFlash2's candidate selector (public keys selector_rank, selector_top_k): the draft is a chain
    through each position's top-k tokens, scored by the logits plus a low-rank predecessor/successor term."""

    rank: Int = Field(gt=0)
    """Width of the token codebooks and of the projected draft states."""
    top_k: Int = Field(gt=0)
    """Candidates per position (the tokens of highest draft logit)."""


class DFlashConfig(Section):
    """A DFlash drafter (Chen et al. 2025): a few bidirectional blocks that read the target's hidden states."""

    num_layers: Int = Field(default=1, gt=0)
    """Drafter blocks (each attends to the projected target context plus its own draft block)."""
    block_size: Int = Field(default=8, ge=2)
    """b: a draft block is [last accepted token, MASK x (b-1)]; one forward proposes b - 1 tokens."""
    target_layer_ids: tuple[Int, ...] = Field(min_length=1)
    """Target blocks (0-based into its layers) whose outputs are concatenated as the drafter's context features."""
    mask_id: Int = Field(ge=0)
    """Token id of the MASK placeholders of a draft block (embedded with the target's embedding)."""
    target: ModelConfig
    """The target's architecture: the drafter's blocks copy its widths, heads, norms and RoPE (never its weights)."""
    architecture: Literal["dllm", "dflash", "dflash2"] = "dllm"
    """dflash: the published drafter (Qwen3 blocks, raw fused context); dflash2: dflash with `conv` and `selector`;
    dllm: target-layout blocks, context normed."""
    blocks: ModelConfig | None = None
    """The blocks' own architecture (a public drafter folder's widths, heads and RoPE); null: from the target."""
    conv: DynamicConvConfig | None = None
    """dflash2: the convolutions around each block's attention and MLP; null for the other architectures."""
    selector: SelectorConfig | None = None
    """dflash2: the candidate selector that picks the drafted tokens; null for the other architectures."""
    input_embedding_scale: Float = 1.0
    """Factor on the embedded draft block (public key input_embedding_scale)."""
    output_multiplier: Float = 1.0
    """Factor on the draft logits (public key output_multiplier)."""
    final_logit_softcapping: Float | None = Field(default=None, gt=0)
    """Draft logits through c * tanh(logits / c) (public key final_logit_softcapping); null: none."""
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    """Per block (public key layer_types): sliding_attention sees keys fewer than sliding_window positions away
    and is causal unless `causal` is false; null: all full_attention."""
    sliding_window: Int | None = Field(default=None, gt=0)
    """The window of the sliding_attention blocks (public key sliding_window)."""
    causal: bool | None = None
    """Public key is_causal: true makes every block causal inside its draft block, false none; null: the
    sliding_attention blocks only."""

    @model_validator(mode="after")
    def _check_target(self) -> DFlashConfig:
        n = self.target.num_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {n} layers (0-based)")
        if self.target.vocab_size is not None and self.mask_id >= self.target.vocab_size:
            raise ValueError(f"mask_id {self.mask_id} is outside the target's vocabulary of {self.target.vocab_size}")
        if self.target.rope_yarn is not None or self.target.query_scale_beta is not None:
            raise ValueError("a target with YaRN RoPE or a query temperature (Ministral 3) has no drafter here yet")
        if self.blocks is not None and self.blocks.hidden_size != self.target.hidden_size:
            raise ValueError(f"the drafter's hidden size {self.blocks.hidden_size} is not the target's "
                             f"{self.target.hidden_size}")  # fmt: skip
        if self.architecture != "dllm":
            self._check_public()
        elif (self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping, self.layer_types,
              bool(self.causal)) != (1.0, 1.0, None, None, False):  # fmt: skip
            raise ValueError("architecture dllm: input_embedding_scale, output_multiplier, final_logit_softcapping, "
                             "layer_types and causal are public drafter settings; leave them unset")  # fmt: skip
        self._check_dflash2()
        self._check_layer_types()
        return self

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is not None and len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} drafter blocks")
        if types is not None and "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention blocks but sliding_window is not set")

    def layer_kind(self, index: int) -> tuple[bool, int | None]:
        """(causal inside the draft block, sliding window or None) of drafter block `index`, as the public code
        reads layer_types and is_causal."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        return (sliding if self.causal is None else self.causal), (self.sliding_window if sliding else None)

    def _check_dflash2(self) -> None:
        """conv and selector: both set for dflash2 (the public DFlash2DraftModel builds both), neither otherwise."""
        dflash2 = self.architecture == "dflash2"
        if dflash2 != (self.conv is not None) or dflash2 != (self.selector is not None):
            raise ValueError(f"architecture {self.architecture}: conv and selector are "
                             f"{'required' if dflash2 else 'DFlash2 parts; use architecture dflash2'}")  # fmt: skip
        E = self.hidden_size
        if self.conv is not None and E % self.conv.group_size:
            raise ValueError(f"conv.group_size {self.conv.group_size} does not divide the hidden size {E}")
        V = self.target.vocab_size
        if self.selector is not None and V is not None and self.selector.top_k > V:
            raise ValueError(f"selector.top_k {self.selector.top_k} is more than the vocabulary of {V} tokens")

    def _check_public(self) -> None:
        """What the published drafter reads of its target: hidden states after a block (Hugging Face's
        hidden_states[i + 1], whose last entry is taken after the target's final norm) and its bare token
        embedding (the dflash package, SGLang and vLLM embed a block with the embedding matrix alone)."""
        t, arch = self.target, self.architecture
        if t.num_layers - 1 in self.target_layer_ids and t.final_norm:
            raise ValueError(
                f"architecture {arch}: target_layer_ids include the target's last layer {t.num_layers - 1}, which the "
                "public DFlash code reads after the target's final norm and dllm before it; read layers before the last"
            )
        if t.position != "rope" or t.embedding_norm or t.self_condition or t.head != "linear":
            raise ValueError(
                f"architecture {arch}: the {t.family} target adds positions or a norm to its token embedding (or has "
                "no linear head), which the public drafters do not; use architecture dllm"
            )
        c = self.blocks
        if c is not None and not (
            c.norm == "rmsnorm" and c.norm_position == "pre" and c.mlp == "gated" and c.position == "rope"
            and c.qk_norm and c.qk_norm_width == "head" and c.qkv_bias == c.attn_out_bias and not c.mlp_bias
            and not c.num_experts and c.attention_pattern is None
        ):  # fmt: skip
            raise ValueError(f"architecture {arch}: the blocks are not Qwen3 decoder layers (RMSNorm, per-head q/k "
                             "norms, a gated MLP, RoPE, one bias setting for q, k, v and o)")  # fmt: skip

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        """F: the width of the concatenated target features."""
        return len(self.target_layer_ids) * self.target.hidden_size

    @property
    def block_config(self) -> ModelConfig:
        """The architecture of the drafter's blocks: `blocks` if given, else the target's layout (dllm) or
        Qwen3 blocks of the target's widths, heads and RoPE (dflash, dflash2)."""
        update = {"num_layers": self.num_layers, "init_from": None}
        if self.blocks is not None:
            return self.blocks.model_copy(update=update)
        t = self.target
        if self.architecture == "dllm":
            return t.model_copy(update=update)
        return ModelConfig(
            family="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=self.num_layers,
            num_heads=t.num_heads, num_kv_heads=t.kv_heads, head_dim=t.dim_per_head, intermediate_size=t.mlp_size,
            max_seq_len=t.max_seq_len, rope_theta=t.rope_theta, norm_eps=t.norm_eps, init_std=t.init_std,
            attention_backend=t.attention_backend, flex_compile=t.flex_compile,
        )  # fmt: skip


class DrafterKind(Section):
    """The family of a drafter folder: its config.json `model_type`, which picks the loader (DRAFTERS)."""

    model_type: Literal[DRAFTERS.names()]  # type: ignore[valid-type]
    """Drafter family: dflash (DFlash block-diffusion drafters, Chen et al. 2025)."""
