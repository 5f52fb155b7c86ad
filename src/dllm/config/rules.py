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


def shares_clean_stream(spec: RunSpec) -> bool:
    """Whether Fast-dLLM v2's two views run in one row over one clean stream ([x_t^1 ; x_t^2 ; x_0], 3L rows):
    as objective.shared_clean says; by default unless linear-attention layers (one x_t per row) or a
    context group (its plans shard 2L rows) run it."""
    obj = spec.objective
    return obj.name == "fast_dllm_v2" and obj.shared_clean is not False and _needs_two_rows(spec) is None


def _needs_two_rows(spec: RunSpec) -> str | None:
    """Why this model or topology runs one noisy view per row (None: it can share the clean stream)."""
    if spec.model.has_linear_layers:
        return f"the linear-attention layers of {spec.model.family} run one noisy view per row"
    if spec.topology.context.group_size > 1:
        return "topology.context splits the two-row layout [x_t ; x_0]"
    return None


def _check_shared_clean(spec: RunSpec) -> None:
    obj = spec.objective
    if obj.name == "fast_dllm_v2" and obj.shared_clean and (reason := _needs_two_rows(spec)):
        raise ConfigError(f"objective.shared_clean: {reason}; set it to false or leave it unset")


def model_rows(spec: RunSpec, seq_len: int) -> int:
    """Rows of one model input for a data sequence of `seq_len` tokens: 3L (Fast-dLLM v2's shared clean
    stream), 2L (the other block layouts [x_t ; x_0]) or L."""
    if shares_clean_stream(spec):
        return 3 * seq_len
    return seq_len * (2 if OBJECTIVES.has(spec.objective.name, "block") else 1)


def check_objective(spec: RunSpec) -> None:
    """Objective x model x data combinations that cannot work, with the reason."""
    obj, model = spec.objective, spec.model
    if OBJECTIVES.has(obj.name, "block"):
        if spec.data is not None and spec.data.seq_len % obj.block_size:
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
    if OBJECTIVES.has(obj.name, "causal") and model.shift_logits:
        raise ConfigError(
            f"model.shift_logits: {obj.name} shifts predictions itself (hidden i-1 predicts i); set it false"
        )
    if obj.name == "edit_flow" and not model.edit_head:
        raise ConfigError("objective.name: edit_flow trains edit rates; set model.edit_head: true")
    if obj.name == "edit_flow" and model.shift_logits:
        raise ConfigError("model.shift_logits: edit_flow reads each position's own state; set it to false")
    if obj.name == "uniform" and model.shift_logits:
        raise ConfigError("model.shift_logits: the uniform objective predicts x0 in place; set it to false")
    if obj.name == "dflash_distillation":
        _check_drafter_run(spec)
    if model.has_linear_layers and not (OBJECTIVES.has(obj.name, "causal") or OBJECTIVES.has(obj.name, "block")):
        raise ConfigError(
            f"objective.name: {obj.name} attends bidirectionally, which the linear-attention layers of "
            f"{model.family} (a recurrence) cannot; use ar, bd3lm or fast_dllm_v2"
        )
    if obj.name == "diffusiongemma_native_sft":
        _check_diffusion_gemma_sft(spec)
    _check_shared_clean(spec)


def _check_diffusion_gemma_sft(spec: RunSpec) -> None:
    """The native DiffusionGemma SFT: its model, a block that fits the rows, the routers kept frozen. Context,
    block and expert parallelism are exact for it (check_context, check_expert_parallel); tensor parallelism
    of its Gemma 4 layers is not implemented."""
    obj, model, topo = spec.objective, spec.model, spec.topology
    b = obj.block_size  # type: ignore[union-attr]
    router_lora = spec.lora is not None and any("router" in t for t in spec.lora.targets)
    refused = (
        (model.family != "diffusion_gemma", "model.family: diffusiongemma_native_sft trains DiffusionGemma's canvas "
         "(its self-conditioning block); use model.family: diffusion_gemma"),
        (not model.canvas_conditioning, "model.canvas_conditioning: diffusiongemma_native_sft trains DiffusionGemma's "
         "self-conditioning block, which this model lacks (a Gemma 4 checkpoint); set it true to add it, freshly "
         "initialised"),
        (model.shift_logits, "model.shift_logits: the canvas predicts each token in place; set it false"),
        (model.canvas_length not in (None, b), f"objective.block_size: {b} differs from the {model.canvas_length} "
         "tokens of the model's canvas (model.canvas_length); train with the canvas it decodes"),
        (spec.data is not None and b > spec.data.seq_len, f"objective.block_size: {b} exceeds data.seq_len "
         f"{spec.data.seq_len if spec.data else 0}; a response block must fit in a row"),
        (bool(model.num_experts) and model.router_aux_loss_coef > 0, "model.router_aux_loss_coef: this objective "
         "keeps the MoE routers frozen, so a load-balancing loss has no effect; set it to 0"),
        (router_lora, "lora.targets: this objective keeps the MoE routers frozen; remove the router targets"),
        (topo.tp_size > 1, "topology.tp_size: diffusiongemma_native_sft's Gemma 4 layers are not tensor-parallel; "
         "set tp_size: 1 (context, block and expert parallelism are supported)"),
    )  # fmt: skip
    for bad, message in refused:
        if bad:
            raise ConfigError(message)


def _check_drafter_run(spec: RunSpec) -> None:
    """A drafter run data-parallelises a small model: no adapters, tensor, context or expert parallelism."""
    topo, b = spec.topology, spec.objective.block_size  # type: ignore[union-attr]
    refused = (
        (spec.lora is not None, "lora: a DFlash drafter trains all its (few) parameters; remove the lora section"),
        (topo.tp_size > 1, "topology.tp_size: a DFlash drafter trains data-parallel only; set tp_size: 1"),
        (topo.context.group_size > 1, "topology.context: a DFlash drafter trains data-parallel only; set cp/bp 1"),
        (topo.ep_size > 1, "topology.ep_size: a DFlash drafter trains data-parallel only; set ep_size: 1"),
        (spec.data.seq_len <= b, f"data.seq_len: {spec.data.seq_len} leaves no anchor for block_size {b}"),
    )
    for bad, msg in refused:
        if bad:
            raise ConfigError(msg)


def check_topology(spec: RunSpec, world_size: int) -> None:
    """World size vs topology (dp_size x the context group size x tp_size), each parallel axis vs the
    model and objective, and batch divisibility by the data-parallel degree."""
    topo, tr = spec.topology, spec.training
    if world_size != topo.world_size:
        raise ConfigError(
            f"topology: {world_size} processes started but nnodes x nproc_per_node = {topo.world_size}; "
            "launch with `dllm launch` or fix topology"
        )
    check_context(spec)
    group, tp = topo.context.group_size, topo.tp_size
    per_dp = group * tp
    if world_size % per_dp:
        what = " x ".join(
            p for p, on in ((f"{topo.context.mode} groups of {group}", group > 1), (f"tp_size {tp}", tp > 1)) if on
        )
        field = "topology.context" if tp == 1 else "topology.tp_size" if group == 1 else "topology"
        raise ConfigError(
            f"{field}: {world_size} processes do not split into {what}; launch a multiple of {per_dp} processes "
            f"(world size = dp_size x {per_dp})"
        )
    dp = world_size // per_dp if topo.dp_size == -1 else topo.dp_size
    if dp * per_dp != world_size:
        other = (
            "no other parallel dimension is set" if per_dp == 1
            else f"context groups of {group}" if tp == 1
            else f"tp_size {tp}" if group == 1
            else f"context groups of {group} x tp_size {tp}"
        )  # fmt: skip
        raise ConfigError(
            f"topology.dp_size: {dp} does not use all {world_size} ranks ({other}: dp_size must be "
            f"{world_size // per_dp}); use -1"
        )
    if dp % topo.dp_replicate:
        raise ConfigError(f"topology.dp_replicate: {topo.dp_replicate} does not divide dp_size {dp}")
    if topo.dp_replicate > 1 and topo.data_parallel != "fsdp":
        raise ConfigError("topology.dp_replicate: replicas of FSDP shards (HSDP) need data_parallel: fsdp")
    check_tensor_parallel(spec)
    check_expert_parallel(spec, dp)
    if tr.global_batch_size % (tr.micro_batch_size * dp):
        raise ConfigError(
            f"training.global_batch_size: {tr.global_batch_size} is not divisible by micro_batch_size "
            f"{tr.micro_batch_size} x {dp} data-parallel rank(s) = {tr.micro_batch_size * dp}"
        )


def check_tensor_parallel(spec: RunSpec) -> None:
    """Tensor (and sequence) parallelism vs the model: tp_size divides every sharded dimension."""
    topo, model = spec.topology, spec.model
    tp = topo.tp_size
    if tp == 1:
        if topo.sequence_parallel:
            raise ConfigError(
                "topology.sequence_parallel: needs tp_size > 1 (it shards over the tensor-parallel ranks)"
            )
        return
    gemma4 = model.global_head_dim or model.global_num_kv_heads or model.global_values_are_keys
    if gemma4 or model.moe_layout == "beside_dense" or model.canvas_conditioning:
        raise ConfigError(f"topology.tp_size: {model.family}'s Gemma 4 layers (global layers of their own shape, "
                          "experts beside the MLP) are not tensor-parallel yet; set tp_size: 1")  # fmt: skip
    dims = {"model.num_heads": model.num_heads, "model.vocab_size": model.vocab_size}
    if not model.num_experts:
        dims["model.mlp_size"] = model.mlp_size
    for field, size in dims.items():
        if size is not None and size % tp:
            raise ConfigError(
                f"{field}: {size} is not divisible by topology.tp_size {tp}; each tensor-parallel rank holds "
                f"an equal share (choose a tp_size that divides it)"
            )
    if model.kv_heads % tp and tp % model.kv_heads:
        raise ConfigError(
            f"model.num_kv_heads: {model.kv_heads} key/value heads neither split over topology.tp_size {tp} nor "
            f"replicate evenly onto its ranks; use a tp_size that divides it or is a multiple of it"
        )
    refusals = [
        (model.num_experts > 0, "model.num_experts: tensor parallelism of MoE layers is not supported; "
         "use topology.ep_size (expert parallelism) with tp_size 1"),
        (topo.data_parallel == "ddp", "topology.data_parallel: ddp does not take tensor-parallel shards; use fsdp"),
        (spec.lora is not None, "lora: LoRA adapters are not sharded by tensor parallelism; set tp_size: 1"),
        (model.head == "mlm", "model.head: the MLM head is not tensor-parallel; set tp_size: 1"),
        (model.norm_position == "post", "model.norm_position: post-norm is not tensor-parallel; set tp_size: 1"),
        (not spec.training.chunked_loss, "training.chunked_loss: tensor parallelism needs the vocabulary-parallel "
         "chunked loss; set it to true"),
        (model.self_condition, "model.self_condition: not supported with tensor parallelism; set tp_size: 1"),
        (model.edit_head, "model.edit_head: the Edit Flows head reads whole-vocabulary logits; set tp_size: 1"),
        (model.has_linear_layers, "model.attention_pattern: linear-attention layers are not tensor-parallel; "
         "set tp_size: 1"),
        (getattr(spec.objective, "certainty", None) is not None, "objective.certainty: certainty forcing is not "
         "vocabulary-parallel yet; set topology.tp_size: 1 or leave certainty out"),
    ]  # fmt: skip
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)
    if topo.sequence_parallel:
        if not model.final_norm:
            raise ConfigError("topology.sequence_parallel: needs a model with a final norm (model.final_norm: true)")
        seq_len = spec.data.seq_len if spec.data is not None else model.max_seq_len
        rows = model_rows(spec, seq_len)
        if topo.context.mode == "none" and rows % tp:
            raise ConfigError(
                f"topology.sequence_parallel: the model input's {rows} rows are not divisible by tp_size {tp}; "
                "change data.seq_len or turn sequence_parallel off"
            )


def check_expert_parallel(spec: RunSpec, dp: int) -> None:
    """Expert parallelism vs the model and the data-parallel degree it borrows its ranks from."""
    topo, model = spec.topology, spec.model
    ep = topo.ep_size
    if ep == 1:
        return
    if not model.num_experts:
        raise ConfigError(f"topology.ep_size: {ep} needs an MoE model (model.num_experts > 0); set ep_size: 1")
    if model.num_experts % ep:
        raise ConfigError(f"topology.ep_size: {ep} does not divide model.num_experts {model.num_experts}")
    if dp % (ep * topo.dp_replicate):
        raise ConfigError(
            f"topology.ep_size: {ep} does not divide the {dp // topo.dp_replicate} data-parallel shard ranks it "
            "splits the experts over; choose ep_size dividing dp_size / dp_replicate"
        )
    if topo.data_parallel != "fsdp":
        raise ConfigError("topology.data_parallel: expert parallelism needs fsdp (ddp would replicate the experts)")
    if topo.context.group_size > 1 or topo.tp_size > 1:  # its mesh splits the data-parallel ranks only
        raise ConfigError("topology.ep_size: expert parallelism does not combine with context, block or tensor "
                          "parallelism yet; set ep_size: 1, or context.mode: none and tp_size: 1")  # fmt: skip
    if spec.lora is not None:
        raise ConfigError("lora: LoRA adapters are not supported with expert parallelism; set ep_size: 1")


def check_context(spec: RunSpec) -> None:
    """Context/block parallelism (topology.context) vs the objective and the model. Whether the sizes
    split the sequence and its blocks is build_plan's to say (training.preflight asks it)."""
    ctx, obj, model = spec.topology.context, spec.objective, spec.model
    mode = ctx.mode
    if mode == "none":
        return
    if obj.name == "nemotron_diffusion":  # its next-token loss reads x_0's rows, which bp copies to every rank
        raise ConfigError("topology.context.mode: nemotron_diffusion does not support context or block "
                          "parallelism yet; set mode: none")  # fmt: skip
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
    canvas = OBJECTIVES.has(obj.name, "prefix_canvas")  # [clean ; canvas]: canvas blocks dealt like noisy blocks
    if mode in ("bp", "csbp") and not (OBJECTIVES.has(obj.name, "block") or canvas):
        raise ConfigError(
            f"topology.context.mode: {mode} deals out the noisy blocks of block diffusion, and objective "
            f"{obj.name} has none; use a block objective (bd3lm, fast_dllm_v2, diffusiongemma_native_sft) or mode: cp"
        )
    if canvas and ctx.transport == "ring":
        raise ConfigError(
            f"topology.context.transport: ring does not carry {obj.name}'s routed K/V exchange (only the rows "
            "a sliding window reaches); set transport: collective"
        )
    if model.has_linear_layers:
        raise ConfigError(
            f"topology.context.mode: {mode} shards the sequence, and the linear-attention layers of {model.family} "
            "carry a recurrent state along it; set mode: none"
        )
    if model.num_experts and model.router_aux_loss_coef > 0:
        raise ConfigError(
            f"model.router_aux_loss_coef: {model.router_aux_loss_coef} with topology.context.mode {mode}: the "
            "router's load-balancing loss is not a sum over rows, so sharded rows cannot reproduce it; set it to 0 "
            "(routing itself is per token) or mode: none"
        )
    if obj.name == "edit_flow":
        raise ConfigError(
            f"topology.context.mode: {mode} shards fixed-length rows; edit_flow rows change length; set mode: none"
        )
    if getattr(obj, "self_condition_prob", 0) > 0 and not canvas:  # a canvas row conditions on its own logits
        raise ConfigError(
            f"objective.self_condition_prob: self-conditioning runs a second model pass, which context "
            f"parallelism (topology.context.mode {mode}) does not shard; set it to 0 or mode: none"
        )


def check_rl(spec: RunSpec) -> None:
    """An rl run (diffu-GRPO, training/grpo.py) vs the rest of the spec; before any generation."""
    rl, tr, obj = spec.rl, spec.training, spec.objective
    if rl is None:
        return
    if rl.prompts is None:
        raise ConfigError(
            "rl.prompts: an rl run needs prompts with reference answers; set rl.prompts.task "
            "(a built-in task such as addition) or rl.prompts.path (a JSONL of prompt/answer)"
        )
    if rl.group_size < 2:  # RLConfig refuses it too; kept here for specs built without validation
        raise ConfigError(f"rl.group_size: GRPO compares completions within a group; needs >= 2, got {rl.group_size}")
    if spec.data is not None:
        raise ConfigError("data: an rl run generates its own batches from rl.prompts; remove the data section")
    if obj.name != "mdlm":
        raise ConfigError(
            f"objective.name: rl estimates log-probs of masked (bidirectional) diffusion models; {obj.name} is "
            "not supported yet: use mdlm (the objective the policy was trained with)"
        )
    if tr.global_batch_size % rl.group_size:
        raise ConfigError(
            f"training.global_batch_size: {tr.global_batch_size} completions per round is not a multiple of "
            f"rl.group_size {rl.group_size} (completions per prompt)"
        )
    if tr.steps % rl.inner_updates:
        raise ConfigError(
            f"training.steps: {tr.steps} optimizer steps is not a multiple of rl.inner_updates {rl.inner_updates} "
            "(steps = rounds x inner_updates)"
        )
    every = spec.checkpointing.every_steps
    if every is not None and every % rl.inner_updates:
        raise ConfigError(
            f"checkpointing.every_steps: {every} must be a multiple of rl.inner_updates {rl.inner_updates} "
            "(checkpoints are written between generation rounds)"
        )
    topo = spec.topology
    if topo.context.mode != "none" or topo.tp_size > 1:
        raise ConfigError("topology: rl runs data-parallel only (ddp or fsdp); set tp_size: 1 and context.mode: none")
    per_rank = tr.global_batch_size // rl.group_size
    if per_rank % topo.world_size:
        raise ConfigError(
            f"training.global_batch_size: {per_rank} prompts per round (global_batch_size / rl.group_size) do not "
            f"split over {topo.world_size} processes; each rank generates whole groups for its own prompts"
        )
    if spec.training.autocast_dtype != "float32":
        raise ConfigError("training.autocast_dtype: rl trains in float32 for now; set it to float32")
