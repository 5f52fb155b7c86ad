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
    """World size vs topology (dp_size x the context group size), context/block parallelism vs the
    objective and model, and batch divisibility by the data-parallel degree."""
    topo, tr = spec.topology, spec.training
    if world_size != topo.world_size:
        raise ConfigError(
            f"topology: {world_size} processes started but nnodes x nproc_per_node = {topo.world_size}; "
            "launch with `dllm launch` or fix topology"
        )
    check_context(spec)
    group = topo.context.group_size
    if world_size % group:
        raise ConfigError(
            f"topology.context: {world_size} processes do not split into {topo.context.mode} groups of {group}; "
            f"launch a multiple of {group} processes (world size = dp_size x {group})"
        )
    dp = world_size // group if topo.dp_size == -1 else topo.dp_size
    if dp * group != world_size:
        other = "no other parallel dimension is set" if group == 1 else f"context groups of {group}"
        raise ConfigError(
            f"topology.dp_size: {dp} does not use all {world_size} ranks ({other}: dp_size must be "
            f"{world_size // group}); use -1"
        )
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size: {tr.global_batch_size} is not divisible by micro_batch_size "
            f"{tr.micro_batch_size} x {dp} data-parallel rank(s) = {tr.micro_batch_size * dp}"
        )


def check_context(spec: RunSpec) -> None:
    """Context/block parallelism (topology.context) vs the objective and the model. Whether the sizes
    split the sequence and its blocks is build_plan's to say (training.preflight asks it)."""
    ctx, obj, model = spec.topology.context, spec.objective, spec.model
    mode = ctx.mode
    if mode == "none":
        return
    if mode == "cp" and ctx.bp_size != 1:
        raise ConfigError(
            f"topology.context.bp_size: mode cp shards positions only, got bp_size {ctx.bp_size}; "
            "set bp_size: 1, or mode: csbp for cp x bp"
        )
    if mode == "bp" and ctx.cp_size != 1:
        raise ConfigError(
            f"topology.context.cp_size: mode bp keeps the clean half on every rank, got cp_size {ctx.cp_size}; "
            "set cp_size: 1, or mode: csbp to shard the clean half"
        )
    if mode == "csbp" and ctx.cp_size == 1:
        raise ConfigError("topology.context.cp_size: csbp with cp_size 1 is bp; set cp_size >= 2 or mode: bp")
    if mode == "csbp" and ctx.bp_size % ctx.cp_size:
        raise ConfigError(
            f"topology.context.bp_size: csbp needs bp_size a multiple of cp_size (each CP group holds the clean "
            f"half once), got bp_size {ctx.bp_size}, cp_size {ctx.cp_size}"
        )
    if mode in ("bp", "csbp") and not OBJECTIVES.has(obj.name, "block"):
        raise ConfigError(
            f"topology.context.mode: {mode} deals out the noisy blocks of block diffusion, and objective "
            f"{obj.name} has none; use a block objective (bd3lm, fast_dllm_v2) or mode: cp"
        )
    if model.num_experts:
        raise ConfigError(
            f"topology.context.mode: {mode} does not support MoE models (model.num_experts {model.num_experts}): "
            "the router's load-balancing loss is not a sum over rows; set mode: none"
        )
    if getattr(obj, "self_condition_prob", 0) > 0:
        raise ConfigError(
            f"objective.self_condition_prob: self-conditioning runs a second model pass, which context "
            f"parallelism (topology.context.mode {mode}) does not shard; set it to 0 or mode: none"
        )
