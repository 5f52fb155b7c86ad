"""flash-linear-attention's chunked gated delta rule: an optional GPU path of the linear-attention layers.

`model.linear_attention_kernel: fla` makes each Gated DeltaNet layer run its causal chunks through
`fla.ops.gated_delta_rule.chunk_gated_delta_rule` (the `fla` package, Triton kernels) where that kernel
takes the inputs, and through the pure-torch `gated_delta.chunked` (the default and the reference)
everywhere else. The package is imported when a model asks for it, never by `import dllm`; a model that
asks for it where it is not installed warns once and runs the torch form.

The kernel runs a call when all of these hold, else `gated_delta.chunked` does:
- the inputs are on CUDA, in bfloat16 or float16 (released fla versions refuse float32 inputs; float32
  and float64 models keep the reference's precision);
- no document starts (`start_BL`: the kernel's variable-length form needs flattened rows and offsets,
  which the packed-document path does not build).

Block diffusion's noisy blocks and the per-chunk states of its clean half (`chunked_states`,
`block_reads`), and the state re-run of a speculative commit (models/linear_state.py), stay in torch.

The adapter: our queries and keys arrive L2-normalised and queries already scaled by K^-1/2 (gated_delta's
convention), so the kernel is called with `scale=1.0` and without its in-kernel L2 norm; key heads are
already repeated to the value heads (so the kernel's grouped-value form is not needed); tensors go from
[B, H, L, *] to the kernel's [B, L, H, *] and back; q, k, v in the values' (model) dtype, the log decays g
in float32 (as transformers' Qwen3.5 passes them), the write strengths beta in the model dtype (likewise),
the initial state in float32 [B, H, K, V]; the final state comes back as the reference's, in float32.

What the signature rests on: the public function of fla-org/flash-linear-attention,
fla/ops/gated_delta_rule/chunk.py, read in its source (two versions: one with `head_first`, a later one
with grouped values and CUDA-graph options): `chunk_gated_delta_rule(q, k, v, g, beta, scale=None,
initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, ...)`, q, k
[B, T, H, K], v [B, T, H, V], g and beta [B, T, H], initial and final state [N, H, K, V], returning
(o [B, T, H, V], final_state). Only those keyword arguments are passed. This adapter was written without
a GPU or the package: it has never run here. tests/gpu/test_fla.py and the `delta_rule` section of
bench/gpu_check.py compare it with the torch form on a GPU with fla installed (skipped elsewhere).

Shapes: B batch, H heads, L sequence, K key width, V value width.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from dllm.models import gated_delta

HALF = (torch.bfloat16, torch.float16)


def load_kernel() -> Callable[..., Any] | None:
    """fla's `chunk_gated_delta_rule`, or None where the package is not installed (or does not import)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # type: ignore[import-not-found]
    except Exception:  # not installed, or its Triton stack fails to import on this machine
        return None
    return chunk_gated_delta_rule


class FlaRule:
    """The `fla` entry of DELTA_RULES: `gated_delta.chunked`'s signature, the kernel where it takes the call."""

    def __init__(self, kernel: Callable[..., Any] | None = None, device_types: tuple[str, ...] = ("cuda",)) -> None:
        """`kernel`: fla's function (None: imported now); `device_types`: where it runs (a test hands a CPU
        stand-in of the kernel's contract to check this adapter without a GPU)."""
        self.kernel = kernel if kernel is not None else load_kernel()
        self.device_types = device_types
        if self.kernel is None:
            warnings.warn(
                "model.linear_attention_kernel: fla, but the flash-linear-attention package (fla) is not installed "
                "or does not import; the linear layers run the torch form",
                stacklevel=2,
            )

    def takes(self, v_BHLV: torch.Tensor, start_BL: torch.Tensor | None) -> bool:
        """Whether the kernel runs a call with these values and document starts (the module docstring)."""
        on_device = v_BHLV.device.type in self.device_types
        return self.kernel is not None and on_device and v_BHLV.dtype in HALF and start_BL is None

    def __call__(
        self,
        q_BHLK: torch.Tensor,
        k_BHLK: torch.Tensor,
        v_BHLV: torch.Tensor,
        g_BHL: torch.Tensor,
        beta_BHL: torch.Tensor,
        state_BHKV: torch.Tensor | None = None,
        chunk: int = 64,
        start_BL: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs [B, H, L, V] (q's dtype) and the final state [B, H, K, V] (float32 at least), as `chunked`;
        `chunk` is the torch form's (the kernel chunks by its own)."""
        if not self.takes(v_BHLV, start_BL):
            return gated_delta.chunked(q_BHLK, k_BHLK, v_BHLV, g_BHL, beta_BHL, state_BHKV, chunk, start_BL)
        assert self.kernel is not None
        half = v_BHLV.dtype
        q, k, v = (t.transpose(1, 2).to(half).contiguous() for t in (q_BHLK, k_BHLK, v_BHLV))
        g = g_BHL.transpose(1, 2).float().contiguous()
        beta = beta_BHL.transpose(1, 2).to(half).contiguous()
        state = None if state_BHKV is None else state_BHKV.float().contiguous()
        o_BLHV, S_BHKV = self.kernel(
            q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False
        )
        return o_BLHV.transpose(1, 2).to(q_BHLK.dtype), S_BHKV.to(torch.promote_types(q_BHLK.dtype, torch.float32))
