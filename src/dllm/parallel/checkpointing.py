"""Activation checkpointing of the transformer blocks (`training.activation_checkpointing`), and a
meter of the activation memory a forward keeps for its backward.

Modes:
- `none`: autograd keeps every tensor the backward needs (fastest, most memory).
- `full`: each block keeps only its inputs; its whole forward is recomputed in the backward
  (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"): about one more forward of
  the blocks per step, the least memory.
- `selective`: a per-op policy (`selective_policy`) keeps the outputs of the expensive ops (matrix
  multiplies, attention kernels, functional collectives) and recomputes the cheap ones (norms,
  activations, RoPE, residual adds, softmax of the router, indexing) from them (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2, applied per
  op). Almost no extra FLOPs; saves the inputs of each matmul that only pointwise ops produced.

How: each block's `forward` is replaced on the instance by one that runs the class's forward under
non-reentrant `torch.utils.checkpoint` (use_reentrant=False), so parameter and buffer names,
`state_dict` keys and checkpoints are those of the plain model (no wrapper module in the path).
The RNG state is saved and restored around the recompute (preserve_rng_state), so dropout in a LoRA
adapter draws the same mask twice; the native blocks use no randomness. Loss and gradients equal the
plain model's. A forward without gradients (sampling, evaluation, the self-conditioning pass) or with
a KV cache calls the plain forward.

Composition (parallel/apply.py order: TP -> CP -> activation checkpointing -> compile -> FSDP2):
- context parallelism: its attention all-gathers (or ring-shifts) K/V in the forward; the recompute
  issues those collectives again in the backward. Every rank recomputes the same blocks in the same
  order, so the collectives still pair up. torch.distributed's in-place collectives write into a
  buffer their caller allocated, so the selective policy recomputes them rather than caching them.
- `block.compile()` traces the replaced forward (checkpoint becomes a higher-order op in the graph).
- FSDP2 `fully_shard(block)`: its hooks wrap the module call; the recompute runs inside the block's
  backward, after FSDP has gathered the block's parameters again.

Shapes: none here (whole blocks and autograd-saved tensors of any shape).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES: tuple[str, ...] = ("none", "selective", "full")

_ATTR = "_dllm_activation_checkpointing"  # the mode, on each checkpointed block (not a parameter or buffer)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every block of `model.layers` (in place; returns the model). `none`: unchanged.
    Apply after context parallelism and before compile and FSDP2 (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"unknown activation checkpointing mode {mode!r} (none, selective or full)")
    if mode == "none":
        return model
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("activation checkpointing needs a dllm Transformer (model.layers, a list of blocks)")
    for block in layers:
        if getattr(block, _ATTR, None) is not None:
            raise ValueError("activation checkpointing is already applied to this model")
        setattr(block, _ATTR, mode)
        # a bound method, not a closure: copy.deepcopy rebinds it to the copied block
        block.forward = types.MethodType(_checkpointed_forward, block)
    return model


def checkpointing_mode(model: nn.Module) -> str:
    """The mode `apply_activation_checkpointing` gave the blocks of `model` (none if it was not applied)."""
    layers = getattr(model, "layers", None) or []
    return getattr(layers[0], _ATTR, "none") if len(layers) else "none"


def _checkpointed_forward(
    block: nn.Module, x: torch.Tensor, rope: Any, mask: Any, num_queries: int | None = None, kv: Any = None
) -> Any:
    """The block's own forward, under checkpoint when gradients are recorded (training) and no KV
    cache is written (the cache's in-place writes must happen once)."""
    forward = functools.partial(type(block).forward, block)
    if kv is not None or not torch.is_grad_enabled():
        return forward(x, rope, mask, num_queries, kv)
    # full: torch's own default context_fn (compile recognises it and recomputes the whole region)
    options = {"context_fn": _selective_contexts} if getattr(block, _ATTR) == "selective" else {}
    return checkpoint(forward, x, rope, mask, num_queries, kv, use_reentrant=False, preserve_rng_state=True, **options)


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(selective_policy)


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs the selective policy keeps (those this torch build has):
    - matrix multiplies: aten mm, addmm, bmm, baddbmm, linear (nn.Linear and F.linear dispatch to
      mm/addmm; MoE experts too), _grouped_mm, _scaled_mm;
    - attention kernels: every scaled_dot_product variant (flash, flash for CPU, efficient, cuDNN,
      overrideable) and FlexAttention's higher-order op;
    - functional collectives (_c10d_functional all_gather_into_tensor, reduce_scatter_tensor,
      all_reduce, all_to_all_single): pure ops whose result can be replayed; the in-place
      torch.distributed collectives (c10d.allgather_ ...) are recomputed (see the module doc)."""
    names = {
        torch.ops.aten: [
            "mm", "addmm", "bmm", "baddbmm", "linear", "_grouped_mm", "_scaled_mm",
            "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_fused_attention_overrideable",
        ],
        torch.ops._c10d_functional: [
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
        ],
    }  # fmt: skip
    ops: set[Any] = set()
    for namespace, op_names in names.items():
        for name in op_names:
            if hasattr(namespace, name):
                ops.add(getattr(namespace, name).default)
    if hasattr(torch.ops.higher_order, "flex_attention"):
        ops.add(torch.ops.higher_order.flex_attention)
    return frozenset(ops)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of `saved_ops()` (MUST_SAVE); recompute everything else (PREFER_RECOMPUTE:
    norms, activations, RoPE, residual adds, views, indexing, the router's softmax and top-k)."""
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------------------------------
# the meter


class _StorageRecorder(TorchDispatchMode):
    """Holds (a reference to) every storage an op allocates during the forward, keyed by the storage
    itself (`_storage_id`), not its data pointer: FSDP2 frees a storage's memory in place
    (`resize_(0)`) and the allocator may hand that address to a later activation. An output that
    shares a storage with one of the op's inputs (a view, an in-place or out= op) is not new: its
    storage was recorded when it was made, or it predates the forward (inputs, parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, torch.UntypedStorage] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor (or async collective) runs it as ops on its inner tensors: seen here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage_id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (key := _storage_id(t)) and key not in inputs:
                self.storages.setdefault(key, t.untyped_storage())
        return out


def _storage_id(t: torch.Tensor) -> int:
    """The identity of the tensor's storage, shared by its views (0 for meta tensors); a wrapper
    subclass's (DTensor, an async collective's result) is its inner tensor's: the wrapper has none."""
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return _storage_id(getattr(t, inner[0]))
    return 0 if t.device.type == "meta" else t.untyped_storage()._cdata


def saved_activation_bytes(fn: Callable[[], Any], exclude: nn.Module | None = None) -> int:
    """Bytes of activation memory that `fn()` (a forward and its loss) leaves alive for the backward:
    the distinct storages (views deduplicated) that the forward's ops produced and that are
    still referenced once `fn` has returned (its result is held meanwhile, so its autograd graph lives).

    That is every tensor autograd saved (`saved_tensors_hooks` see these only outside checkpointed
    regions: inside one, checkpoint's own hooks take over) plus what checkpointing keeps instead (a
    block's inputs, the selective policy's cached op outputs). Parameters and buffers are not produced
    by the forward and are not counted; `exclude` (the model) also drops any storage shared with its
    parameters or buffers (a view made inside the forward). Run it without torch.compile (compiled
    kernels allocate outside the dispatcher). The meter holds every intermediate until `fn` returns,
    so the forward peaks higher than it would alone."""
    recorder = _StorageRecorder()
    with recorder:
        result = fn()  # noqa: F841 -- held until the count is done: it owns the autograd graph
    owned = set() if exclude is None else {_storage_id(t) for t in [*exclude.parameters(), *exclude.buffers()]}
    total = 0
    for key, storage in recorder.storages.items():
        # one reference is the recorder's own: more means an autograd node, a checkpoint or `result`
        if key not in owned and torch._C._storage_Use_Count(storage._cdata) > 1:
            total += storage.nbytes()
    return total
