"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", arXiv:2106.09685).

A chosen nn.Linear `y = x W^T + b` becomes `y = x W^T + b + (alpha / r) * dropout(x) A^T B^T` with
A [r, in] Kaiming-uniform (the PEFT / nn.Linear default, drawn from the given generator) and B [out, r]
zeros, so the adapted model starts out equal to the base model (paper section 4.1). Only A and B
train; `apply_lora` freezes every other parameter.

Parameter names: a `LoraLinear` keeps the base parameters where nn.Linear had them, `<path>.weight`
and `<path>.bias`, so base checkpoints load into an adapted model (strict=False: only the adapter keys
are missing) and base state_dict keys do not change; the adapter adds `<path>.lora_A.weight` [r, in]
and `<path>.lora_B.weight` [out, r] (PEFT's names without its adapter-name level). `merge_lora` folds
`scale * B A` into the base weight and restores plain nn.Linear modules, so a merged model has
exactly the base model's keys.

Targets are patterns on module names: `re:<regex>` is a full-match regular expression; anything else
is an fnmatch glob on the full dotted name ("*.q_proj", "layers.0.*") or a dotted suffix
("q_proj", "self_attn.q_proj", PEFT's list semantics). Only nn.Linear modules are adapted. A head
whose weight is used directly (Transformer.logits, the chunked LM-head loss) is not routed through
the module's forward, so an adapter there needs its caller to use `LoraLinear.merged_weight()`.

PEFT folders (`save_adapter` / `load_adapter`): adapter_config.json (peft_type LORA) and
adapter_model.safetensors with keys `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`.
`rename_module` maps a native module path to the path in the model the folder is meant for; for a
Hugging Face LlamaForCausalLM that is `"model." + path` (the native names mirror HF LLaMA's).

Dropout on the adapter input uses torch's global RNG, like every torch dropout layer; use
dropout 0 (the default) for bit-reproducible resumes. Not supported: 4-bit QLoRA (Dettmers et al.
2023) needs a GPU quantisation library (bitsandbytes) and is not supported here; neither are DoRA,
rsLoRA, per-module ranks or several adapters at once.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dllm.config.model import LoraConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoraLinear(nn.Module):
    """A frozen base linear (`weight`, `bias` at the nn.Linear names) plus a trainable B A update."""

    def __init__(self, base: nn.Linear, spec: LoraConfig) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        kw = {"bias": False, "device": base.weight.device, "dtype": base.weight.dtype}
        # skip_init: no draw from the global RNG; reset_lora_parameters uses the caller's generator
        self.lora_A = nn.utils.skip_init(nn.Linear, base.in_features, spec.rank, **kw)
        self.lora_B = nn.utils.skip_init(nn.Linear, spec.rank, base.out_features, **kw)
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.adapter_enabled = True  # False: the base linear alone (`adapters_disabled`: e.g. an rl reference)

    @torch.no_grad()
    def reset_lora_parameters(self, generator: torch.Generator) -> None:
        """A ~ Kaiming-uniform(a=sqrt(5)) as nn.Linear / PEFT do, B = 0 (Hu et al. 2021, sec. 4.1)."""
        A = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        self.lora_A.weight.copy_(A)
        self.lora_B.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return base
        return base + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A in the base dtype (computed in float32); differentiable w.r.t. A and B."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (self.weight.float() + self.scale * delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        r = self.lora_A.weight.shape[0]
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={r}, scale={self.scale}"


def target_matches(name: str, pattern: str) -> bool:
    """`re:` full-match regex, else fnmatch glob on the full name, else dotted-suffix match."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.endswith("." + pattern)


def apply_lora(model: nn.Module, spec: LoraConfig, generator: torch.Generator) -> list[str]:
    """Wrap every nn.Linear whose name matches a target in a LoraLinear, in place; freeze all other
    parameters. Returns the adapted module names. On the meta device the adapters stay
    uninitialised: call `init_lora` after materialising (and after any base-weight init, which
    would otherwise overwrite B = 0)."""
    if adapted_modules(model):
        raise ValueError("the model already has LoRA adapters; merge_lora (or rebuild) before applying again")
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    names = [n for n in linears if any(target_matches(n, p) for p in spec.targets)]
    if not names:
        raise ValueError(
            f"LoRA targets {list(spec.targets)} match no nn.Linear module; linear modules are e.g. {linears[:8]}"
        )
    for pattern in spec.targets:
        if not any(target_matches(n, pattern) for n in names):
            warnings.warn(f"LoRA target {pattern!r} matches no nn.Linear module and has no effect", stacklevel=2)
    model.requires_grad_(False)
    _wrap(model, names, spec)
    if not any(p.is_meta for p in model.parameters()):
        init_lora(model, generator)
    return names


def init_lora(model: nn.Module, generator: torch.Generator) -> None:
    """(Re)initialise every adapter, in module order, from `generator` (A Kaiming-uniform, B = 0)."""
    for lora in adapted_modules(model).values():
        lora.reset_lora_parameters(generator)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapter of `model` is off: its forward is the base model's, computed with
    the same weights (no copy). Restored on exit, even after an error."""
    modules = list(adapted_modules(model).values())
    states = [m.adapter_enabled for m in modules]
    for m in modules:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m, state in zip(modules, states, strict=True):
            m.adapter_enabled = state


def adapted_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLinear)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold scale * B A into the base weights and put plain nn.Linear modules back. Returns the names.
    The merged weights keep the base weights' requires_grad (False after apply_lora)."""
    adapted = adapted_modules(model)
    for name, lora in adapted.items():
        linear = nn.Linear(lora.in_features, lora.out_features, bias=lora.bias is not None, device="meta")
        linear.weight = nn.Parameter(lora.merged_weight(), requires_grad=lora.weight.requires_grad)
        linear.bias = lora.bias
        _set_submodule(model, name, linear)
    return list(adapted)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter parameters only, `<path>.lora_A.weight` / `<path>.lora_B.weight` (detached, not copied)."""
    sd: dict[str, torch.Tensor] = {}
    for name, m in adapted_modules(model).items():
        sd[f"{name}.lora_A.weight"] = m.lora_A.weight.detach()
        sd[f"{name}.lora_B.weight"] = m.lora_B.weight.detach()
    return sd


@torch.no_grad()
def load_lora_state_dict(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors in; the keys must be exactly those of `lora_state_dict(model)`."""
    own = lora_state_dict(model)
    _check_same_keys(set(own), set(sd), "LoRA state dict")
    for key, dst in own.items():
        if dst.shape != sd[key].shape:
            raise ValueError(f"LoRA state dict: {key} has shape {tuple(sd[key].shape)}, expected {tuple(dst.shape)}")
        dst.copy_(sd[key])


def save_adapter(
    model: nn.Module,
    folder: str | Path,
    spec: LoraConfig,
    base_model_name_or_path: str | None = None,
    rename_module: Callable[[str], str] | None = None,
) -> Path:
    """Write a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    rename = rename_module or _identity
    adapted = adapted_modules(model)
    if not adapted:
        raise ValueError("save_adapter: the model has no LoRA adapters (apply_lora first)")
    if any(m.lora_A.weight.shape[0] != spec.rank for m in adapted.values()):
        raise ValueError(f"save_adapter: the model's adapters do not have rank {spec.rank} of the given spec")
    tensors = {
        _peft_key(rename, n, ab): getattr(m, f"lora_{ab}").weight.detach().cpu().contiguous()
        for n, m in adapted.items()
        for ab in "AB"
    }
    linears = [rename(n) for n, m in model.named_modules() if isinstance(m, (nn.Linear, LoraLinear))]
    config = _peft_config(spec, [rename(n) for n in adapted], linears, base_model_name_or_path)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / (WEIGHTS_FILE + ".tmp")), metadata={"format": "pt"})
    os.replace(folder / (WEIGHTS_FILE + ".tmp"), folder / WEIGHTS_FILE)
    (folder / (CONFIG_FILE + ".tmp")).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(folder / (CONFIG_FILE + ".tmp"), folder / CONFIG_FILE)
    return folder


def load_adapter(model: nn.Module, folder: str | Path, rename_module: Callable[[str], str] | None = None) -> LoraConfig:
    """Load a PEFT LoRA folder: adapt (if not yet adapted) exactly the modules that have weights in
    the file, freeze the rest, and copy the adapter weights in. Returns the folder's spec."""
    from safetensors.torch import load_file

    folder = Path(folder)
    spec = _spec_from_peft(json.loads((folder / CONFIG_FILE).read_text()), folder / CONFIG_FILE)
    tensors = load_file(str(folder / WEIGHTS_FILE))
    rename = rename_module or _identity
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, LoraLinear))]
    names = [n for n in linears if _peft_key(rename, n, "A") in tensors]
    expected = {_peft_key(rename, n, ab) for n in names for ab in "AB"}
    _check_same_keys(expected, set(tensors), f"{folder / WEIGHTS_FILE}")
    native = {f"{n}.lora_{ab}.weight": tensors[_peft_key(rename, n, ab)] for n in names for ab in "AB"}
    if any(m.scale != spec.scale for m in adapted_modules(model).values()):
        raise ValueError(f"{folder}: the model's adapters have another alpha / rank than the folder's {spec}")
    if not adapted_modules(model):
        _check_shapes(model, native, spec.rank)  # before the model changes
        model.requires_grad_(False)
        _wrap(model, names, spec)
    load_lora_state_dict(model, native)
    return spec


def _wrap(model: nn.Module, names: Sequence[str], spec: LoraConfig) -> None:
    """Replace each named nn.Linear by an (uninitialised) LoraLinear."""
    for name in names:
        _set_submodule(model, name, LoraLinear(model.get_submodule(name), spec))


def _peft_key(rename: Callable[[str], str], module: str, ab: str) -> str:
    return f"{PEFT_PREFIX}{rename(module)}.lora_{ab}.weight"


def _check_shapes(model: nn.Module, sd: dict[str, torch.Tensor], rank: int) -> None:
    for key, t in sd.items():
        m = model.get_submodule(key.rsplit(".", 2)[0])
        want = (rank, m.in_features) if ".lora_A." in key else (m.out_features, rank)
        if tuple(t.shape) != want:
            raise ValueError(f"LoRA adapter: {key} has shape {tuple(t.shape)}, expected {want}")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _check_same_keys(expected: set[str], got: set[str], what: str) -> None:
    if expected != got:
        missing, unexpected = sorted(expected - got)[:5], sorted(got - expected)[:5]
        raise ValueError(f"{what}: missing keys {missing}, unexpected keys {unexpected} (first 5 of each)")


def _peft_config(spec: LoraConfig, adapted: list[str], linears: list[str], base: str | None) -> dict:
    """PEFT LoraConfig fields. target_modules: the short names when PEFT's suffix matching of them
    selects exactly the adapted modules, else the full module paths."""
    short = sorted({n.rpartition(".")[2] for n in adapted})
    selected = {n for n in linears if n.rpartition(".")[2] in short}
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": short if selected == set(adapted) else sorted(adapted),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def _spec_from_peft(config: dict, path: Path) -> LoraConfig:
    """The subset of PEFT's LoraConfig this module implements; anything else is an error."""
    unsupported = {
        "peft_type": config.get("peft_type") != "LORA",
        "use_dora": bool(config.get("use_dora")),
        "use_rslora": bool(config.get("use_rslora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") != "none",
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "modules_to_save": bool(config.get("modules_to_save")),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{path}: unsupported LoRA settings {bad} (plain LoRA on linear layers only)")
    targets = config["target_modules"]
    targets = ("re:" + targets,) if isinstance(targets, str) else tuple(targets)
    return LoraConfig(rank=config["r"], alpha=config["lora_alpha"], dropout=config.get("lora_dropout", 0.0),
                      targets=list(targets))  # fmt: skip


def _identity(name: str) -> str:
    return name
