"""Assemble a trainer from a RunSpec: the only code that sees the whole spec.

process group -> ParallelDims -> mesh (+ CP groups, expert mesh) -> model on meta -> parallel.apply (context/block
shard plan first) -> materialize weights -> objective -> optimizer / LR -> loader (sharded by
data-parallel index) -> CheckpointManager (resume when a checkpoint exists). The start and the shared
parts (optimizer, LR, checkpoints, metrics, profiler: training/loop.py `TrainParts`) are built once for the
supervised and the rl trainer; each adds only its own parts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from dllm.checkpoint.loading import LoadedModel, derive_profile, drafter_config, load_target
from dllm.checkpoint.manager import CheckpointManager
from dllm.config.profile import DecodeProfile
from dllm.config.registries import OBJECTIVES
from dllm.config.rules import check_topology, shares_clean_stream
from dllm.config.spec import RunSpec
from dllm.data.artifact import check_layout, open_artifact
from dllm.data.loader import StepLoader
from dllm.diffusion.objectives import TokenIds
from dllm.errors import ConfigError
from dllm.models import factory
from dllm.models.gemma import freeze_routers
from dllm.parallel.apply import after_materialize, apply_parallelism, unwrap
from dllm.parallel.context import ShardPlan, build_plan
from dllm.parallel.dims import DistEnv, ParallelDims, init_process_group, pick_device
from dllm.parallel.threads import resolve_threads, use_threads
from dllm.tokenization import Tokenizer, build_tokenizer
from dllm.training.loop import TrainParts
from dllm.training.lr import LRSchedule
from dllm.training.metrics import MetricsLogger
from dllm.training.mfu import FlopsMeter, peak_flops
from dllm.training.needs import resolve_compile
from dllm.training.optim import build_optimizer
from dllm.training.profiler import StepProfiler
from dllm.training.trainer import Trainer

if TYPE_CHECKING:
    from dllm.training.grpo import GRPOTrainer


def token_ids(tok: Tokenizer) -> TokenIds:
    return TokenIds(mask_id=tok.mask_id, eos_id=tok.eos_id, pad_id=tok.pad_id, num_tokens=tok.vocab_size)


def materialize(model: nn.Module, full: dict[str, torch.Tensor], device: torch.device, env: DistEnv) -> None:
    """Allocate a meta-device (possibly sharded) model on `device` and load the initial weights;
    in a process group only rank 0 holds them (`full` is empty elsewhere) and broadcasts."""
    model.to_empty(device=device)
    unwrap(model).init_buffers()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=env.distributed)
    set_model_state_dict(model, full, options=options)


def context_plan(spec: RunSpec, group_rank: int = 0) -> ShardPlan | None:
    """The context/block shard plan of one rank of a context group (None without one): the model
    input's rows it holds, for data.seq_len and the objective's block size and layout. The preflight
    asks it too, so sizes that do not split the sequence or its blocks fail before any worker starts."""
    ctx, obj = spec.topology.context, spec.objective
    if ctx.group_size == 1:
        return None
    block, canvas = OBJECTIVES.has(obj.name, "block"), OBJECTIVES.has(obj.name, "prefix_canvas")
    layout = "prefix_canvas" if canvas else "block_diffusion" if block else "sequence"
    try:
        plan = build_plan(
            ctx.mode, spec.data.seq_len, getattr(obj, "block_size", None), ctx.cp_size, ctx.bp_size, group_rank,
            ctx.schedule, layout,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(
            f"topology.context: {e}; change cp_size/bp_size, schedule, data.seq_len or objective.block_size"
        ) from None
    tp = spec.topology.tp_size
    if spec.topology.sequence_parallel and len(plan.rows) % tp:
        raise ConfigError(
            f"topology.sequence_parallel: context rank {group_rank} holds {len(plan.rows)} rows, not divisible by "
            f"tp_size {tp}; change data.seq_len, the context sizes, or turn sequence_parallel off"
        )
    return plan


def build_model(
    spec: RunSpec, device: torch.device, env: DistEnv, dims: ParallelDims, plan: ShardPlan | None
) -> nn.Module:
    """Model on meta -> adapters -> parallel.apply -> materialize -> after_materialize (DDP wrap, TP grad hooks)."""
    cfg, lora, seed = spec.model, spec.lora, spec.training.seed
    meshes = dims.build_meshes(device)
    cp_group = dims.build_cp_group(env.rank)  # every rank builds every CP group, after the meshes
    if plan is not None and plan.layout == "prefix_canvas" and meshes is not None:
        cp_group = meshes.named["cp"].get_group()  # its routed exchange runs over the whole context group
    with torch.device("meta"):
        model = factory.build_model(cfg, lora, seed)
    model = apply_parallelism(
        model, dims, meshes, spec.topology, spec.training.compile is True, plan, cp_group,
        activation_checkpointing=spec.training.activation_checkpointing,
    )  # fmt: skip
    full = factory.initial_state(cfg, lora, seed) if env.is_main or not env.distributed else {}
    materialize(model, full, device, env)
    return after_materialize(model, meshes, spec.topology)


def build_drafter(
    spec: RunSpec, target: LoadedModel, tok: Tokenizer, device: torch.device, env: DistEnv, dims: ParallelDims
) -> nn.Module:
    """A DFlash drafter of the frozen `target` (objective dflash_distillation), built like a model: meta ->
    parallel.apply -> materialize a seeded initialisation -> after_materialize; then attached to the target."""
    from dllm.models.dflash import DFlashDrafter

    if target.tokenizer.identity()["vocab_hash"] != tok.identity()["vocab_hash"]:
        raise ConfigError(
            f"tokenizer: the target {spec.objective.target} was trained with another tokenizer; "  # type: ignore[union-attr]
            "use the target's tokenizer section"
        )
    cfg = drafter_config(spec.objective, target.model_cfg, tok.mask_id)
    meshes = dims.build_meshes(device)
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    model = apply_parallelism(model, dims, meshes, spec.topology, spec.training.compile is True,
                              activation_checkpointing=spec.training.activation_checkpointing)  # fmt: skip
    full: dict[str, torch.Tensor] = {}
    if env.is_main or not env.distributed:
        init = DFlashDrafter(cfg)
        init.init_weights(torch.Generator().manual_seed(spec.training.seed))
        if spec.objective.init_from_target is not None:  # type: ignore[union-attr]
            init.init_from_target(target.model, spec.objective.init_from_target)  # type: ignore[union-attr,arg-type]
        full = init.state_dict()
    materialize(model, full, device, env)
    target.model.to(device)
    unwrap(model).attach(target.model)
    return after_materialize(model, meshes, spec.topology)


def feature_cache(spec: RunSpec, target: LoadedModel, artifact, env: DistEnv):
    """dflash_distillation's `objective.feature_cache`: opened (and checked against the target and the data);
    built first when missing, by one pass of the target over every sequence of the artifact on rank 0."""
    import numpy as np

    from dllm.diffusion.objectives.dflash_features import MANIFEST, FeatureCache, write_feature_cache
    from dllm.training.progress import CountBar

    obj = spec.objective
    folder = Path(obj.feature_cache)  # type: ignore[union-attr, arg-type]
    layer_ids = obj.target_layer_ids  # type: ignore[union-attr]
    if env.is_main and not (folder / MANIFEST).is_file():
        assert spec.data is not None
        mb = spec.training.micro_batch_size
        reader = StepLoader(artifact, global_batch_size=mb, micro_batch_size=mb, shuffle=False,
                            document_ids=spec.data.document_mask)  # fmt: skip
        device = next(target.model.parameters()).device
        shown = spec.logging.progress != "off"
        with CountBar("sequences through the target (the feature cache)", reader.num_rows, shown, 5.0) as bar:

            def batches():
                for lo in range(0, reader.num_rows, mb):
                    yield reader.read(np.arange(lo, min(lo + mb, reader.num_rows))).to(device)
                    bar.advance(min(mb, reader.num_rows - lo))  # counted once the target's pass asks for the next

            write_feature_cache(folder, target.model, layer_ids, batches(), artifact_fingerprint=artifact.fingerprint,
                                target_name=str(obj.target))  # type: ignore[union-attr]  # fmt: skip
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # the other ranks wait for rank 0's cache
    return FeatureCache(folder, target.model, layer_ids, artifact.fingerprint)


@dataclass(frozen=True)
class _Run:
    """Where every run starts, whatever it trains: the spec (training.compile resolved), this process's
    place in the process group, the mesh's sizes, the tokenizer and the decode profile."""

    spec: RunSpec
    run_dir: Path
    env: DistEnv
    device: torch.device
    dims: ParallelDims
    tok: Tokenizer
    profile: DecodeProfile


def build_trainer(spec: RunSpec, run_dir: Path, env: DistEnv | None = None) -> Trainer | GRPOTrainer:
    """Everything a run needs, resumed from the newest checkpoint when `checkpointing.resume: auto`: the
    shared start (`_start`), the trainer's own parts, and the parts every trainer shares (`_train_parts`)."""
    run = _start(spec, run_dir, env or DistEnv.from_environ())
    trainer = _supervised_trainer(run) if run.spec.rl is None else _grpo_trainer(run)
    latest = trainer.checkpoints.latest() if run.spec.checkpointing.resume == "auto" else None
    if latest is not None:
        trainer.resume(latest)
    return trainer


def _start(spec: RunSpec, run_dir: Path, env: DistEnv) -> _Run:
    check_topology(spec, env.world_size)  # a worker started by hand with another world size
    # every process of the run: the launcher's workers (which it gave OMP_NUM_THREADS) and a one-process run
    use_threads(resolve_threads(spec.training.threads, spec.topology.nproc_per_node, os.environ))
    device = pick_device(spec.training.device, env)
    # an rl run is uncompiled (config/rules.py check_rl); elsewhere the preflight resolved training.compile:
    # auto already, and a spec built without it resolves here
    compile = False if spec.rl is not None else resolve_compile(spec.training.compile, device.type)
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"compile": compile})})
    init_process_group(env, spec.topology, device)
    tok = build_tokenizer(spec.tokenizer)
    dims = ParallelDims.from_topology(spec.topology, env.world_size)
    profile = derive_profile(spec.objective, spec.model, tok)  # how this run's checkpoints decode
    return _Run(spec, run_dir, env, device, dims, tok, profile)


def _train_parts(run: _Run, model: nn.Module, identity: dict[str, Any]) -> TrainParts:
    """What every trainer is built around: the optimizer and LR schedule, the checkpoints (carrying the
    decode profile), the metrics sinks and, with a `profiling:` section, the profiler."""
    spec, env = run.spec, run.env
    profiler = None
    if spec.profiling is not None:
        profiler = StepProfiler(spec.profiling, run.run_dir / "profile", run.device, env.rank, announce=env.is_main)
    return TrainParts(
        model=model,
        optimizer=build_optimizer(model, spec.optimizer),
        lr_schedule=LRSchedule(spec.scheduler, spec.optimizer.lr, spec.training.steps),
        checkpoints=CheckpointManager(run.run_dir / "checkpoints", spec.checkpointing, env, run.profile),
        metrics=MetricsLogger(run.run_dir, spec.logging, enabled=env.is_main),
        cfg=spec.training,
        log_cfg=spec.logging,
        env=env,
        dims=run.dims,
        device=run.device,
        identity=identity,
        profiler=profiler,
    )


def _supervised_trainer(run: _Run) -> Trainer:
    """A supervised run: the artifact and its loader (sharded by data-parallel index), the context shard
    plan, the model (or a drafter of a frozen target, which the objective also reads) and the objective."""
    spec, env, dims, tr = run.spec, run.env, run.dims, run.spec.training
    assert spec.data is not None  # RunSpec: data or rl
    artifact = open_artifact(spec.data.path)
    check_layout(artifact)  # a worker started without the preflight; the loader checks the values it reads
    plan = context_plan(spec, dims.group_rank(env.rank))
    target = load_target(spec.objective.target, run.device) if OBJECTIVES.has(spec.objective.name, "target") else None  # type: ignore[union-attr]
    if target is None:
        model = build_model(spec, run.device, env, dims, plan)
        if OBJECTIVES.has(spec.objective.name, "frozen_routers"):
            freeze_routers(model)
    else:
        model = build_drafter(spec, target, run.tok, run.device, env, dims)
    extra: dict[str, Any] = {} if target is None else {"target": target.model}
    if spec.objective.name == "fast_dllm_v2":  # one clean stream for both views where the layers allow it
        extra["shared_clean"] = shares_clean_stream(spec)
    if getattr(spec.objective, "feature_cache", None) is not None:
        extra["features"] = feature_cache(spec, target, artifact, env)  # type: ignore[arg-type]
    loader = StepLoader(
        artifact,
        global_batch_size=tr.global_batch_size,
        micro_batch_size=tr.micro_batch_size,
        dp_rank=dims.dp_index(env.rank),  # every rank of a context group reads the same micro-batches
        dp_size=dims.dp,
        seed=tr.seed,
        shuffle=spec.data.shuffle,
        document_ids=spec.data.document_mask,
    )
    identity: dict[str, Any] = {"tokenizer": run.tok.identity(), "artifact_fingerprint": artifact.fingerprint}
    objective = OBJECTIVES.resolve(spec.objective.name)(
        spec.objective, token_ids(run.tok), chunked_loss=tr.chunked_loss, shift_logits=spec.model.shift_logits, **extra
    )
    return Trainer(
        _train_parts(run, model, identity),
        objective=objective,
        loader=loader,
        aux_loss_coef=spec.model.router_aux_loss_coef,
        plan=plan,
        flops=None if target is not None else FlopsMeter(spec.model, peak_flops(run.device), env.world_size),
    )


def _grpo_trainer(run: _Run) -> GRPOTrainer:
    """An rl run (training/grpo.py): the policy; its reference (the KL anchor: a frozen copy of the
    initial weights, or with LoRA the policy's base weights with its adapters off; none when rl.beta is 0);
    the prompts, the rewards and the rollout sampler resolved against the run's decode profile.
    Data-parallel (DDP or FSDP2) over the processes, uncompiled (config/rules.py check_rl)."""
    from dllm.config.sampler import resolve_sampler
    from dllm.rl.prompts import load_prompts
    from dllm.rl.rewards import Rewards
    from dllm.sampling.canvas import SpecialIds
    from dllm.training.grpo import GRPOTrainer, Policy

    spec, rl = run.spec, run.spec.rl
    assert rl is not None and rl.prompts is not None  # check_rl
    model = build_model(spec, run.device, run.env, run.dims, None)
    # the KL anchor: with LoRA the policy's base weights (adapters off), else a frozen copy of the initial weights
    reference = frozen_reference(spec, run.device, run.env, run.dims) if rl.beta > 0 and spec.lora is None else None
    sampler = resolve_sampler(rl.sampler, run.profile)
    task = load_prompts(rl.prompts, run.tok)
    identity: dict[str, Any] = {"tokenizer": run.tok.identity(), "prompts": task.name}
    return GRPOTrainer(
        _train_parts(run, model, identity),
        reference=reference,
        reference_is_base=rl.beta > 0 and spec.lora is not None,
        rl=rl,
        task=task,
        rewards=Rewards(rl.rewards),
        policy=Policy(run.tok, SpecialIds.of(run.profile), sampler, sampler.shift == "on"),
    )


def frozen_reference(spec: RunSpec, device: torch.device, env: DistEnv, dims: ParallelDims) -> nn.Module:
    """The rl reference policy: the run's initial weights, frozen, laid out like the policy (FSDP2 shards
    it over the same ranks; its forwards run in step on every rank, one per micro-batch; with DDP a full
    copy per rank, which needs no gradient reduction and so no wrapper)."""
    cfg, lora, seed = spec.model, spec.lora, spec.training.seed
    with torch.device("meta"):
        reference = factory.build_model(cfg, lora, seed)
    reference = apply_parallelism(reference, dims, dims.build_meshes(device), spec.topology, False)
    full = factory.initial_state(cfg, lora, seed) if env.is_main or not env.distributed else {}
    materialize(reference, full, device, env)
    return reference.requires_grad_(False).eval()
