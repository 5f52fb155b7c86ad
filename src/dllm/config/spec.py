"""RunSpec: the typed description of one training run, section by section.

Every section receives only what it needs downstream: `training/build.py` is the only code that
sees a whole RunSpec. Cross-section rules (batch divisibility, world size, artifact compatibility)
live in `rules.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from dllm.config.base import RelPath, Section

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
}  # fmt: skip


class ModelConfig(Section):
    """The network: one block stack whose family fields describe llama, qwen, gpt2, bert, ... layouts."""

    family: Literal["llama", "qwen2", "qwen3", "qwen3_moe", "llada", "dream", "gpt2", "bert"] = "llama"
    """Architecture family: fills the layout fields below and names the Hugging Face weight layout."""
    preset: str | None = None
    """Size preset that fills the size fields left unset here (tiny, demo, small, 350m)."""
    init_from: RelPath | None = None
    """Start from these weights: a Hugging Face folder (config.json + safetensors) or a `dllm convert` folder."""
    vocab_size: int | None = Field(default=None, gt=0)
    """Vocabulary size; null means the tokenizer's size rounded up to a multiple of 64."""
    hidden_size: int = Field(default=256, gt=0)
    """Width of the residual stream."""
    num_layers: int = Field(default=4, gt=0)
    """Number of transformer blocks."""
    num_heads: int = Field(default=4, gt=0)
    """Attention query heads."""
    num_kv_heads: int | None = Field(default=None, gt=0)
    """Key/value heads for grouped-query attention; null means num_heads (multi-head)."""
    head_dim: int | None = Field(default=None, gt=0)
    """Width of one attention head; null means hidden_size / num_heads."""
    intermediate_size: int | None = Field(default=None, gt=0)
    """Hidden width of the MLP; null means 8/3 * hidden_size rounded up to 64 (gated) or 4 * hidden (plain)."""
    max_seq_len: int = Field(default=2048, gt=0)
    """Longest sequence the model is used with (RoPE positions, or the learned position table)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation layers: RMSNorm (llama, qwen) or LayerNorm (gpt2, bert)."""
    norm_bias: bool = False
    """LayerNorm with a bias."""
    norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the normalisation layers."""
    norm_position: Literal["pre", "post"] = "pre"
    """Norm before each sub-layer (pre-LN, modern) or after the residual add (post-LN, BERT)."""
    embedding_norm: bool = False
    """Normalise the embeddings before the first block (BERT)."""
    final_norm: bool = True
    """A norm after the last block (pre-LN models)."""
    position: Literal["rope", "learned"] = "rope"
    """Positions: rotary (RoPE) or a learned absolute table of max_seq_len rows (gpt2, bert)."""
    mlp: Literal["gated", "plain"] = "gated"
    """MLP: gated (SwiGLU-style gate * up) or plain (up, activation, down)."""
    activation: Literal["silu", "gelu", "gelu_tanh"] = "silu"
    """MLP activation."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3-style)."""
    qkv_bias: bool = False
    """Bias on the query/key/value projections (Qwen2-style)."""
    attn_out_bias: bool = False
    """Bias on the attention output projection."""
    mlp_bias: bool = False
    """Biases in the MLP."""
    head: Literal["linear", "mlm"] = "linear"
    """Output head: linear, or BERT's MLM head (dense, activation, norm, then the decoder with a bias)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head weights."""
    shift_logits: bool = False
    """Position i predicts token i from the hidden state at i-1 (Dream and other AR-initialised models)."""
    num_experts: int = Field(default=0, ge=0)
    """Mixture of experts: experts per MoE layer; 0 is a dense MLP."""
    num_experts_per_tok: int = Field(default=2, gt=0)
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int | None = Field(default=None, gt=0)
    """Hidden width of one expert; null means intermediate_size."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing probabilities to sum to 1."""
    router_aux_loss_coef: float = Field(default=0.001, ge=0)
    """Weight of the load-balancing loss (Switch Transformer) added to the training loss."""
    self_condition: bool = False
    """Add an input for self-conditioning (the embedding of a previous pass's predictions, zero-initialised)."""
    init_std: float = Field(default=0.02, gt=0)
    """Standard deviation of the normal weight initialisation."""
    attention_backend: Literal["auto", "sdpa", "flex", "blockwise"] = "auto"
    """Attention: sdpa (dense mask, the reference), flex (BlockMask), blockwise (exact block-sparse SDPA), auto."""

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
        return self

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


class TokenizerConfig(Section):
    """Which tokenizer turns text into ids (the same one must prepare the data and train)."""

    kind: Literal["byte", "hf"] = "byte"
    """byte: 256 byte ids + specials, needs no files; hf: a Hugging Face tokenizer folder on disk."""
    path: RelPath | None = None
    """Folder with tokenizer.json / tokenizer_config.json (kind hf only)."""
    mask_token: str = "<|mask|>"
    """Mask token added to an hf tokenizer that has none."""

    @model_validator(mode="after")
    def _check_path(self) -> TokenizerConfig:
        if self.kind == "hf" and self.path is None:
            raise ValueError("kind 'hf' needs path: a local tokenizer folder")
        if self.kind == "byte" and self.path is not None:
            raise ValueError("kind 'byte' takes no path; remove it or use kind 'hf'")
        return self


class DataConfig(Section):
    """The prepared training data."""

    path: RelPath
    """Artifact folder written by `dllm data prepare`."""
    seq_len: int = Field(gt=0)
    """Tokens per training sequence; must equal the artifact's packed length."""
    shuffle: bool = True
    """Visit sequences in a seeded random order (a new permutation each epoch)."""
    document_mask: bool = True
    """Packed documents attend only within themselves, not across the separator into their neighbours."""


class MDLMConfig(Section):
    """Masked diffusion (MDLM / LLaDA): t ~ U(eps, 1] per sequence, CE on masked tokens weighted by w(t)."""

    name: Literal["mdlm"] = "mdlm"
    """Objective: mdlm (masked diffusion, loss weighted by the schedule's ELBO weight)."""
    schedule: Literal["linear", "cosine"] = "linear"
    """Noise schedule alpha(t): linear (alpha = 1 - t, weight 1/t) or cosine."""
    eps: float = Field(default=1e-3, gt=0, lt=1)
    """Smallest noise level: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify t over the global batch (t_i = frac(u + i/B)) to reduce loss variance."""
    normalize: Literal["token", "sequence"] = "token"
    """Loss normaliser: supervised tokens of the global batch, or each sequence by its own count (SFT)."""


class BD3LMConfig(Section):
    """Block diffusion (BD3LM, Arriola et al. 2025): [x_t ; x_0] under the block-diffusion mask."""

    name: Literal["bd3lm"] = "bd3lm"
    """Objective: bd3lm (block diffusion; loss on the noisy half only)."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per block; must divide data.seq_len."""
    schedule: Literal["linear", "cosine"] = "linear"
    """Noise schedule alpha(t) and its ELBO weight."""
    eps_min: float = Field(default=1e-3, gt=0, le=1)
    """Lower end of the noise interval: t ~ U[eps_min, eps_max] per block (BD3LM's clipped schedule)."""
    eps_max: float = Field(default=1.0, gt=0, le=1)
    """Upper end of the noise interval."""
    antithetic: bool = True
    """Stratify t over the global batch x blocks."""
    corruption: Literal["mask", "uniform"] = "mask"
    """Noise: the mask token, or uniformly random tokens (block-wise uniform-state diffusion)."""
    shift: bool = False
    """Predict token i from the hidden state at i-1 (AR-initialised models); a block start from the clean half."""

    @model_validator(mode="after")
    def _check_interval(self) -> BD3LMConfig:
        if self.eps_min >= self.eps_max:
            raise ValueError(f"eps_min {self.eps_min} must be below eps_max {self.eps_max}")
        return self


class FastDLLMv2Config(Section):
    """Fast-dLLM v2 (Wu et al. 2025): block diffusion from an AR model with complementary masks."""

    name: Literal["fast_dllm_v2"] = "fast_dllm_v2"
    """Objective: fast_dllm_v2 (every supervised token is masked in exactly one of two views)."""
    block_size: int = Field(default=32, gt=0)
    """Tokens per block; must divide data.seq_len."""
    sub_block_size: int = Field(default=8, gt=0)
    """Sub-block decoded in parallel inside a block at sampling time (recorded for the sampler)."""
    eps: float = Field(default=1e-3, gt=0, lt=1)
    """Smallest mask ratio of a block: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify the mask ratio over the global batch x blocks."""

    @model_validator(mode="after")
    def _check_sub_block(self) -> FastDLLMv2Config:
        if self.block_size % self.sub_block_size:
            raise ValueError(f"sub_block_size {self.sub_block_size} must divide block_size {self.block_size}")
        return self


class UniformConfig(Section):
    """Uniform-state diffusion: tokens replaced by random vocabulary ids with probability 1 - alpha(t)."""

    name: Literal["uniform"] = "uniform"
    """Objective: uniform (no mask token; x0-prediction cross-entropy on every supervised token)."""
    schedule: Literal["linear", "cosine"] = "linear"
    """Noise schedule alpha(t)."""
    eps: float = Field(default=1e-3, gt=0, lt=1)
    """Smallest noise level: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify t over the global batch."""
    self_condition_prob: float = Field(default=0.0, ge=0, lt=1)
    """Chance a row is conditioned on a detached first pass's predictions (needs model.self_condition)."""


ObjectiveConfig = Annotated[MDLMConfig | BD3LMConfig | FastDLLMv2Config | UniformConfig, Field(discriminator="name")]
BLOCK_OBJECTIVES = ("bd3lm", "fast_dllm_v2")


class TrainingConfig(Section):
    """The training loop."""

    steps: int = Field(gt=0)
    """Optimizer steps to run in total (a resumed run continues up to this step)."""
    global_batch_size: int = Field(gt=0)
    """Sequences per optimizer step, summed over data-parallel ranks and accumulation micro-steps."""
    micro_batch_size: int = Field(gt=0)
    """Sequences in one forward/backward on one rank."""
    seed: int = 0
    """Seed of weight initialisation, data order and diffusion noise."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks cuda when available, else cpu."""
    autocast_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype inside forward (torch.autocast); parameters stay float32."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""
    compile: bool = False
    """Compile the model with torch.compile (slow to start; pays off on GPU)."""
    chunked_loss: bool = True
    """LM head + cross-entropy in chunks, never materialising [tokens x vocab] logits (false: the plain reference)."""
    cpu_allocator: Literal["retain", "system"] = "retain"
    """CPU training: retain keeps freed heap memory for reuse (no page faults each step); system leaves malloc alone."""


class OptimizerConfig(Section):
    """The optimizer."""

    name: Literal["adamw"] = "adamw"
    """Optimizer: adamw (decoupled weight decay on matrices only)."""
    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam beta1, beta2."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay of weight matrices (norms, biases, embeddings are not decayed)."""


class SchedulerConfig(Section):
    """The learning-rate schedule."""

    name: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


class CheckpointingConfig(Section):
    """When checkpoints are written and whether a run resumes."""

    every_steps: int | None = Field(default=None, gt=0)
    """Save every N steps; null saves only at the end."""
    keep_last_n: int = Field(default=2, gt=0)
    """Keep the newest N checkpoints, delete older ones."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest checkpoint of the run folder if there is one."""
    save_final: bool = True
    """Save a checkpoint after the last step."""


class LoggingConfig(Section):
    """Metrics and progress display."""

    every_steps: int = Field(default=10, gt=0)
    """Write metrics every N steps."""
    tensorboard: Literal["auto", "on", "off"] = "auto"
    """TensorBoard event files in the run folder: auto writes them when tensorboard is installed."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Progress display: a rich bar on a terminal, plain lines otherwise."""

    @field_validator("tensorboard", "progress", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 reads a bare on/off/yes/no as a boolean
        if not isinstance(v, bool):
            return v
        if not v:
            return "off"
        return "on" if info.field_name == "tensorboard" else "auto"


class TopologyConfig(Section):
    """How many processes train and how they split the work."""

    nnodes: int = Field(default=1, gt=0)
    """Number of machines."""
    nproc_per_node: int = Field(default=1, gt=0)
    """Worker processes per machine (one per GPU; on CPU, a few)."""
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """Data parallelism: fsdp (FSDP2 fully_shard, sharded parameters) or ddp (replicated)."""
    dp_size: int = -1
    """Data-parallel degree; -1 uses every rank."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto picks nccl on GPU and gloo on CPU."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class LoraConfig(Section):
    """LoRA adapters (Hu et al. 2021): only the adapters train and are checkpointed."""

    rank: int = Field(default=8, gt=0)
    """Rank r of each adapter."""
    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator: the adapter output is multiplied by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter input (0 keeps resumes bit-identical)."""
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    """Linear layers to adapt: module-name suffixes, globs (`*.mlp.*`) or `re:<regex>`."""

    @model_validator(mode="after")
    def _no_head(self) -> LoraConfig:
        if any(t.split(".")[-1].lstrip("*") in ("lm_head", "head_transform") for t in self.targets):
            raise ValueError("adapters on the output head are not supported (its weight is used directly)")
        return self


class RunConfig(Section):
    """Where the run writes its checkpoints, metrics and resolved config."""

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name: the run folder is output_dir/name."""
    output_dir: RelPath = Field(default=Path("runs"), validate_default=True)
    """Folder that holds run folders and the `latest` link."""


class RunSpec(Section):
    """Everything one training run needs."""

    @model_validator(mode="before")
    @classmethod
    def _default_objective_name(cls, data: Any) -> Any:
        """An objective section without `name` is MDLM (the spine's objective)."""
        if isinstance(data, dict) and isinstance(data.get("objective"), dict) and "name" not in data["objective"]:
            data = {**data, "objective": {"name": "mdlm", **data["objective"]}}
        return data

    run: RunConfig = RunConfig()
    """Run folder."""
    model: ModelConfig = ModelConfig()
    """Network architecture."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer (must match the one that prepared the data)."""
    data: DataConfig
    """Prepared training data."""
    objective: ObjectiveConfig = Field(default_factory=MDLMConfig)
    """Training objective: mdlm, bd3lm, fast_dllm_v2 or uniform (`name`)."""
    training: TrainingConfig
    """Training loop."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoints and resume."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and progress."""
    topology: TopologyConfig = TopologyConfig()
    """Processes and parallelism."""
    lora: LoraConfig | None = None
    """LoRA adapters; null trains every parameter."""


SAMPLING_POLICIES = (
    "low_confidence", "random", "margin", "entropy", "threshold", "factor", "ancestral", "first_hitting", "uniform",
)  # fmt: skip
SCHEDULED_POLICIES = ("low_confidence", "random", "margin", "entropy")
"""Policies that commit a fixed number of positions per step (the schedule spreads a block over its steps)."""
PROCESS_POLICIES = ("ancestral", "first_hitting", "uniform")
"""Policies that simulate the reverse process itself (their own loop; no cache, no sub-blocks)."""


class SamplerConfig(Section):
    """How `dllm generate` / `dllm chat` turn masks into text: one loop for every policy and cache.

    Scheduled policies (low_confidence, random, margin, entropy) commit an even share of a block per
    step; threshold and factor commit as many as they trust (Fast-dLLM); a block that still has masks
    after its budget keeps going, counted as overrun, so no output ever holds a mask. Block models
    (attention: block) decode block-causally with their training block size, blocks aligned to
    positions from each prompt's start; `auto` fields are filled from the run (config.rules.resolve_sampler).
    """

    gen_length: int = Field(default=32, gt=0)
    """Tokens to generate after the prompt (max_new_tokens)."""
    block_length: int | None = Field(default=None, gt=0)
    """Semi-autoregressive block, decoded left to right; divides gen_length. null: gen_length / the run's block."""
    steps: int | None = Field(default=None, gt=0)
    """Step budget over all blocks, a multiple of the number of blocks; null: gen_length (one token per step)."""
    policy: Literal[SAMPLING_POLICIES] = "low_confidence"  # type: ignore[valid-type]
    """What to commit: low_confidence, random, margin, entropy, threshold, factor, ancestral, first_hitting, uniform."""
    threshold: float = Field(default=0.9, gt=0, le=1)
    """policy threshold: commit every masked position whose proposal has at least this probability (at least one)."""
    factor: float = Field(default=1.0, gt=0)
    """policy factor: commit the n most confident positions with (n + 1) * (1 - p_n) < factor (at least one)."""
    temperature: float = Field(default=0.0, ge=0)
    """0 is greedy; above 0 samples with Gumbel noise computed in float64."""
    top_k: int | None = Field(default=None, gt=0)
    """Sample only among the k most probable tokens (with temperature > 0); null keeps all."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens with this total probability (temperature > 0); null keeps all."""
    cfg_scale: float = Field(default=0.0, ge=0)
    """Classifier-free guidance w: uncond + (1 + w) * (cond - uncond), prompt masked in the uncond pass; 0 is off."""
    cache: Literal["none", "prefix", "dual", "block"] = "none"
    """KV cache: prefix or dual (approximate, bidirectional models), block (exact, block models), or none."""
    refresh_every: int | None = Field(default=None, gt=0)
    """prefix / dual: also refresh the cache with a full forward every N steps in a block; null: block starts only."""
    attention: Literal["auto", "bidirectional", "block"] = "auto"
    """bidirectional (MDLM, LLaDA, Dream) or block-causal (BD3LM, Fast-dLLM v2); auto: from the run's objective."""
    sub_block_length: int | None = Field(default=None, gt=0)
    """Block models: decode each block in sub-blocks of this length, left to right (Fast-dLLM v2); null: whole block."""
    shift: Literal["auto", "on", "off"] = "auto"
    """Predict position i from the hidden state at i-1 (Dream, Fast-dLLM v2); auto: from the model and the objective."""
    reuse_unchanged: bool = True
    """ancestral: a step that changes no token reuses the previous forward's logits (exact: the same input)."""
    stop_at_eos: bool = True
    """Cut each output at its first EOS and stop early once every row has one."""
    stop_strings: list[str] = Field(default_factory=list)
    """Cut each output at the first of these strings, and stop early once every row has one."""
    seed: int = 0
    """Seed of the sampling noise (temperature, random orders and the process policies)."""

    @property
    def block(self) -> int:
        """The block length in effect (gen_length when unset)."""
        return self.block_length or self.gen_length

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block

    @property
    def total_steps(self) -> int:
        """The step budget in effect (gen_length when unset)."""
        return self.steps or self.gen_length

    @model_validator(mode="after")
    def _check_blocks(self) -> SamplerConfig:
        if self.gen_length % self.block:
            raise ValueError(f"block_length {self.block} must divide gen_length {self.gen_length}")
        num_blocks = self.num_blocks
        if self.total_steps % num_blocks:
            raise ValueError(f"steps {self.total_steps} must be a multiple of the number of blocks ({num_blocks})")
        if self.sub_block_length is not None:
            if self.block % self.sub_block_length:
                raise ValueError(f"sub_block_length {self.sub_block_length} must divide block_length {self.block}")
            subs = self.block // self.sub_block_length
            if self.policy in SCHEDULED_POLICIES and (self.total_steps // num_blocks) % subs:
                raise ValueError(f"steps per block ({self.total_steps // num_blocks}) must be a multiple of the "
                                 f"{subs} sub-blocks of a block")  # fmt: skip
        if self.policy in PROCESS_POLICIES and (self.cache != "none" or self.sub_block_length is not None):
            raise ValueError(f"policy {self.policy} runs its own reverse process: use cache none, no sub-blocks")
        if self.cfg_scale > 0 and self.cache != "none":
            raise ValueError("cfg_scale > 0 runs a masked-prompt pass beside each forward: use cache none")
        if self.refresh_every is not None and self.cache not in ("prefix", "dual"):
            raise ValueError(f"refresh_every applies to the prefix and dual caches, not cache {self.cache}")
        if self.attention == "bidirectional" and (self.cache == "block" or self.sub_block_length is not None):
            raise ValueError("cache block and sub_block_length need block attention (a block-diffusion model)")
        if self.attention == "block" and self.cache in ("prefix", "dual"):
            raise ValueError(f"block models decode with the exact cache: use cache block, not {self.cache}")
        if self.attention == "block" and self.policy in ("ancestral", "first_hitting", "uniform"):
            raise ValueError(f"policy {self.policy} decodes bidirectional models; use attention bidirectional")
        return self
