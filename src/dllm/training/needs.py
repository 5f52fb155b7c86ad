"""What a run needs from the machine, and whether this machine has it (`dllm doctor --config`).

Unlike the preflight (which refuses a config at the first problem), every need is checked and
reported: the devices, the collective backend, compiled FlexAttention or torch.compile when the run
uses them, the optional packages the config asks for, and the free disk for the checkpoints it keeps.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dllm.attention.backends.auto import resolve_backend
from dllm.config.rules import round_up
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError, UserError
from dllm.models.sizing import count_params, format_bytes

CHECKPOINT_BYTES_PER_PARAM = 12
"""A checkpoint holds float32 weights and AdamW's two float32 moments (an upper bound for LoRA runs)."""


@dataclass(frozen=True)
class Need:
    name: str
    ok: bool
    detail: str


def check_needs(spec: RunSpec) -> list[Need]:
    """Every need of `spec` on this machine, in display order."""
    gpu = torch.cuda.is_available()
    device = spec.training.device
    on_gpu = device == "cuda" or (device == "auto" and gpu)
    needs = [_device(spec, gpu, on_gpu), _backend(spec, on_gpu), _attention(spec, on_gpu)]
    if spec.training.compile is True:
        needs.append(Need("torch.compile", *compiler_available(on_gpu)))
    needs += _packages(spec)
    needs.append(_disk(spec))
    return needs


def _device(spec: RunSpec, gpu: bool, on_gpu: bool) -> Need:
    nproc = spec.topology.nproc_per_node
    if spec.training.device == "cuda" and not gpu:
        return Need("device", False, "training.device is cuda but no GPU is visible")
    if not on_gpu:
        return Need("device", True, f"cpu, {nproc} process(es)")
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    if nproc > count:
        return Need("device", False, f"{nproc} processes per node need {nproc} GPUs; {count} visible ({name})")
    return Need("device", True, f"cuda: {count} x {name}")


def _backend(spec: RunSpec, on_gpu: bool) -> Need:
    topo = spec.topology
    if topo.world_size == 1:
        return Need("backend", True, "one process: no collectives")
    name = topo.backend if topo.backend != "auto" else ("nccl" if on_gpu else "gloo")
    have = dist.is_available() and (dist.is_nccl_available() if name == "nccl" else dist.is_gloo_available())
    return Need("backend", bool(have), f"{name} {'available' if have else 'not available in this torch build'}")


def _attention(spec: RunSpec, on_gpu: bool) -> Need:
    m = spec.model
    backend = resolve_backend(m.attention_backend, "cuda" if on_gpu else "cpu", m.flex_compile)
    if backend != "flex":
        return Need("attention", True, f"{backend}: nothing to compile")
    if not on_gpu:
        return Need("attention", False, "flex has no backward on CPU; use attention_backend auto or sdpa")
    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return Need("attention", False, "this torch has no FlexAttention")
    if not m.flex_compile:
        return Need("attention", True, "flex (eager)")
    ok, detail = compiler_available(on_gpu)
    return Need("attention", ok, f"compiled flex: {detail}")


def resolve_compile(setting: bool | str, device_type: str) -> bool:
    """Whether `training.compile` compiles on this device: true needs the toolchain (ConfigError,
    one line, without it); auto is on for CUDA when the toolchain is there, off otherwise."""
    if setting is False:
        return False
    ok, detail = compiler_available(device_type == "cuda")
    if setting is True:
        if not ok:
            raise ConfigError(f"training.compile: true needs torch.compile's toolchain: {detail}; or set compile: auto")
        return True
    return ok and device_type == "cuda"


def compiler_available(on_gpu: bool) -> tuple[bool, str]:
    """torch.compile needs triton on a GPU and a C++ compiler on a CPU (inductor builds C++ kernels; $CXX first)."""
    if on_gpu:
        ok = importlib.util.find_spec("triton") is not None
        return ok, "triton " + ("installed" if ok else "missing (pip install triton)")
    names = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    cc = next((path for name in names if name and (path := shutil.which(name))), None)
    return cc is not None, cc or "no C++ compiler found (install g++)"


def _packages(spec: RunSpec) -> list[Need]:
    wanted: list[tuple[str, str]] = []  # (import name, why)
    wandb = spec.logging.wandb
    if wandb is not None and wandb.mode != "disabled":
        wanted.append(("wandb", "logging.wandb is set: pip install 'dllm[wandb]'"))
    if spec.logging.tensorboard == "on":
        wanted.append(("tensorboard", "logging.tensorboard is on: pip install 'dllm[tensorboard]'"))
    if spec.tokenizer.kind == "hf" or spec.model.init_from is not None:
        wanted += [(p, "an hf tokenizer or model.init_from: pip install 'dllm[hf]'") for p in ("transformers",)]
    return [Need(name, importlib.util.find_spec(name) is not None, why) for name, why in wanted]


def _disk(spec: RunSpec) -> Need:
    """Free space where the checkpoints go vs keep_last_n + 1 checkpoints (a new one is complete
    before the oldest is pruned)."""
    try:
        cfg = spec.model
        if cfg.init_from is not None:
            from dllm.models.pretrained import merge_pretrained

            cfg = merge_pretrained(cfg)
        if cfg.vocab_size is None:
            from dllm.tokenization import build_tokenizer

            cfg = cfg.model_copy(update={"vocab_size": round_up(build_tokenizer(spec.tokenizer).vocab_size, 64)})
        num_params = count_params(cfg)
    except (UserError, ImportError, OSError, AssertionError) as e:
        return Need("disk", False, f"cannot size the model here ({str(e).splitlines()[0][:120]})")
    copies = spec.checkpointing.keep_last_n + 1
    need = num_params * CHECKPOINT_BYTES_PER_PARAM * copies
    folder = _existing_ancestor(Path(spec.run.output_dir))
    free = shutil.disk_usage(folder).free
    detail = (
        f"{copies} checkpoints of {num_params:,} parameters need ~{format_bytes(need)}; "
        f"{format_bytes(free)} free at {folder}"
    )
    return Need("disk", free >= need, detail)


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
