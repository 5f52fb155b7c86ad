"""Assemble a Trainer from a RunSpec: the only code that sees the whole spec.

process group -> ParallelDims -> mesh -> model on meta -> parallel.apply -> materialize weights ->
objective -> optimizer / LR -> loader -> CheckpointManager (resume when a checkpoint exists).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from dllm.checkpoint.inference import derive_profile
from dllm.checkpoint.manager import CheckpointManager
from dllm.config.registries import OBJECTIVES
from dllm.config.rules import check_topology
from dllm.config.spec import RunSpec
from dllm.data.artifact import check_layout, open_artifact
from dllm.data.loader import StepLoader
from dllm.diffusion.objectives import TokenIds
from dllm.models import factory
from dllm.parallel.apply import apply_parallelism, unwrap, wrap_replicated
from dllm.parallel.dims import DistEnv, ParallelDims, init_process_group, pick_device
from dllm.tokenization import Tokenizer, build_tokenizer
from dllm.training.host_memory import retain_freed_memory
from dllm.training.lr import LRSchedule
from dllm.training.metrics import MetricsLogger
from dllm.training.mfu import FlopsMeter, peak_flops
from dllm.training.optim import build_optimizer
from dllm.training.profiler import StepProfiler
from dllm.training.trainer import Trainer


def token_ids(tok: Tokenizer) -> TokenIds:
    return TokenIds(mask_id=tok.mask_id, eos_id=tok.eos_id, pad_id=tok.pad_id, num_tokens=tok.vocab_size)


def materialize(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device, env: DistEnv) -> None:
    """Allocate a meta-device (possibly sharded) model on `device` and load the initial weights;
    in a process group only rank 0 holds them (`full` is empty elsewhere) and broadcasts."""
    model.to_empty(device=device)
    unwrap(model).init_buffers()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=env.distributed)
    set_model_state_dict(model, full, options=options)


def build_model(spec: RunSpec, device: torch.device, env: DistEnv) -> nn.Module:
    """Model on meta -> adapters -> parallel.apply -> materialize -> DDP wrap (when replicated)."""
    cfg, lora, seed = spec.model, spec.lora, spec.training.seed
    dims = ParallelDims.from_topology(spec.topology, env.world_size)
    mesh = dims.build_mesh(device)
    with torch.device("meta"):
        model = factory.build_model(cfg, lora, seed)
    model = apply_parallelism(model, dims, mesh, spec.topology, compile=spec.training.compile)
    full = factory.initial_state(cfg, lora, seed) if env.is_main or not env.distributed else {}
    materialize(model, full, device, env)
    return wrap_replicated(model, mesh, spec.topology)


def _profiler(spec: RunSpec, run_dir: Path, device: torch.device, env: DistEnv) -> StepProfiler:
    assert spec.profiling is not None
    return StepProfiler(spec.profiling, run_dir / "profile", device, env.rank, announce=env.is_main)


def build_trainer(spec: RunSpec, run_dir: Path, env: DistEnv | None = None) -> Trainer:
    """Everything a run needs, resumed from the newest checkpoint when `checkpointing.resume: auto`."""
    env = env or DistEnv.from_environ()
    check_topology(spec, env.world_size)  # a worker started by hand with another world size
    device = pick_device(spec.training.device, env)
    if device.type == "cpu" and spec.training.cpu_allocator == "retain":
        retain_freed_memory()  # before the first step's activations: they would fault in every step
    init_process_group(env, spec.topology, device)
    tok = build_tokenizer(spec.tokenizer)
    artifact = open_artifact(spec.data.path)
    check_layout(artifact)  # a worker started without the preflight; the loader checks the values it reads
    dims = ParallelDims.from_topology(spec.topology, env.world_size)
    model = build_model(spec, device, env)
    tr = spec.training
    loader = StepLoader(
        artifact,
        global_batch_size=tr.global_batch_size,
        micro_batch_size=tr.micro_batch_size,
        dp_rank=env.rank,
        dp_size=dims.dp,
        seed=tr.seed,
        shuffle=spec.data.shuffle,
        document_ids=spec.data.document_mask,
    )
    identity: dict[str, Any] = {"tokenizer": tok.identity(), "artifact_fingerprint": artifact.fingerprint}
    profile = derive_profile(spec.objective, spec.model, tok)  # how this run's checkpoints decode
    trainer = Trainer(
        model=model,
        objective=OBJECTIVES.resolve(spec.objective.name)(
            spec.objective, token_ids(tok), chunked_loss=tr.chunked_loss, shift_logits=spec.model.shift_logits
        ),
        optimizer=build_optimizer(model, spec.optimizer),
        lr_schedule=LRSchedule(spec.scheduler, spec.optimizer.lr, tr.steps),
        loader=loader,
        checkpoints=CheckpointManager(run_dir / "checkpoints", spec.checkpointing, env, profile),
        metrics=MetricsLogger(run_dir, spec.logging, enabled=env.is_main),
        cfg=tr,
        log_cfg=spec.logging,
        env=env,
        dims=dims,
        device=device,
        identity=identity,
        aux_loss_coef=spec.model.router_aux_loss_coef,
        flops=FlopsMeter(spec.model, peak_flops(device), env.world_size),
        profiler=None if spec.profiling is None else _profiler(spec, run_dir, device, env),
    )
    latest = trainer.checkpoints.latest() if spec.checkpointing.resume == "auto" else None
    if latest is not None:
        trainer.resume(latest)
    return trainer
