"""Keep freed CPU memory inside the process, so that a training step reuses it instead of faulting it in.

glibc's malloc serves a large request (from 128 KiB, rising with what the process frees, to at most
32 MiB) with a fresh mmap and gives it back with munmap when the tensor is freed; the heap's free top
is also given back past a trim threshold. A CPU training step allocates and frees the same large
activations every step, so each step faults all of those pages in again: the kernel zeroes every 4 KiB
page on first touch. Measured here (demo model, 4096 tokens per step): BD3LM's 2L layout (12.6 MB
MLP activations) took 21-51 thousand page faults per step, ~3.6 us each, 90-180 ms of a 0.5-0.7 s
step; MDLM's half-size tensors stayed under glibc's adaptive threshold and took almost none.

`retain_freed_memory` tells glibc to serve every size from its heap (M_MMAP_MAX = 0) and to keep up to
2 GiB of free heap top (M_TRIM_THRESHOLD), as a caching allocator (jemalloc or tcmalloc with decay
off, PyTorch's CUDA allocator) would. The process then keeps its peak heap for its lifetime, which a
training process reaches in its first step anyway. It applies to the whole process and only where
the C library is glibc; elsewhere it is a no-op that returns False.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: keep up to 2 GiB of free heap top

_applied = False


def retain_freed_memory() -> bool:
    """Make glibc malloc keep freed memory for reuse (process-wide, idempotent); True when applied."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already uses
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # not glibc (e.g. musl)
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return _applied
