"""The training loop, optimizer, LR schedule, checkpointing, logging and topology sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from dllm.config.base import Float, Int, Section, Seed
from dllm.config.observability import WandbConfig
from dllm.config.registries import LR_SCHEDULES

MAX_STEPS = 10**12
"""The most optimizer steps a run may have (a bound for the counts a checkpoint records, not a limit any run meets)."""


class TrainingConfig(Section):
    """The training loop."""

    steps: Int = Field(gt=0, le=MAX_STEPS)
    """Optimizer steps to run in total (a resumed run continues up to this step)."""
    global_batch_size: Int = Field(gt=0)
    """Sequences per optimizer step, summed over data-parallel ranks and accumulation micro-steps."""
    micro_batch_size: Int = Field(gt=0)
    """Sequences in one forward/backward on one rank."""
    seed: Seed = 0
    """Seed of weight initialisation, data order and diffusion noise."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks cuda when available, else cpu."""
    autocast_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype inside forward (torch.autocast); parameters stay float32."""
    grad_clip: Float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""
    compile: Literal["auto"] | bool = "auto"
    """torch.compile each transformer block: auto (on for CUDA, off for CPU), true, false."""
    chunked_loss: bool = True
    """LM head + cross-entropy in chunks, never materialising [tokens x vocab] logits (false: the plain reference)."""
    threads: Literal["auto"] | Annotated[Int, Field(gt=0)] = "auto"
    """CPU threads per worker process; auto: OMP_NUM_THREADS if set, else free cores (load-aware) / workers per node."""
    cpu_allocator: Literal["retain", "system"] = "retain"
    """CPU training: retain keeps freed heap memory for reuse (no page faults each step); system leaves malloc alone."""
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    """Recompute in backward: none; selective (keep matmul/attention outputs, redo the rest); full (whole blocks)."""


class OptimizerConfig(Section):
    """The optimizer."""

    name: Literal["adamw"] = "adamw"
    """Optimizer: adamw (decoupled weight decay on matrices only)."""
    lr: Float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    betas: tuple[Annotated[Float, Field(ge=0, lt=1)], Annotated[Float, Field(ge=0, lt=1)]] = (0.9, 0.95)
    """Adam beta1, beta2 (each in [0, 1): the decay of the moment averages)."""
    eps: Float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: Float = Field(default=0.1, ge=0)
    """Decoupled weight decay of weight matrices (norms, biases, embeddings are not decayed)."""


class SchedulerConfig(Section):
    """The learning-rate schedule."""

    name: Literal[LR_SCHEDULES.names()] = "cosine"  # type: ignore[valid-type]
    """Shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: Int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: Float = Field(default=0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


class CheckpointingConfig(Section):
    """When checkpoints are written and whether a run resumes."""

    every_steps: Int | None = Field(default=None, gt=0)
    """Save every N steps; null saves only at the end."""
    keep_last_n: Int = Field(default=2, gt=0)
    """Keep the newest N checkpoints, delete older ones."""
    resume: Literal["auto", "never"] = "auto"
    """auto: continue from the newest checkpoint of the run folder if there is one."""
    save_final: bool = True
    """Save a checkpoint after the last step."""
    verify: bool = True
    """Check each checkpoint file's SHA-256 and that its manifest lists them all (sizes always); false skips it."""


class LoggingConfig(Section):
    """Metrics and progress display."""

    every_steps: Int = Field(default=10, gt=0)
    """Write metrics every N steps."""
    tensorboard: Literal["auto", "on", "off"] = "auto"
    """TensorBoard event files in the run folder: auto writes them when tensorboard is installed."""
    progress: Literal["auto", "bar", "lines", "off"] = "auto"
    """Progress display: a rich bar on a terminal, plain lines otherwise."""
    wandb: WandbConfig | None = None
    """Weights & Biases logging (pip install 'dllm[wandb]'); null: off."""

    @field_validator("tensorboard", "progress", mode="before")
    @classmethod
    def _yaml_booleans(cls, v: Any, info: ValidationInfo) -> Any:
        # a boolean, or a word YAML 1.1 read as one (the loader keeps yes/no/on/off as text): off, or on
        words = {"yes": True, "on": True, "no": False, "off": False}
        v = words.get(v.lower(), v) if isinstance(v, str) else v
        if not isinstance(v, bool):
            return v
        if not v:
            return "off"
        return "on" if info.field_name == "tensorboard" else "auto"


class ContextParallelConfig(Section):
    """Context / block parallelism: G ranks share each sequence (G = cp_size for cp, bp_size for bp and csbp)."""

    mode: Literal["none", "cp", "bp", "csbp"] = "none"
    """none; cp (positions sharded); bp (noisy blocks dealt out, clean half copied); csbp (bp, clean half sharded)."""
    cp_size: Int = Field(default=1, gt=0)
    """Context-parallel degree: ranks that shard positions (cp) or the clean half x_0 (csbp); 1 otherwise."""
    bp_size: Int = Field(default=1, gt=0)
    """Block-parallel degree: ranks that split the noisy blocks (bp, csbp; a multiple of cp_size for csbp); 1 for cp."""
    schedule: Literal["dual_end", "contiguous"] = "dual_end"
    """Which rank gets which chunk/block: dual_end pairs first and last (balanced work) or contiguous runs."""
    transport: Literal["collective", "ring"] = "collective"
    """collective (all-gather K/V, all keys at once) or ring (cp - 1 shifts, one shard's score tile; slower)."""

    @property
    def group_size(self) -> int:
        """Ranks that together hold one sequence: cp_size (cp), bp_size (bp, csbp), 1 (none)."""
        return {"none": 1, "cp": self.cp_size}.get(self.mode, self.bp_size)


class TopologyConfig(Section):
    """How many processes train and how they split the work."""

    nnodes: Int = Field(default=1, gt=0)
    """Number of machines."""
    nproc_per_node: Int = Field(default=1, gt=0)
    """Worker processes per machine (one per GPU; on CPU, a few)."""
    data_parallel: Literal["fsdp", "ddp"] = "fsdp"
    """Data parallelism: fsdp (FSDP2 fully_shard, sharded parameters) or ddp (replicated)."""
    dp_size: Int = -1
    """Data-parallel degree; -1 uses every rank (world size / (context group size x tp_size))."""
    dp_replicate: Int = Field(default=1, gt=0)
    """Of dp_size, replicas that keep whole parameter shards (HSDP: fsdp shards over dp_size / dp_replicate)."""
    tp_size: Int = Field(default=1, gt=0)
    """Tensor-parallel degree: ranks that split each layer's heads, MLP width and the vocabulary."""
    sequence_parallel: bool = False
    """With tp_size > 1: norms and the residual stream between blocks sharded over positions too."""
    ep_size: Int = Field(default=1, gt=0)
    """Expert-parallel degree (MoE models): data-parallel ranks that split the experts (divides dp_size)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend: auto picks nccl on GPU and gloo on CPU."""
    context: ContextParallelConfig = ContextParallelConfig()
    """Context / block parallelism of long sequences (world size = dp_size x its group size x tp_size)."""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node
