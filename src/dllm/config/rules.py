"""Cross-section rules of a RunSpec that need no I/O (pure functions of the config sections).

Each raises ConfigError naming the field for a combination that cannot work. The preflight that
reads files or probes the machine (the tokenizer's vocabulary, `model.init_from`, the data artifact,
the LoRA targets on a meta model, the devices) is `dllm.training.preflight.resolve_run_spec`, which
calls these: config sits below tokenization, models and data and imports none of them.
"""

from __future__ import annotations

from pydantic import ValidationError

from dllm.config.model import ModelConfig
from dllm.config.objectives import BLOCK_OBJECTIVES
from dllm.config.sampler import SamplerConfig
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_objective(spec: RunSpec) -> None:
    """Objective x model x data combinations that cannot work, with the reason."""
    obj, model = spec.objective, spec.model
    if obj.name in BLOCK_OBJECTIVES:
        if spec.data.seq_len % obj.block_size:
            raise ConfigError(
                f"objective.block_size: {obj.block_size} does not divide data.seq_len {spec.data.seq_len}; "
                "block diffusion needs whole blocks"
            )
        if model.shift_logits:
            raise ConfigError(
                f"model.shift_logits: {obj.name} shifts predictions itself across the two halves "
                "(objective.shift / the Fast-dLLM v2 token shift); set model.shift_logits: false"
            )
        if model.family == "bert" and obj.name == "fast_dllm_v2":
            raise ConfigError("objective.name: fast_dllm_v2 adapts autoregressive models; bert is an encoder")
    if obj.name == "uniform" and obj.self_condition_prob > 0 and not model.self_condition:
        raise ConfigError("objective.self_condition_prob: needs a model input for it; set model.self_condition: true")
    if obj.name == "uniform" and model.shift_logits:
        raise ConfigError("model.shift_logits: the uniform objective predicts x0 in place; set it to false")


def check_topology(spec: RunSpec, world_size: int) -> None:
    """World size vs topology, and batch divisibility by the data-parallel degree."""
    topo, tr = spec.topology, spec.training
    if world_size != topo.world_size:
        raise ConfigError(
            f"topology: {world_size} processes started but nnodes x nproc_per_node = {topo.world_size}; "
            "launch with `dllm launch` or fix topology"
        )
    dp = world_size if topo.dp_size == -1 else topo.dp_size
    if dp != world_size:
        raise ConfigError(
            f"topology.dp_size: {dp} does not use all {world_size} ranks (no other parallel dimension is set); use -1"
        )
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size: {tr.global_batch_size} is not divisible by micro_batch_size "
            f"{tr.micro_batch_size} x {dp} data-parallel rank(s) = {tr.micro_batch_size * dp}"
        )


def resolve_sampler(cfg: SamplerConfig, spec: RunSpec | None, model: ModelConfig | None) -> SamplerConfig:
    """Fill `attention` and `shift` from the run (objective) and the model, and refuse a sampler the
    model was not trained for. `spec` is None for a model folder (no objective known)."""
    obj = spec.objective if spec is not None else None
    block_obj = obj is not None and obj.name in BLOCK_OBJECTIVES
    attention = cfg.attention if cfg.attention != "auto" else ("block" if block_obj else "bidirectional")
    shifted = bool(model is not None and model.shift_logits) or (
        obj is not None and (obj.name == "fast_dllm_v2" or (obj.name == "bd3lm" and obj.shift))
    )
    shift = cfg.shift if cfg.shift != "auto" else ("on" if shifted else "off")
    if obj is not None and obj.name == "uniform" and cfg.policy != "uniform":
        raise ConfigError(
            f"sampler.policy: {cfg.policy} decodes mask tokens, but this run was trained with the uniform "
            "objective (no mask token); use policy uniform"
        )
    if obj is not None and obj.name != "uniform" and cfg.policy == "uniform":
        raise ConfigError(f"sampler.policy: uniform decodes uniform-state models; this run was trained with {obj.name}")
    if attention == "block" and block_obj:
        assert obj is not None and obj.name in BLOCK_OBJECTIVES
        size = obj.block_size  # type: ignore[union-attr]
        if cfg.block_length is None:
            cfg = cfg.model_copy(update={"block_length": size})
        elif cfg.block_length != size:
            raise ConfigError(
                f"sampler.block_length: this run was trained with blocks of {size}; "
                "block-causal sampling must use the same block length"
            )
        if obj.name == "fast_dllm_v2" and cfg.sub_block_length is None:
            cfg = cfg.model_copy(update={"sub_block_length": obj.sub_block_size})  # type: ignore[union-attr]
    if attention == "block" and cfg.block_length is None:
        raise ConfigError("sampler.block_length: block attention needs the model's block length; set it")
    values = {**cfg.model_dump(), "attention": attention, "shift": shift}
    try:
        return SamplerConfig.model_validate(values)
    except ValidationError as e:  # a combination that only became invalid once auto was resolved
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"sampler: {msg} (attention resolved to {attention} from the run)") from None
