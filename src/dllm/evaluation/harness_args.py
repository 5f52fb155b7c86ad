"""The `--model_args` of lm-eval's `--model dllm` (evaluation/harness.py): dllm's own arguments, the
SamplerConfig fields that set the sampler, and how lm_eval's own --batch_size / --device apply."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, ValidationError

from dllm.config.base import Float, Int, Section, Seed
from dllm.config.loading import format_validation_error, read_yaml, validate_config
from dllm.config.sampler import SamplerConfig
from dllm.errors import ConfigError


class HarnessArgs(Section):
    """The `--model_args` of `--model dllm` (besides SamplerConfig fields, which set the sampler)."""

    run: str | None = None
    """A run folder (its newest checkpoint)."""
    checkpoint: str | None = None
    """One checkpoint folder of a run."""
    model: str | None = None
    """A Hugging Face or `dllm convert` model folder."""
    device: str = "cpu"
    """cpu, cuda or cuda:N."""
    kind: Literal["auto", "mdlm", "block", "ar"] = "auto"
    """How to score: auto (from the run's objective; for a model folder ar if it is a causal LM never trained
    here, else mdlm), mdlm, block, or ar (exact NLL)."""
    mc_samples: Int = Field(default=32, gt=0)
    """Monte Carlo samples of the bound per request (1 for kind ar)."""
    batch_size: Int = Field(default=8, gt=0)
    """Rows per forward: requests scored (or prompts decoded) together."""
    cfg_scale: Float | None = Field(default=None, ge=0)
    """Classifier-free guidance in the likelihood and in generation; null: the sampler's (0 by default)."""
    antithetic: bool = True
    """Stratified (evenly spaced) Monte Carlo times per row instead of independent ones."""
    seed: Seed | None = None
    """Seed of the Monte Carlo noise and of the sampler; null: the sampler's (0 by default)."""
    sampler_config: str | None = None
    """A YAML file of SamplerConfig fields; SamplerConfig fields in model_args override it."""
    max_length: Int | None = Field(default=None, gt=1)
    """Tokens per row (left truncation, rolling windows); null: the model's max_seq_len. A run trained on
    shorter rows (data.seq_len) may score better with windows of that length."""
    suffix_masks: Int = Field(default=8, ge=0)
    """loglikelihood: mask tokens after the continuation, never scored (marginalised out); 0 scores
    [context; continuation] as the whole sequence (LLaDA's scoring). See the module docstring."""


PATH_ARGS = ("run", "checkpoint", "model", "sampler_config", "device")


def parse_arg_string(arg_string: str | None) -> dict[str, Any]:
    """`key=value,key2=value2` as strings (pydantic converts them; paths keep their exact text)."""
    out: dict[str, Any] = {}
    for item in (arg_string or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"model_args: {item.strip()!r} is not KEY=VALUE")
        value = value.strip()
        out[key.strip()] = None if value.lower() in ("none", "null") else value
    return out


def parse_model_args(values: dict[str, Any]) -> tuple[HarnessArgs, SamplerConfig, bool]:
    """(harness args, SamplerConfig before resolution, whether gen_length was set) from model_args."""
    if any(not str(k).strip() for k in values):
        raise ConfigError("model_args: a value without a name ('=' alone); give KEY=VALUE pairs, e.g. run=RUN_DIR")
    mine = set(HarnessArgs.model_fields)
    sampler_fields = set(SamplerConfig.model_fields)
    unknown = sorted(set(values) - mine - sampler_fields)
    if unknown:
        raise ConfigError(
            f"model_args: unknown argument {unknown[0]!r}; use {', '.join(HarnessArgs.model_fields)} "
            "or a SamplerConfig field (policy, steps, block_length, cache, ...)"
        )
    own = {k: (str(v) if k in PATH_ARGS and v is not None else v) for k, v in values.items() if k in mine}
    try:
        args = HarnessArgs.model_validate(own)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "model_args", None)) from None
    data: dict[str, Any] = {}
    source, node = "model_args", None
    if args.sampler_config is not None:
        path = Path(args.sampler_config)
        if not path.is_file():
            raise ConfigError(f"model_args sampler_config: {path} does not exist")
        data, node = read_yaml(path)
        source = str(path)
    data.update({k: v for k, v in values.items() if k in sampler_fields and k not in mine})
    for k in ("cfg_scale", "seed"):
        if getattr(args, k) is not None:
            data[k] = getattr(args, k)
    gen_length_set = "gen_length" in data
    if not gen_length_set and data.get("block_length") is not None:
        data["gen_length"] = data["block_length"]  # each request sets its own; this only has to validate
    return args, validate_config(SamplerConfig, data, source=source, base_dir=None, node=node), gen_length_set


def merge_lm_eval_config(args: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """lm_eval's own --batch_size / --device apply where model_args do not set them. Its CLI always
    passes a device (cuda:0 by default), so a CUDA device on a machine without CUDA falls back to cpu."""
    out = dict(args)
    extra = {k: v for k, v in (extra or {}).items() if v is not None}
    if "batch_size" not in out and "batch_size" in extra:
        size = str(extra["batch_size"])
        if size.isdigit():
            out["batch_size"] = int(size)
        else:
            warnings.warn(f"--batch_size {size}: dllm takes a number of rows; using the default", stacklevel=2)
    if "device" not in out and "device" in extra:
        device = str(extra["device"])
        if device.startswith("cuda") and not torch.cuda.is_available():
            warnings.warn(f"--device {device}: CUDA is not available here; using cpu", stacklevel=2)
            device = "cpu"
        out["device"] = device
    return out


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"model_args device: {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model_args device: {name!r} is not available here; use cpu")
    return device


def optional_path(value: str | None) -> Path | None:
    return None if value is None else Path(value)
