"""The network section: family layouts, size presets, LoRA adapters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from dllm.config.base import Float, Int, PathOrHubId, Section
from dllm.config.registries import ACTIVATIONS, ATTENTION_BACKENDS, DELTA_RULES, FAMILIES, NORMS

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
    # LLaDA2.0/2.1 (inclusionAI): Ling-style MoE, sigmoid router with expert bias, expert groups, a shared expert
    "llada2_moe": {
        "qk_norm": True, "rope_theta": 600000.0, "norm_eps": 1e-6, "tie_embeddings": False, "rotary_fraction": 0.5,
        "num_experts": 8, "num_experts_per_tok": 2, "router_score": "sigmoid", "router_expert_bias": True,
        "num_shared_experts": 1, "routed_scaling_factor": 2.5, "router_aux_loss_coef": 0.0,
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
    # Qwen3.5-MoE: the same hybrid, every MLP softmax-routed experts plus one sigmoid-gated shared expert
    "qwen3_5_moe": {
        "norm": "rmsnorm_centered", "qk_norm": True, "rope_theta": 10000000.0, "rotary_fraction": 0.25,
        "attn_output_gate": True, "attention_pattern": ["linear", "linear", "linear", "global"],
        "tie_embeddings": False, "num_experts": 8, "num_experts_per_tok": 2, "num_shared_experts": 1,
        "shared_expert_gate": True,
    },
    "diffusion_gemma": {
        "embed_scale": True, "sandwich_norm": True, "qk_norm": True, "value_norm": True, "attention_scale": 1.0,
        "activation": "gelu_tanh", "layer_scale": True, "moe_layout": "beside_dense", "final_logit_softcap": 30.0,
        "canvas_conditioning": True, "attention_pattern": ["local"] * 5 + ["global"], "local_window": 512,
        "local_rope_theta": 10000.0, "rope_theta": 1000000.0, "global_rope_fraction": 0.25,
        "global_values_are_keys": True, "canvas_length": 256,
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
    linear_attention_kernel: Literal[DELTA_RULES.names()] = "torch"  # type: ignore[valid-type]
    """Linear layers' chunked delta rule: torch (the reference) or fla (flash-linear-attention, bf16/fp16 on CUDA)."""
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
    embed_scale: bool = False
    """Multiply the token embeddings by sqrt(hidden_size) (Gemma)."""
    sandwich_norm: bool = False
    """Also normalise each sub-layer's output before its residual add (Gemma 2-4)."""
    value_norm: bool = False
    """RMS-normalise the attention values, without a learned scale (Gemma 4)."""
    attention_scale: Float | None = Field(default=None, gt=0)
    """Factor on the query-key products; null: 1/sqrt(head width) (Gemma 4 uses 1 after its q/k norms)."""
    global_head_dim: Int | None = Field(default=None, gt=0)
    """Head width of the `global` layers when it differs from head_dim (Gemma 4); null: head_dim."""
    global_num_kv_heads: Int | None = Field(default=None, gt=0)
    """Key/value heads of the `global` layers (Gemma 4); null: num_kv_heads."""
    global_values_are_keys: bool = False
    """The `global` layers have no value projection: values are the key projection (Gemma 4)."""
    global_rope_fraction: Float = Field(default=1.0, gt=0, le=1)
    """Fraction of a global layer's head features RoPE rotates, at frequencies of the whole width (Gemma 4)."""
    layer_scale: bool = False
    """A per-layer scalar multiplies each block's output (Gemma 4; read from checkpoints, not trained)."""
    moe_layout: Literal["replace", "beside_dense"] = "replace"
    """Experts replace the MLP (Qwen3-MoE) or run beside a dense MLP with their own norms (Gemma 4)."""
    final_logit_softcap: Float | None = Field(default=None, gt=0)
    """Logits are cap * tanh(logits / cap) (Gemma); null: no cap."""
    canvas_conditioning: bool = False
    """DiffusionGemma's self-conditioning block on the canvas rows; true over a Gemma 4 init_from adds it, fresh."""
    canvas_length: Int | None = Field(default=None, gt=0)
    """Tokens per canvas a DiffusionGemma model decodes after its prompt (config.json canvas_length); null: none."""
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts, or an independent sigmoid per expert (LLaDA2, DeepSeek-V3)."""
    router_expert_bias: bool = False
    """A per-expert bias added to the scores when choosing experts only, not to their weights (LLaDA2)."""
    router_groups: Int = Field(default=1, gt=0)
    """Expert groups: a token's experts come from the router_topk_groups groups of best top-2 score sum."""
    router_topk_groups: Int = Field(default=1, gt=0)
    """Groups a token may route to (with router_groups > 1)."""
    routed_scaling_factor: Float = Field(default=1.0, gt=0)
    """Factor on the routed experts' weights (after the optional renormalisation)."""
    num_shared_experts: Int = Field(default=0, ge=0)
    """Experts every token goes through (one MLP of num_shared_experts * expert width), added to the routed output."""
    shared_expert_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(a linear map of the token) (Qwen3-Next, Qwen3.5-MoE)."""
    first_dense_layers: Int = Field(default=0, ge=0)
    """The first N layers of an MoE model have a dense MLP of intermediate_size (LLaDA2's first_k_dense_replace)."""
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
        out = {**merged, **data}
        if not out.get("canvas_conditioning") and "canvas_length" not in data:
            out.pop("canvas_length", None)  # a model without DiffusionGemma's canvas block decodes no canvas
        return out

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
        groups = self.router_groups
        if self.num_experts and (self.num_experts % groups or self.router_topk_groups > groups
                                 or (groups > 1 and self.num_experts // groups < 2)):  # fmt: skip
            raise ValueError(f"router_groups {groups} must split num_experts {self.num_experts} into groups of "
                             f">= 2 and router_topk_groups {self.router_topk_groups} must not exceed it")  # fmt: skip
        if self.num_experts and self.num_experts_per_tok > self.router_topk_groups * (self.num_experts // groups):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of "
                             f"router_topk_groups {self.router_topk_groups} groups")  # fmt: skip
        if self.num_experts and self.mlp != "gated":
            raise ValueError("mixture-of-experts layers use gated experts; set mlp: gated")
        if self.shared_expert_gate and not (self.num_experts and self.num_shared_experts):
            raise ValueError("shared_expert_gate gates the shared experts of an MoE model; set num_experts and "
                             "num_shared_experts > 0, or shared_expert_gate: false")  # fmt: skip
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

    def layer_classes(self, stop: int | None = None) -> list[tuple[int, int]]:
        """The layers [0, stop) (default: all) as (a representative index, how many layers share its layout):
        a layer's layout depends on its index only through its place in attention_pattern and whether it is
        one of the dense first layers, so a sum over the layers takes O(pattern) steps, whatever number of
        layers a config claims."""
        N = self.num_layers if stop is None else stop
        P = len(self.attention_pattern) if self.attention_pattern else 1
        D = min(self.first_dense_layers, N)
        classes = []
        for lo, hi in ((0, D), (D, N)):
            for r in range(P):
                first = lo + (r - lo) % P  # the first layer of [lo, hi) at place r of the pattern
                if first < hi:
                    classes.append((first, (hi - 1 - first) // P + 1))
        return classes

    @property
    def has_linear_layers(self) -> bool:
        return any(self.layer_kind(i) == "linear" for i, _ in self.layer_classes())

    @property
    def has_local_layers(self) -> bool:
        """Some layers attend through the sliding window (`local_window`)."""
        return any(self.layer_kind(i) == "local" for i, _ in self.layer_classes())

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

    def layer_heads(self, local: bool) -> tuple[int, int]:
        """(key/value heads, head width) of a local or global layer."""
        if local:
            return self.kv_heads, self.dim_per_head
        return self.global_num_kv_heads or self.kv_heads, self.global_head_dim or self.dim_per_head

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
