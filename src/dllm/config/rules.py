"""Cross-section rules of a RunSpec, checked before any worker starts.

`resolve_run_spec` fills values that depend on other sections (the vocabulary size from the
tokenizer) and raises ConfigError naming the field for combinations that cannot work. It returns
warnings for settings that have no effect.
"""

from __future__ import annotations

from dllm.config.model import ModelConfig
from dllm.config.objectives import BLOCK_OBJECTIVES
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError, DataError


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_run_spec(
    spec: RunSpec, *, world_size: int | None = None, check_data: bool = True
) -> tuple[RunSpec, list[str]]:
    """Resolve derived fields and check every cross-field rule; returns (spec, warnings)."""
    from dllm.tokenization import build_tokenizer

    warnings: list[str] = []
    tok = build_tokenizer(spec.tokenizer)
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
    check_topology(spec, world_size if world_size is not None else spec.topology.world_size)
    _check_device(spec)
    if spec.data.seq_len > spec.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len: {spec.data.seq_len} exceeds model.max_seq_len {spec.model.max_seq_len}; raise max_seq_len"
        )
    _check_objective(spec)
    if spec.lora is not None:
        _check_lora(spec)
    if check_data:
        _check_artifact(spec, tok.identity())
    if spec.topology.world_size == 1 and spec.topology.backend != "auto":
        warnings.append(f"topology.backend {spec.topology.backend} has no effect with one process")
    every = spec.checkpointing.every_steps
    if every is not None and every > spec.training.steps:
        warnings.append(
            f"checkpointing.every_steps {every} > training.steps {spec.training.steps}: only the final save happens"
        )
    if spec.logging.tensorboard == "on" and not _has_tensorboard():
        raise ConfigError("logging.tensorboard: 'on' needs tensorboard installed (pip install tensorboard) or use auto")
    return spec, warnings


def _resolve_pretrained(spec: RunSpec, tok_vocab: int) -> tuple[ModelConfig, list[str]]:
    """The architecture of model.init_from, and a warning when the tokenizer is not the checkpoint's."""
    from dllm.models.pretrained import merge_pretrained, pretrained_tokenizer

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


def _check_objective(spec: RunSpec) -> None:
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


def _check_lora(spec: RunSpec) -> None:
    """The adapter targets must name linear layers of this model (checked on a meta-device model)."""
    import torch

    from dllm.models.factory import build_model

    try:
        with torch.device("meta"):
            build_model(spec.model, spec.lora)
    except ValueError as e:
        raise ConfigError(f"lora.targets: {e}") from None


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


def _check_device(spec: RunSpec) -> None:
    import torch

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


def _check_artifact(spec: RunSpec, tok_identity: dict) -> None:
    from dllm.data.artifact import read_manifest

    try:
        manifest = read_manifest(spec.data.path)
    except DataError as e:
        raise ConfigError(f"data.path: {e}") from None
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
    multiple = (manifest.get("prepare_config") or {}).get("pad_to_multiple")
    if block is not None and multiple and multiple % block:
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


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None
