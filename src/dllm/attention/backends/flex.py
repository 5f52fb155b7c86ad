"""FlexAttention backend: a BlockMask from the shared mask functions, so fully masked tiles are skipped.

The block-diffusion 2L mask (BD3LM, Arriola et al. 2025) allows L*L + L*B of 4*L*L pairs; a dense
SDPA mask pays for all of them, FlexAttention only for the tiles that hold an allowed pair.

- BlockMask cache: built once per (mask description, batch, lengths, device) and kept on the
  `AttentionMask` itself (`AttentionMask.cache`), so all layers of one forward (one training step,
  one sampling step) share it and it is freed with the description. An LRU keyed by tensor ids
  was rejected: ids are reused after garbage collection, and it would be hidden global state.
- Compile: `torch.compile(flex_attention, dynamic=False)` is built lazily on the first call (never
  at import). `FlexBackend(compiled=False)` (model.flex_compile: false) runs the eager kernel (tests:
  a cold compile costs ~30 s per shape on CPU). If compiling fails, the backend object warns, keeps
  the error (`compile_error`) and stays eager; another object tries again (nothing process-wide).
  Inside a compiled model (`training.compile`) the surrounding compile handles the kernel and the
  BlockMask is built in the graph (the cache is an eager-mode saving).
- Plain bidirectional / causal masks: SDPA's mask-free kernels (nothing to skip), as `auto` does, so a
  run resolved from `auto` to `flex` computes the same.
- CPU backward: FlexAttention has none (torch 2.13). A call that needs gradients on CPU is computed
  by the SDPA reference with a `FlexCPUBackwardWarning`; choose `auto` to get that routing silently.

Shapes: B batch, H query heads, K key/value heads, L query length, S key length, D head width.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask, depends_on_batch, mask_mod


class FlexCPUBackwardWarning(UserWarning):
    """FlexAttention was asked for gradients on CPU, where it has no backward; SDPA computed the call."""


class FlexBackend:
    """The `flex` backend: q [B, H, L, D], k/v [B, K, S, D] -> [B, H, L, D] with FlexAttention under `mask`."""

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled  # through torch.compile (model.flex_compile); False: eager
        self.compile_error: str | None = None  # the first compile failure: from then on eager, not retried

    def __call__(self, q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask):
        if mask.is_plain:  # no tile to skip: SDPA's mask-free kernels, as `auto` takes (see backends/auto.py)
            return sdpa_attention(q_BHLD, k_BKSD, v_BKSD, mask)
        grad = needs_grad(q_BHLD, k_BKSD, v_BKSD)
        if grad and q_BHLD.device.type == "cpu":
            warnings.warn(
                "FlexAttention has no backward on CPU: this call is computed with SDPA and a dense mask. "
                "Use model.attention_backend 'auto' (routes by device and grad) or 'sdpa' for CPU training.",
                FlexCPUBackwardWarning,
                stacklevel=2,
            )
            return sdpa_attention(q_BHLD, k_BKSD, v_BKSD, mask)
        if not grad:
            # CPU FlexAttention rejects inputs that require grad even under no_grad
            q_BHLD, k_BKSD, v_BKSD = q_BHLD.detach(), k_BKSD.detach(), v_BKSD.detach()
        block_mask = flex_block_mask(mask, q_BHLD.shape[0], q_BHLD.shape[2], k_BKSD.shape[2], q_BHLD.device)
        return self.run(q_BHLD, k_BKSD, v_BKSD, block_mask)

    def run(self, q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, block_mask: BlockMask):
        gqa = k_BKSD.shape[1] != q_BHLD.shape[1]
        if torch.compiler.is_compiling():
            # inside a compiled model the surrounding compile fuses the kernel; contiguous because the CPU
            # lowering of flex_attention fails on view inputs such as a projection's transpose (torch 2.13)
            q_BHLD, k_BKSD, v_BKSD = q_BHLD.contiguous(), k_BKSD.contiguous(), v_BKSD.contiguous()
            return flex_attention(q_BHLD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=gqa)
        if self.compiled and self.compile_error is None:
            try:
                return compiled_flex()(q_BHLD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=gqa)
            except torch._dynamo.exc.TorchDynamoException as err:  # no C++ compiler, unsupported dtype, ...
                self.compile_error = f"{type(err).__name__}: {err}"
                warnings.warn(
                    f"compiling FlexAttention failed, this backend runs it eagerly from now on "
                    f"(model.flex_compile: false skips compiling): {err}",
                    stacklevel=2,
                )
        with warnings.catch_warnings():
            # eager is a deliberate choice here (configured, or compile failed): its "use torch.compile" hint is noise
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q_BHLD, k_BKSD, v_BKSD, block_mask=block_mask, enable_gqa=gqa)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record this call (grad mode on and some input requires grad)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def flex_block_mask(mask: AttentionMask, batch: int, q_len: int, kv_len: int, device: torch.device) -> BlockMask:
    """The BlockMask of a description, built once per shape and device (broadcast over batch if it can)."""
    mask_batch = batch if depends_on_batch(mask) else None
    key = ("flex", mask_batch, q_len, kv_len, device)

    def build() -> BlockMask:
        return create_block_mask(mask_mod(mask, kv_len), mask_batch, None, q_len, kv_len, device=device)

    return mask.cache.memo(key, build)


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """The compiled kernel, created on first use; static shapes (a new shape compiles once more). One
    wrapper per process so that every backend object (one per layer) reuses the same compiled graphs;
    it holds no switch: whether to compile is each backend's `compiled`."""
    return torch.compile(flex_attention, dynamic=False)


def flex_backend(flex_compile: bool) -> FlexBackend:
    """The registered factory of `flex`: compiled unless `model.flex_compile` is false."""
    return FlexBackend(compiled=flex_compile)
