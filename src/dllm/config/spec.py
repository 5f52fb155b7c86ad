"""RunSpec: the typed description of one training run, section by section.

Every section receives only what it needs downstream: `training/build.py` is the only code that
sees a whole RunSpec. Cross-section rules (batch divisibility, world size, artifact compatibility)
live in `rules.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

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


class ModelConfig(Section):
    """The network: a decoder-style block stack used with bidirectional attention."""

    family: Literal["llama"] = "llama"
    """Architecture family (block layout and weight names)."""
    preset: str | None = None
    """Size preset that fills the size fields left unset here (tiny, demo, small, 350m)."""
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
    """Hidden width of the SwiGLU MLP; null means 8/3 * hidden_size rounded up to a multiple of 64."""
    max_seq_len: int = Field(default=2048, gt=0)
    """Longest sequence the model is used with (RoPE positions)."""
    rope_theta: float = Field(default=10000.0, gt=0)
    """RoPE base frequency."""
    norm_eps: float = Field(default=1e-6, gt=0)
    """Epsilon of the RMSNorm layers."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3-style)."""
    qkv_bias: bool = False
    """Bias on the query/key/value projections (Qwen2-style)."""
    tie_embeddings: bool = True
    """Share the input embedding and the output head weights."""
    init_std: float = Field(default=0.02, gt=0)
    """Standard deviation of the normal weight initialisation."""
    attention_backend: Literal["sdpa"] = "sdpa"
    """Attention implementation: sdpa (PyTorch scaled_dot_product_attention, dense mask)."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") is None:
            return data
        name = data["preset"]
        if name not in MODEL_PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
        return {**MODEL_PRESETS[name], **data}

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                "set head_dim or change one of them"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}")
        if self.dim_per_head % 2:
            raise ValueError(f"head width {self.dim_per_head} must be even for RoPE")
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
        return -(-(8 * self.hidden_size // 3) // 64) * 64


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


class ObjectiveConfig(Section):
    """The training objective: masked diffusion (MDLM / LLaDA)."""

    name: Literal["mdlm"] = "mdlm"
    """Objective: mdlm (masked diffusion, loss weighted by the schedule's ELBO weight)."""
    schedule: Literal["linear", "cosine"] = "linear"
    """Noise schedule alpha(t): linear (alpha = 1 - t, weight 1/t) or cosine."""
    eps: float = Field(default=1e-3, gt=0, lt=1)
    """Smallest noise level: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify t over the global batch (t_i = frac(u + i/B)) to reduce loss variance."""


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


class RunConfig(Section):
    """Where the run writes its checkpoints, metrics and resolved config."""

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name: the run folder is output_dir/name."""
    output_dir: RelPath = Field(default=Path("runs"), validate_default=True)
    """Folder that holds run folders and the `latest` link."""


class RunSpec(Section):
    """Everything one training run needs."""

    run: RunConfig = RunConfig()
    """Run folder."""
    model: ModelConfig = ModelConfig()
    """Network architecture."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer (must match the one that prepared the data)."""
    data: DataConfig
    """Prepared training data."""
    objective: ObjectiveConfig = ObjectiveConfig()
    """Training objective."""
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


class SamplerConfig(Section):
    """How `dllm generate` turns masks into text (LLaDA semi-autoregressive sampler)."""

    gen_length: int = Field(default=32, gt=0)
    """Tokens to generate after the prompt."""
    block_length: int = Field(default=32, gt=0)
    """Semi-autoregressive block: blocks are unmasked left to right; must divide gen_length."""
    steps: int = Field(default=32, gt=0)
    """Model calls budgeted over all blocks; must be a multiple of the number of blocks."""
    policy: Literal["low_confidence", "random"] = "low_confidence"
    """Which masked positions to commit each step: the most confident, or random ones."""
    temperature: float = Field(default=0.0, ge=0)
    """0 is greedy; above 0 samples with Gumbel noise computed in float64."""
    stop_at_eos: bool = True
    """Cut each output at its first EOS and stop early once every row has one."""
    seed: int = 0
    """Seed of the sampling noise (temperature and the random policy)."""

    @model_validator(mode="after")
    def _check_blocks(self) -> SamplerConfig:
        if self.gen_length % self.block_length:
            raise ValueError(f"block_length {self.block_length} must divide gen_length {self.gen_length}")
        num_blocks = self.gen_length // self.block_length
        if self.steps % num_blocks:
            raise ValueError(f"steps {self.steps} must be a multiple of the number of blocks ({num_blocks})")
        return self
