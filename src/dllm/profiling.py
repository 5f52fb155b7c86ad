"""Measuring tools shared by benchmarks and tests (nothing here runs on a training hot path)."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and alive at the same time.

    `peak_bytes` is the largest sum over live storages seen after any op; `largest_numel` is the
    largest tensor any op returned (views of
    `exclude` tensors aside). Storages of `exclude` tensors (inputs made before) are not counted.
    """

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.skip = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak_bytes = 0
        self.largest_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            ref = StorageWeakRef(t.untyped_storage()) if isinstance(t, torch.Tensor) else None
            if ref is not None and ref.cdata not in self.skip:
                self.largest_numel = max(self.largest_numel, t.numel())
                self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self.live.values()))
        return out
