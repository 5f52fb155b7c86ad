"""Load a trained model for inference from a run folder, one checkpoint folder or a model folder: its weights
(LoRA merged), tokenizer, config and decode profile (`load_for_inference`), and the targets and drafters of
speculative-decoding runs. What decoding then needs of it (the sampler resolved, the special ids, the
drafter) is inference/assembly.py's: nothing here imports sampling, so a training launch loads none of it."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dllm.checkpoint.files import vanished
from dllm.checkpoint.manager import TRAINER_STATE, latest_checkpoint, load_model_weights
from dllm.config.loading import load_config
from dllm.config.model import ModelConfig
from dllm.config.profile import PROFILE_FILE, DecodeProfile, build_profile, read_profile
from dllm.config.registries import FAMILIES, OBJECTIVES
from dllm.config.spec import RunSpec
from dllm.errors import CheckpointError, ConfigError
from dllm.models import factory
from dllm.models.families.base import is_causal_model
from dllm.models.gemma import freeze_routers
from dllm.models.hf_io import decode_facts_from_hf, is_hf_folder
from dllm.models.lora import merge_lora
from dllm.models.transformer import Transformer
from dllm.tokenization import Tokenizer, build_tokenizer

RUN_CONFIG = "config.yaml"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    model_cfg: ModelConfig
    source: Path
    """The checkpoint or pretrained folder the weights came from."""
    profile: DecodeProfile
    """How the model decodes (saved with the checkpoint or the model folder)."""
    spec: RunSpec | None = None
    """The run's config, when loaded from a run."""


def derive_profile(
    objective: object | None, model_cfg: ModelConfig, tok: Tokenizer, folder: Path | None = None
) -> DecodeProfile:
    """The decode profile of a model trained with `objective` (None: a model folder not trained here, which
    decodes as its family does, by what the Hugging Face `folder`'s config.json records of it)."""
    facts = decode_facts_from_hf(folder) if objective is None and folder is not None and is_hf_folder(folder) else None
    return build_profile(
        objective, shift_logits=model_cfg.shift_logits, max_length=model_cfg.max_seq_len, mask_id=tok.mask_id,
        pad_id=tok.pad_id, eos_id=tok.eos_id, num_tokens=tok.vocab_size, canvas_length=model_cfg.canvas_length,
        family_block=FAMILIES.resolve(model_cfg.family).block_size, vocab_size=model_cfg.vocab_size,
        folder_facts=facts,
    )  # fmt: skip


def resolve_checkpoint(run: Path | None, checkpoint: Path | None) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) from either `--run` or `--checkpoint`."""
    if (run is None) == (checkpoint is None):
        raise CheckpointError("give exactly one of --run RUN_DIR or --checkpoint CHECKPOINT_DIR")
    if checkpoint is not None:
        ckpt = Path(checkpoint)
        if not (ckpt / TRAINER_STATE).is_file():
            raise CheckpointError(f"{ckpt}: not a dllm checkpoint folder (no {TRAINER_STATE})")
        return ckpt.resolve().parent.parent, ckpt
    run_dir = Path(run)  # type: ignore[arg-type]
    if not (run_dir / RUN_CONFIG).is_file():
        raise CheckpointError(f"{run_dir}: not a run folder (no {RUN_CONFIG}); train with `dllm launch` first")
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise CheckpointError(f"{run_dir}: no checkpoint yet; wait for the first save or check checkpointing")
    return run_dir, ckpt


def load_for_inference(
    run: Path | None = None,
    checkpoint: Path | None = None,
    device: torch.device | None = None,
    model_dir: Path | None = None,
    merge: bool = True,
    dtype: torch.dtype | None = None,
) -> LoadedModel:
    """A model ready to sample: from a run folder, one checkpoint, or a pretrained folder (Hugging
    Face or `dllm convert`). `dtype` casts its weights (and so its compute and KV caches) after loading and
    merging; None keeps them as loaded (float32)."""
    if model_dir is not None:
        if run is not None or checkpoint is not None:
            raise CheckpointError("give one of --run, --checkpoint or --model")
        return _load_pretrained(Path(model_dir), device, dtype)
    run_dir, ckpt = resolve_checkpoint(run, checkpoint)
    files = _listing(ckpt)  # as chosen: a load that fails after some of them went was racing a prune
    spec = load_config(RunSpec, run_dir / RUN_CONFIG)
    if spec.objective.name == "dflash_distillation":
        raise CheckpointError(
            f"{run_dir} trained a DFlash drafter, which only proposes tokens for its target; export it with "
            f"dllm convert --to-hf OUT --run {run_dir} and pass OUT with --draft"
        )
    tok = build_tokenizer(spec.tokenizer)
    cfg = _attention_for(spec.model, device)
    model = factory.build_model(cfg, spec.lora, spec.training.seed)
    frozen_routers = OBJECTIVES.has(spec.objective.name, "frozen_routers")
    if spec.lora is not None or frozen_routers:  # the checkpoint holds what trained; the frozen rest is rebuilt
        model.load_state_dict(factory.initial_state(cfg, spec.lora, spec.training.seed))
    if frozen_routers:  # as the build froze them: the checkpoint leaves them out (DiffusionGemma's native SFT)
        freeze_routers(model)
    with _pruned_while_loading(run_dir, ckpt, files, follows_latest=run is not None):
        profile = read_profile(ckpt, spec.model.vocab_size)
        _load_run_weights(ckpt, model, run_dir, spec)
    if spec.lora is not None and merge:
        merge_lora(model)  # one matrix per layer again: as fast as the base model
    if profile is None:  # written before checkpoints carried their profile: derived once, here
        warnings.warn(f"{ckpt}: no {PROFILE_FILE} (an older checkpoint); derived it from the run's config",
                      stacklevel=2)  # fmt: skip
        profile = derive_profile(spec.objective, spec.model, tok)
    return LoadedModel(_ready(model, device, dtype), tok, spec.model, ckpt, profile, spec=spec)


def _load_run_weights(ckpt: Path, model: nn.Module, run_dir: Path, spec: RunSpec) -> None:
    """The checkpoint's weights, checked as the run's checkpointing.verify says (the message of a refused
    checkpoint names the run's config.yaml, where a user who trusts it turns that off)."""
    opt_out = f"set checkpointing.verify: false in {run_dir / RUN_CONFIG}"
    load_model_weights(ckpt, model, verify=spec.checkpointing.verify, opt_out=opt_out)


@contextmanager
def _pruned_while_loading(run_dir: Path, ckpt: Path, files: set[str], follows_latest: bool) -> Iterator[None]:
    """A checkpoint read while its run trains on can be pruned under the reader (a newer one is published
    first): a load that fails then says so, not what the half-deleted folder looks like. Pruned: some of
    `files` (the folder's files when it was chosen) went, or, when it was found through the run's `latest`
    (`follows_latest`: --run), `latest` has moved on."""
    try:
        yield
    except (CheckpointError, OSError):
        if not files <= _listing(ckpt) or (follows_latest and _latest_moved(run_dir, ckpt)):
            raise vanished(ckpt) from None
        raise


def _listing(folder: Path) -> set[str]:
    try:
        return set(os.listdir(folder))
    except OSError:
        return set()


def _latest_moved(run_dir: Path, ckpt: Path) -> bool:
    try:
        now = latest_checkpoint(run_dir / "checkpoints")
    except CheckpointError:
        return False
    return now is not None and now.name != ckpt.name


def _attention_for(cfg: ModelConfig, device: torch.device | None) -> ModelConfig:
    """The run's attention backend, except FlexAttention off CUDA: a GPU run sampled on CPU uses auto
    (a CPU flex forward compiles for every new shape, slower than a sampling call)."""
    on_cuda = device is not None and device.type == "cuda"
    return (
        cfg.model_copy(update={"attention_backend": "auto"}) if cfg.attention_backend == "flex" and not on_cuda else cfg
    )


def _ready(model: nn.Module, device: torch.device | None, dtype: torch.dtype | None = None) -> nn.Module:
    model.eval()
    model = model.to(device) if device is not None else model
    return factory.cast_weights(model, dtype) if dtype is not None else model


def _load_pretrained(folder: Path, device: torch.device | None, dtype: torch.dtype | None = None) -> LoadedModel:
    from dllm.config.data import TokenizerConfig
    from dllm.models.pretrained import pretrained_config, pretrained_state, pretrained_tokenizer

    cfg = pretrained_config(folder)
    tok = build_tokenizer(pretrained_tokenizer(folder) or TokenizerConfig())
    vocab = max(cfg.vocab_size or 0, tok.vocab_size)
    cfg = cfg.model_copy(update={"vocab_size": vocab, "init_from": folder})
    model = Transformer(cfg)
    model.load_state_dict(pretrained_state(cfg), strict=True)
    profile = read_profile(folder, vocab) or derive_profile(None, cfg, tok, folder)  # a folder from elsewhere
    return LoadedModel(_ready(model, device, dtype), tok, cfg, folder, profile)


# -- DFlash drafters and their targets ---------------------------------------------------------------
def target_model_config(path: Path) -> ModelConfig:
    """The architecture of a drafter's target (a run folder or a model folder) without loading weights;
    refuses a target that does not decode causally."""
    from dllm.models.pretrained import pretrained_config

    path = Path(path)
    check_causal_target(path)
    if (path / RUN_CONFIG).is_file():
        return load_config(RunSpec, path / RUN_CONFIG).model
    return pretrained_config(path)


def load_target(path: Path, device: torch.device | None = None) -> LoadedModel:
    """A frozen causal target for a DFlash drafter: a run folder (its newest checkpoint) or a model folder."""
    path = Path(path)
    check_causal_target(path)
    run = (path / RUN_CONFIG).is_file()
    loaded = load_for_inference(run=path, device=device) if run else load_for_inference(model_dir=path, device=device)
    loaded.model.requires_grad_(False)
    return loaded


def check_causal_target(path: Path) -> None:
    """One line when `path` is not a causal (AR) model: a run whose objective decodes causally, a model
    folder whose decode profile says so or that was never trained here and is of an AR family (as
    `generate --ar` decides, `is_causal_model`), or a Hugging Face *ForCausalLM folder without a dllm profile."""
    import json

    from dllm.models.pretrained import is_model_folder, pretrained_config

    path = Path(path)
    if (path / RUN_CONFIG).is_file():
        spec = load_config(RunSpec, path / RUN_CONFIG)
        attention, what = spec.objective.decode_facts()["attention"], f"objective {spec.objective.name}"
    elif path.is_dir():
        profile = read_profile(path)
        if profile is not None and is_model_folder(path) and is_causal_model(profile, pretrained_config(path)):
            attention, what = "causal", ""
        elif profile is not None:
            attention, what = profile.attention, f"objective {profile.objective or 'unknown'}"
        elif (path / "config.json").is_file():
            archs = json.loads((path / "config.json").read_text(encoding="utf-8")).get("architectures") or []
            causal = any(str(a).endswith("ForCausalLM") for a in archs)
            attention, what = ("causal" if causal else "bidirectional"), f"architectures {archs}"
        else:
            attention, what = "bidirectional", "a dllm model folder without a decode profile"
    else:
        raise CheckpointError(f"{path}: no such target folder; give the run or model folder of a causal (AR) model")
    if attention != "causal":
        raise CheckpointError(
            f"{path}: the target decodes with {attention} attention ({what}); DFlash drafts for a causal (AR) "
            "target: a run of objective ar, or a Hugging Face *ForCausalLM folder"
        )


def load_drafter_run(
    run: Path | None = None, checkpoint: Path | None = None, device: torch.device | None = None
) -> tuple[nn.Module, LoadedModel, RunSpec]:
    """A dflash_distillation run's drafter (attached to its target, loaded from objective.target),
    the target, and the run's config."""
    from dllm.models.dflash import DFlashDrafter

    run_dir, ckpt = resolve_checkpoint(run, checkpoint)
    spec = load_config(RunSpec, run_dir / RUN_CONFIG)
    obj = spec.objective
    if obj.name != "dflash_distillation":
        raise CheckpointError(f"{run_dir}: not a drafter run (objective {obj.name}, not dflash_distillation)")
    target = load_target(obj.target, device)
    drafter = DFlashDrafter(drafter_config(obj, target.model_cfg, target.tokenizer.mask_id))
    _load_run_weights(ckpt, drafter, run_dir, spec)
    drafter.attach(target.model)  # type: ignore[arg-type]
    return _ready(drafter, device), target, spec


def drafter_config(obj, target_cfg: ModelConfig, mask_id: int):
    """The drafter architecture of a dflash_distillation section for a target of `target_cfg`."""
    from pydantic import ValidationError

    from dllm.config.drafter import DFlashConfig

    try:
        cfg = DFlashConfig(
            num_layers=obj.num_layers, block_size=obj.block_size, target_layer_ids=tuple(obj.target_layer_ids),
            mask_id=mask_id, target=target_cfg, architecture=obj.architecture,
        )  # fmt: skip
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        fix = "" if msg.startswith(("architecture", "a target with")) else "; fix target_layer_ids"
        raise ConfigError(f"objective (dflash_distillation): {msg} (target {obj.target}){fix}") from None
    outside = [i for i in obj.init_from_target or () if not 0 <= i < target_cfg.num_layers]
    if outside:
        raise ConfigError(f"objective.init_from_target: {outside} are outside the target's {target_cfg.num_layers} "
                          f"layers (0-based) (target {obj.target})")  # fmt: skip
    if obj.init_from_target is not None:
        from dllm.models.dflash import DFlashDrafter

        try:
            DFlashDrafter.check_init_from_target(cfg, obj.init_from_target)
        except ValueError as e:
            raise ConfigError(f"objective.init_from_target: {e} (target {obj.target})") from None
    return cfg
