"""`auto` backend: per call, the fastest backend that can compute it.

Which one runs is a pure function of the mask description, the device type and `model.flex_compile`
(`choose_backend`), never of thread counts, installed compilers or the environment, so that
`resolve_backend` can name, once per run, the concrete backend `auto` stands for on its device: a run
recorded with that name computes exactly what `auto` did.

- plain bidirectional/causal: SDPA without a mask tensor (fused no-mask / is_causal kernels); every
  concrete backend takes this path for plain masks too;
- structured mask on CUDA: FlexAttention (BlockMask sparsity, forward and backward);
- structured mask on CPU: `blockwise`. For block_causal / block_diffusion it computes exact SDPA calls
  over block-aligned query chunks: FlexAttention has no CPU backward, and the dense mask scores all
  4*L*L pairs of BD3LM's 2L layout while blockwise scores ~L*L*(S+3)/S: 1.9-2.2x faster forward +
  backward and 2.6-2.9x faster forward than dense, and faster forward than compiled FlexAttention too
  (bench/attention.py, 2L = 1024 and 2048), with no compile. Other structured masks (documents,
  padding, windows on bidirectional / causal) it hands to SDPA with a dense mask. Compiled
  FlexAttention is faster on big masks but costs ~30 s per new shape, more than a CPU sampling call;
  choose `flex` explicitly for long CPU jobs;
- ragged cached decoding (per-row query offsets: a few query rows against a key length that grows every
  step): SDPA with a dense mask; a compiled FlexAttention kernel would compile for every new key length;
- FlexAttention configured eager (model.flex_compile: false) or any other device: SDPA. Eager
  FlexAttention materialises every score and ran ~6x slower than dense SDPA on the block-diffusion mask.

Shapes: B batch, H query heads, K key/value heads, L query length, S key length, D head width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask
from dllm.config.registries import ATTENTION_BACKENDS


def resolve_backend(name: str, device_type: str, flex_compile: bool) -> str:
    """The concrete backend `name` stands for on a device: `auto` -> the one it uses for structured masks
    there (cpu: blockwise; cuda: flex if compiled, else sdpa; other devices: sdpa); other names as given."""
    if name != "auto":
        return name
    if device_type == "cpu":
        # no CPU flex backward; blockwise skips most of BD3LM's masked pairs, exactly, and compiles nothing
        return "blockwise"
    if device_type == "cuda" and flex_compile:
        return "flex"
    return "sdpa"


def choose_backend(mask: AttentionMask, device_type: str, flex_compile: bool) -> str:
    """Which backend `auto` runs for a mask on a device: SDPA's mask-free kernels for plain masks, else
    the resolved backend (which takes the same mask-free path for plain masks, so both agree)."""
    return "sdpa" if _sdpa_path(mask) else resolve_backend("auto", device_type, flex_compile)


def _sdpa_path(mask: AttentionMask) -> bool:
    """Plain masks (mask-free kernels) and ragged decoding steps (new shapes every step) run on SDPA."""
    return mask.is_plain or mask.query_offset_B is not None


class AutoBackend:
    """The `auto` backend: q [B, H, L, D], k/v [B, K, S, D] -> [B, H, L, D].

    Plain masks take SDPA's mask-free kernels; structured masks the backend `resolve_backend` names for
    the tensors' device, built once per device type (so one model moved between devices stays right)."""

    def __init__(self, flex_compile: bool = True) -> None:
        self.flex_compile = flex_compile
        self._structured: dict[str, Callable[..., torch.Tensor]] = {}
        # cpu and cuda up front: built lazily inside a compiled region, the build (an import and a dict
        # write) breaks the graph, and inside an activation-checkpointed block it sends dynamo back to
        # eager for the whole block (parallel/checkpointing.py)
        for device_type in ("cpu", "cuda"):
            self.for_device(device_type)

    def for_device(self, device_type: str) -> Callable[..., torch.Tensor]:
        """The backend this one runs structured masks with on `device_type` (other device types than
        cpu and cuda: built on first use)."""
        if device_type not in self._structured:
            name = resolve_backend("auto", device_type, self.flex_compile)
            self._structured[device_type] = ATTENTION_BACKENDS.resolve(name)(self.flex_compile)
        return self._structured[device_type]

    def __call__(self, q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask):
        backend = sdpa_attention if _sdpa_path(mask) else self.for_device(q_BHLD.device.type)
        return backend(q_BHLD, k_BKSD, v_BKSD, mask)


def auto_backend(flex_compile: bool) -> AutoBackend:
    """The registered factory of `auto`."""
    return AutoBackend(flex_compile=flex_compile)
