"""Cross-section rules of a RunSpec that need no I/O (pure functions of the config sections).

Each raises ConfigError naming the field for a combination that cannot work. The preflight that
reads files or probes the machine (the tokenizer's vocabulary, `model.init_from`, the data artifact,
the LoRA targets on a meta model, the devices) is `dllm.training.preflight.resolve_run_spec`, which
calls these: config sits below tokenization, models and data and imports none of them.
"""

from __future__ import annotations

from dllm.config.registries import OBJECTIVES
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_objective(spec: RunSpec) -> None:
    """Objective x model x data combinations that cannot work, with the reason."""
    obj, model = spec.objective, spec.model
    if OBJECTIVES.has(obj.name, "block"):
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
