"""BD3LM's block-diffusion attention on CPU as one fused kernel (bd_fused.c): each query tile runs a
flash-attention forward and backward over exactly the key ranges the pattern allows, reading q, k,
v and the gradient in place. No mask tensor, no gathered rows, no merge of partial softmaxes.

Where it applies: float32 on CPU, the block-diffusion pattern with documents (each one run of
positions, as packing makes them) and a window or neither, no key padding (that takes bd_split.py),
block size dividing L, and at least as many (batch, query head) pairs as threads (the backward runs
one task per pair). A row's keys are then one range of x_0 and one of x_t, and a tile of T query
rows scores the keys from the first to the last any of its rows sees: about L*L + L*(T + bs) pairs
per full layer without documents (1.16*L*L for bd_split, 4*L*L for the dense mask), fewer with.

The C source is compiled on first use with the system C compiler (`cc`, about a second) into
`$DLLM_CACHE_DIR/kernels` (default `~/.cache/dllm/kernels`), keyed by the source, the flags and the
machine; it links nothing but OpenMP and finds torch's BLAS `sgemm_` at run time. Without a
compiler, or when the build fails, `available()` is False, the reason is logged once, and callers
take bd_split.py. `DLLM_FUSED_ATTENTION=0` turns it off.

Shapes: B batch, H query heads, K key/value heads, L sequence length (2L layout), D head width.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dllm.attention.backends.bd_split import _dense_rows, _rows_major
from dllm.attention.masks import AttentionMask

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("bd_fused.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-std=c11"]
QUERY_TILE = 64  # query rows per task; measured on the demo model (bench/objectives.py)
KEY_TILE = 512  # keys per matrix product


class _View(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("sb", ctypes.c_int64), ("sh", ctypes.c_int64), ("sr", ctypes.c_int64)]


class _Args(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("B", "H", "K", "Q", "L", "D", "bs", "tile", "key_tile")),
        ("scale", ctypes.c_float),
        *((name, _View) for name in ("q", "k", "v", "out", "lse", "grad", "dq", "dk", "dv")),
        ("doc_lo", ctypes.c_void_p),
        ("doc_hi", ctypes.c_void_p),
        ("doc_sb", ctypes.c_int64),
        ("window", ctypes.c_int64),
    ]


def supports(q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether the fused kernel computes this call (see the module docstring); False if it is not built."""
    if mask.kind != "block_diffusion" or mask.block_size is None:
        return False
    if mask.key_valid_BL is not None:
        return False
    if q_BHQD.device.type != "cpu" or q_BHQD.dtype != torch.float32 or k_BKSD.dtype != torch.float32:
        return False
    S, Q = k_BKSD.shape[2], q_BHQD.shape[2]
    if S % 2 or Q not in (S, S // 2) or (S // 2) % mask.block_size or q_BHQD.shape[1] % k_BKSD.shape[1]:
        return False
    if q_BHQD.shape[0] * q_BHQD.shape[1] < torch.get_num_threads():
        return False
    docs = mask.doc_ids_BL
    if docs is not None and (docs.shape[1] != S // 2 or docs.shape[0] not in (1, q_BHQD.shape[0])):
        return False  # not this layout's per-position tensor: the reference path reports it
    return available() and (mask.doc_ids_BL is None or document_ranges(mask) is not None)


def document_ranges(mask: AttentionMask) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each position's document as [lo, hi) (int32 [B or 1, L] each), or None when some document is
    more than one run of positions (the ranges would not be exact). Built once per description."""
    return mask.memo("bd_fused_docs", lambda: _document_ranges(mask.doc_ids_BL))


def _document_ranges(ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    assert ids is not None
    mb, L = ids.shape
    pos = torch.arange(L, device=ids.device).expand(mb, L)
    starts = torch.ones(mb, L, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    distinct = torch.ones_like(starts)
    ordered = ids.sort(dim=1).values
    distinct[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    if not torch.equal(starts.sum(1), distinct.sum(1)):  # an id in two runs: not one range
        return None
    lo = torch.where(starts, pos, 0).cummax(1).values
    hi = torch.where(ends, pos + 1, L).flip(1).cummin(1).values.flip(1)
    return lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()


def fused_attention(
    q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask
) -> torch.Tensor:
    """q [B, H, 2L or L, D], k/v [B, K, 2L, D] -> [B, H, 2L or L, D]; equal to the dense-mask SDPA."""
    assert mask.block_size is not None
    docs = None if mask.doc_ids_BL is None else document_ranges(mask)
    assert mask.doc_ids_BL is None or docs is not None, "documents that are not runs: see supports()"
    return _FusedAttention.apply(q_BHQD, k_BKSD, v_BKSD, _Pattern(mask.block_size, mask.window or 0, docs))


class _Pattern:
    """What the kernel needs of the mask: block size, window (0: none) and document ranges."""

    def __init__(self, block_size: int, window: int, docs: tuple[torch.Tensor, torch.Tensor] | None):
        self.block_size, self.window, self.docs = block_size, window, docs


@functools.cache
def available() -> bool:
    """Whether the kernel is built and loaded (once per process; the first call may compile it)."""
    if os.environ.get("DLLM_FUSED_ATTENTION", "1") == "0":
        return False
    try:
        _library()
    except (OSError, subprocess.CalledProcessError, AttributeError) as err:
        log.warning("fused block-diffusion attention unavailable (%s); using the split path", _first_line(err))
        return False
    return True


def _first_line(err: BaseException) -> str:
    text = getattr(err, "stderr", None) or str(err)
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    return (text.strip().splitlines() or [type(err).__name__])[0]


@functools.cache
def _library() -> tuple[ctypes.CDLL, int]:
    """The built kernel and the address of torch's BLAS sgemm_."""
    sgemm = ctypes.cast(ctypes.CDLL(_torch_cpu_library()).sgemm_, ctypes.c_void_p).value
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler (cc) on PATH")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _machine().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("DLLM_CACHE_DIR", Path.home() / ".cache" / "dllm")) / "kernels"
    built = cache / f"bd_fused-{key}.so"
    if not built.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:  # build aside, then rename: never half-written
            out = Path(tmp) / built.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], check=True, capture_output=True)
            os.replace(out, built)
    lib = ctypes.CDLL(str(built))
    for fn in (lib.bd_forward, lib.bd_backward):
        fn.argtypes, fn.restype = [ctypes.POINTER(_Args), ctypes.c_void_p, ctypes.c_int], None
    assert sgemm is not None
    return lib, sgemm


def _torch_cpu_library() -> str:
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libtorch_cpu.*"))
    if not found:
        raise OSError(f"libtorch_cpu not found under {lib}")
    return str(found[0])


def _machine() -> str:
    """The build's machine key: -march=native code must not run on another CPU (a shared home directory)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return f"{platform.machine()}|{platform.system()}|{flags}"


def _view(x: torch.Tensor | None) -> _View:
    if x is None:
        return _View(None, 0, 0, 0)
    assert x.dtype == torch.float32 and x.stride(-1) == 1 and x.dim() in (3, 4)  # lse [B, H, Q]: rows of one
    return _View(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2))


def _args(q, k, v, pattern: _Pattern, **tensors) -> _Args:
    B, H, Q, D = q.shape
    views = {name: _view(tensors.get(name)) for name in ("out", "lse", "grad", "dq", "dk", "dv")}
    lo, hi = pattern.docs if pattern.docs is not None else (None, None)
    return _Args(
        B, H, k.shape[1], Q, k.shape[2] // 2, D, pattern.block_size, QUERY_TILE, KEY_TILE, 1.0 / math.sqrt(D),
        _view(q), _view(k), _view(v), *views.values(),
        None if lo is None else lo.data_ptr(), None if hi is None else hi.data_ptr(),
        0 if lo is None or lo.shape[0] == 1 else lo.stride(0), pattern.window,
    )  # fmt: skip


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHQD, k_BKSD, v_BKSD, pattern: _Pattern):  # type: ignore[override]
        q, k, v = _dense_rows(q_BHQD), _dense_rows(k_BKSD), _dense_rows(v_BKSD)
        B, H, Q, D = q.shape
        out, lse = _rows_major(B, H, Q, D, q.dtype, q.device), torch.empty(B, H, Q)
        lib, sgemm = _library()
        args = _args(q, k, v, pattern, out=out, lse=lse)
        lib.bd_forward(ctypes.byref(args), sgemm, torch.get_num_threads())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pattern = pattern
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BHQD):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        B, H, Q, D = q.shape
        K, S = k.shape[1], k.shape[2]
        dq = _rows_major(B, H, Q, D, q.dtype, q.device)
        dk_h, dv_h = torch.zeros(B, S, H, D).transpose(1, 2), torch.zeros(B, S, H, D).transpose(1, 2)
        lib, sgemm = _library()
        grad = _dense_rows(grad_BHQD)  # held here: the kernel gets raw addresses, nothing keeps a temporary alive
        args = _args(q, k, v, ctx.pattern, out=out, lse=lse, grad=grad, dq=dq, dk=dk_h, dv=dv_h)
        lib.bd_backward(ctypes.byref(args), sgemm, torch.get_num_threads())
        if H != K:  # the query heads sharing a key/value head (heads h // (H / K))
            dk_h, dv_h = (x.unflatten(1, (K, H // K)).sum(2) for x in (dk_h, dv_h))
        return dq, dk_h, dv_h, None
