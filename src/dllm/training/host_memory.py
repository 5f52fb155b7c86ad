"""Keep freed CPU memory inside the process, so that a training step reuses it instead of faulting it in.

glibc's malloc serves a large request (from 128 KiB, rising with what the process frees, to at most
32 MiB) with a fresh mmap and gives it back with munmap when the tensor is freed; the heap's free top
is also given back past a trim threshold. A CPU training step allocates and frees the same large
activations every step, so each step faults all of those pages in again: the kernel zeroes every 4 KiB
page on first touch. Measured here (demo model, 4096 tokens per step): BD3LM's 2L layout (12.6 MB
MLP activations) took 21-51 thousand page faults per step, ~3.6 us each, 90-180 ms of a 0.5-0.7 s
step; MDLM's half-size tensors stayed under glibc's adaptive threshold and took almost none.

`training.cpu_allocator: retain` asks glibc to serve every size from its heap (mmap_max = 0) and to
keep up to 2 GiB of free heap top (trim_threshold), as a caching allocator (jemalloc or tcmalloc with
decay off, PyTorch's CUDA allocator) would. glibc reads these settings from the GLIBC_TUNABLES
environment variable when a process starts, so they are set in the environment of the worker
processes `dllm launch` starts (there is no supported way to change them from Python afterwards); an
in-process run gets them when its own process was started with them (`make demo` does). Other C
libraries ignore the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RETAIN_TUNABLES = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(2**31 - 1)}
"""The glibc malloc tunables of `cpu_allocator: retain` (trim_threshold is an int: at most 2 GiB)."""


def _parse(value: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in value.split(":") if "=" in item)
    return {k: v for k, v in pairs}


def retaining_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the retain tunables merged into GLIBC_TUNABLES (the user's own tunables kept)."""
    tunables = _parse(env.get("GLIBC_TUNABLES", ""))
    tunables.update(RETAIN_TUNABLES)
    return {**env, "GLIBC_TUNABLES": ":".join(f"{k}={v}" for k, v in tunables.items())}


def memory_retained(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process (or one started with `env`) runs with the retain tunables."""
    tunables = _parse((os.environ if env is None else env).get("GLIBC_TUNABLES", ""))
    return all(tunables.get(k) == v for k, v in RETAIN_TUNABLES.items())
