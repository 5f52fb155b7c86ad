"""Preflight of a RunSpec, run before any worker starts: `dllm launch`, `dllm config validate`, and
`dllm data validate --config` (an artifact checked against a training config).

`resolve_run_spec` fills values that depend on other sections (the vocabulary size from the
tokenizer, the architecture of `model.init_from`) and raises ConfigError naming the field for
combinations that cannot work: the pure cross-field rules of `dllm.config.rules`, plus the checks
that read files or probe the machine (the data artifact, the LoRA targets on a meta-device model,
the devices). It returns warnings for settings that have no effect. It lives in training, the layer
that assembles a run, because it needs tokenization, models and data, which config sits below.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from dllm.attention.backends.auto import resolve_backend
from dllm.config.model import ModelConfig
from dllm.config.rules import check_objective, check_rl, check_topology, round_up
from dllm.config.spec import RunSpec
from dllm.data.artifact import check_layout, check_values, open_artifact
from dllm.errors import ConfigError, DataError
from dllm.models import sizing
from dllm.models.factory import build_model
from dllm.models.pretrained import merge_pretrained, pretrained_tokenizer
from dllm.models.sizing import TRAIN_BYTES_PER_PARAM, count_params, format_bytes
from dllm.staging import unwritable_problem
from dllm.tokenization import build_tokenizer
from dllm.training.build import context_plan
from dllm.training.needs import resolve_compile
from dllm.training.wandb_sink import missing_wandb_error


def resolve_run_spec(
    spec: RunSpec, *, world_size: int | None = None, check_data: bool = True
) -> tuple[RunSpec, list[str]]:
    """Resolve derived fields and check every cross-field rule; returns (spec, warnings)."""
    warnings: list[str] = []
    problem = unwritable_problem(Path(spec.run.output_dir))  # its place was checked when the config was read
    if problem is not None:
        raise ConfigError(f"run.output_dir: {problem}")
    tok = build_tokenizer(spec.tokenizer)
    if spec.objective.name == "dflash_distillation":
        spec, note = _target_as_model(spec)
        warnings += note
    model = spec.model
    if model.init_from is not None:
        model, note = _resolve_pretrained(spec, tok.vocab_size)
        warnings += note
    vocab = model.vocab_size
    if vocab is None:
        vocab = round_up(tok.vocab_size, 64)
    elif vocab < tok.vocab_size and model.init_from is None:
        raise ConfigError(
            f"model.vocab_size: {vocab} is smaller than the tokenizer's {tok.vocab_size}; raise it or set it to null"
        )
    spec = spec.model_copy(update={"model": model.model_copy(update={"vocab_size": max(vocab, tok.vocab_size)})})
    if spec.objective.name == "dflash_distillation":  # its target layers and architecture fit the target
        from dllm.checkpoint.loading import drafter_config

        drafter_config(spec.objective, spec.model, tok.mask_id)
    check_topology(spec, world_size if world_size is not None else spec.topology.world_size)
    warnings += _check_context(spec)
    device_type = _check_device(spec)
    spec = _resolve_attention(spec, device_type)
    spec = _resolve_compile(spec, device_type)
    _check_memory(spec, device_type)
    warnings += _machine_warnings(spec, device_type)
    backend = spec.model.attention_backend
    if not spec.model.flex_compile and backend in ("sdpa", "blockwise"):
        warnings.append(f"model.flex_compile: false has no effect with attention_backend {backend}")
    check_rl(spec)  # before the model section's sizes: an rl run has no data section
    if spec.rl is not None:
        warnings += _check_rl(spec, tok)
    if spec.data is not None and spec.data.seq_len > spec.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len: {spec.data.seq_len} exceeds model.max_seq_len {spec.model.max_seq_len}; raise max_seq_len"
        )
    check_objective(spec)
    if spec.lora is not None:
        _check_lora(spec)
    if check_data and spec.data is not None:
        _check_artifact(spec, tok.identity())
    if spec.topology.world_size == 1 and spec.topology.backend != "auto":
        warnings.append(f"topology.backend {spec.topology.backend} has no effect with one process")
    every = spec.checkpointing.every_steps
    if every is not None and every > spec.training.steps:
        warnings.append(
            f"checkpointing.every_steps {every} > training.steps {spec.training.steps}: only the final save happens"
        )
    warmup = spec.scheduler.warmup_steps
    if warmup > spec.training.steps:
        warnings.append(
            f"scheduler.warmup_steps {warmup} > training.steps {spec.training.steps}: the learning rate never "
            f"reaches optimizer.lr {spec.optimizer.lr:g}"
        )
    if spec.logging.tensorboard == "on" and not _has_tensorboard():
        raise ConfigError("logging.tensorboard: 'on' needs tensorboard installed (pip install tensorboard) or use auto")
    wandb = spec.logging.wandb
    if wandb is not None and wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise missing_wandb_error()
    prof = spec.profiling
    if prof is not None and prof.start_step > spec.training.steps:
        warnings.append(
            f"profiling.start_step {prof.start_step} > training.steps {spec.training.steps}: nothing is profiled"
        )
    return spec, warnings


def _target_as_model(spec: RunSpec) -> tuple[RunSpec, list[str]]:
    """A drafter run's `model` is its target's architecture (the drafter's blocks copy it; sizes,
    memory and the decode profile are read from it): filled from objective.target."""
    from dllm.checkpoint.loading import target_model_config

    notes = []
    if spec.model.model_fields_set - {"attention_backend", "flex_compile"}:
        notes.append("model: a dflash_distillation run copies its target's architecture; the model section is ignored")
    target = target_model_config(spec.objective.target)  # type: ignore[union-attr]
    keep = {"attention_backend": spec.model.attention_backend, "flex_compile": spec.model.flex_compile}
    return spec.model_copy(update={"model": target.model_copy(update={**keep, "init_from": None})}), notes


def _resolve_pretrained(spec: RunSpec, tok_vocab: int) -> tuple[ModelConfig, list[str]]:
    """The architecture of model.init_from, and a warning when the tokenizer is not the checkpoint's."""
    model = merge_pretrained(spec.model)
    warnings = []
    ships = pretrained_tokenizer(spec.model.init_from)
    if ships is not None and ships.kind == "hf" and spec.tokenizer.kind != "hf":
        warnings.append(
            f"model.init_from ships a tokenizer but tokenizer.kind is {spec.tokenizer.kind}; "
            f"set tokenizer: {{kind: hf, path: {spec.model.init_from}}} to use it"
        )
    if model.vocab_size is not None and tok_vocab > model.vocab_size:
        warnings.append(
            f"the tokenizer has {tok_vocab} ids, the checkpoint {model.vocab_size}: the embeddings grow "
            "(new rows start at the mean embedding)"
        )
    return model, warnings


def _check_rl(spec: RunSpec, tok) -> list[str]:
    """The rewards import, the prompts load with their answers, and prompt + completion fit the model:
    every rl input mistake is a ConfigError here, before any generation. Returns warnings."""
    from dllm.rl.prompts import load_prompts
    from dllm.rl.rewards import Rewards

    rl = spec.rl
    assert rl is not None and rl.prompts is not None  # check_rl
    Rewards(rl.rewards)
    task = load_prompts(rl.prompts, tok)
    longest = max(len(tok.encode(e.prompt)) for e in task.examples)
    if longest + rl.sampler.gen_length > spec.model.max_seq_len:
        raise ConfigError(
            f"rl.sampler.gen_length: the longest prompt ({longest} tokens) + {rl.sampler.gen_length} generated "
            f"tokens exceed model.max_seq_len {spec.model.max_seq_len}; lower gen_length or raise max_seq_len"
        )
    warnings = []
    if rl.sampler.temperature == 0 and rl.sampler.policy not in ("random", "ancestral", "first_hitting"):
        warnings.append("rl.sampler.temperature: 0 decodes the G completions of a prompt alike (greedy), so their "
                        "advantages are all 0; use a temperature > 0")  # fmt: skip
    return warnings


def _check_context(spec: RunSpec) -> list[str]:
    """The shard plan of context/block parallelism splits data.seq_len and its blocks (build_plan's
    checks, as ConfigError); warnings for context settings that have no effect."""
    ctx = spec.topology.context
    if ctx.mode == "none":
        unused = [f"{k} {v}" for k, v in (("cp_size", ctx.cp_size), ("bp_size", ctx.bp_size)) if v != 1]
        return [f"topology.context: {', '.join(unused)} has no effect with mode none"] if unused else []
    if ctx.group_size == 1:
        size = "cp_size" if ctx.mode == "cp" else "bp_size"
        return [f"topology.context.mode: {ctx.mode} with {size} 1 has no effect (whole sequences on every rank)"]
    for group_rank in range(ctx.group_size):  # every rank's rows (sequence parallelism splits them too)
        context_plan(spec, group_rank)
    topo = spec.topology
    if ctx.mode in ("cp", "csbp") and topo.nnodes > 1 and topo.nproc_per_node % ctx.cp_size:
        return [
            f"topology.context.cp_size {ctx.cp_size} does not divide nproc_per_node {topo.nproc_per_node}: some CP "
            "groups span two nodes and exchange K/V over the network every layer"
        ]
    return []


def _check_lora(spec: RunSpec) -> None:
    """The adapter targets must name linear layers of this model (checked on a meta-device model)."""
    try:
        with torch.device("meta"):
            build_model(spec.model, spec.lora)
    except ValueError as e:
        raise ConfigError(f"lora.targets: {e}") from None


def _resolve_attention(spec: RunSpec, device_type: str) -> RunSpec:
    """`model.attention_backend: auto` becomes the concrete backend it runs on the training device, so the
    resolved config records which attention path trains (auto's choice depends on nothing else)."""
    m = spec.model
    backend = resolve_backend(m.attention_backend, device_type, m.flex_compile)
    return spec.model_copy(update={"model": m.model_copy(update={"attention_backend": backend})})


def _resolve_compile(spec: RunSpec, device_type: str) -> RunSpec:
    """`training.compile: auto` becomes true or false for the training device (the resolved config
    records whether blocks were compiled); true without the toolchain is a ConfigError."""
    tr = spec.training
    on = resolve_compile(tr.compile, device_type)
    return spec.model_copy(update={"training": tr.model_copy(update={"compile": on})})


def _check_device(spec: RunSpec) -> str:
    """The training device type (cuda or cpu), after checking that the settings can run on it."""
    dev, topo = spec.training.device, spec.topology
    gpu = torch.cuda.is_available()
    if dev == "cuda" and not gpu:
        raise ConfigError("training.device: cuda was requested but no GPU is visible; use auto or cpu")
    on_gpu = dev == "cuda" or (dev == "auto" and gpu)
    if topo.backend == "nccl" and not on_gpu:
        raise ConfigError("topology.backend: nccl needs GPUs; use gloo (or auto) on CPU")
    if spec.model.attention_backend == "flex" and not on_gpu:
        raise ConfigError(
            "model.attention_backend: flex has no backward on CPU in this torch, so it cannot train here; "
            "use auto (flex where it helps, sdpa for gradients) or sdpa"
        )
    if spec.training.autocast_dtype == "float16" and not on_gpu:
        raise ConfigError("training.autocast_dtype: float16 autocast is GPU-only; use bfloat16 or float32 on CPU")
    if on_gpu and topo.nproc_per_node > torch.cuda.device_count():
        raise ConfigError(
            f"topology.nproc_per_node: {topo.nproc_per_node} processes but {torch.cuda.device_count()} GPU(s) visible"
        )
    return "cuda" if on_gpu else "cpu"


def _check_artifact(spec: RunSpec, tok_identity: dict) -> None:
    """The artifact fits this run; its files are checked before its manifest is believed."""
    try:
        art = open_artifact(spec.data.path)
        check_layout(art)
    except DataError as e:
        raise ConfigError(f"data.path: {e}") from None
    manifest = art.manifest
    if int(manifest["seq_len"]) != spec.data.seq_len:
        raise ConfigError(
            f"data.seq_len: {spec.data.seq_len} but the artifact {spec.data.path} was packed to "
            f"{manifest['seq_len']}; set data.seq_len: {manifest['seq_len']} or re-prepare the data"
        )
    art_tok = manifest["tokenizer"]
    for key in ("vocab_hash", "special_ids"):
        if art_tok.get(key) != tok_identity.get(key):
            raise ConfigError(
                f"tokenizer: differs from the one that prepared {spec.data.path} ({key} mismatch); "
                "use the same tokenizer section as prepare.yaml"
            )
    block = getattr(spec.objective, "block_size", None)
    prepared = manifest.get("prepare_config")
    multiple = prepared.get("pad_to_multiple") if isinstance(prepared, dict) else None
    if block is not None and isinstance(multiple, int) and multiple and multiple % block:
        raise ConfigError(
            f"objective.block_size: {block} does not divide the artifact's pad_to_multiple {multiple} "
            f"({spec.data.path}): documents would not start on block boundaries; set pad_to_multiple to a "
            "multiple of the block size in prepare.yaml and prepare again, or change block_size"
        )
    tr = spec.training
    if int(manifest["num_sequences"]) < tr.global_batch_size:
        raise ConfigError(
            f"training.global_batch_size: {tr.global_batch_size} exceeds the {manifest['num_sequences']} "
            "sequences of the artifact; lower it or add data"
        )
    try:  # after the tokenizer check: ids from another tokenizer are that mistake, not corruption
        check_values(art, int(tok_identity["vocab_size"]), trust_recorded=True)
    except DataError as e:
        raise ConfigError(f"data.path: {e}") from None


def _has_tensorboard() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def _check_memory(spec: RunSpec, device_type: str) -> None:
    """Refuse a model whose weights, gradients and optimizer state alone exceed the machine's memory
    (a lower bound: activations come on top), before anything is allocated."""
    num_params = count_params(spec.model)
    per_param = 4 if spec.lora is not None else TRAIN_BYTES_PER_PARAM  # LoRA: frozen float32 base weights
    topo = spec.topology
    shards = topo.world_size if topo.data_parallel == "fsdp" else 1
    per_rank = num_params * per_param / shards
    if device_type == "cuda":
        need, have, where = per_rank, _gpu_memory_bytes(topo.nproc_per_node), "GPU"
    else:
        need, have, where = per_rank * topo.nproc_per_node, sizing.host_memory_bytes(), "machine"
    if have and need > have:
        raise ConfigError(
            f"model: {num_params:,} parameters need at least {format_bytes(need)} per {where} for weights, "
            f"gradients and AdamW state ({per_param} bytes each), more than its {format_bytes(have)} of memory; "
            "choose a smaller model (hidden_size, num_layers, vocab_size)"
        )


def _gpu_memory_bytes(num_gpus: int) -> int:
    """Memory of the smallest of the first `num_gpus` GPUs (0 when it cannot be read)."""
    try:
        return min(torch.cuda.get_device_properties(i).total_memory for i in range(num_gpus))
    except (RuntimeError, AssertionError):  # torch without CUDA raises AssertionError here
        return 0


def _machine_warnings(spec: RunSpec, device_type: str) -> list[str]:
    """Settings that run, but slower than the user expects on this machine."""
    nproc = spec.topology.nproc_per_node
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if device_type == "cpu" and nproc > cores:
        return [
            f"topology.nproc_per_node {nproc} > the {cores} CPU core(s) here: the processes share cores "
            "and train slower than fewer would"
        ]
    return []
