"""The executor: runs the forwards the scheduler decides, and nothing else decides them.

- `start`: an admitted request runs to its first call; a causal one is prefilled alone and takes rows of
  the shared ragged cache (causal_rows.py), a block-cached canvas one runs its first block alone and takes
  rows of its block size's shared cache (cached_rows.py).
- `run`: one planned forward. Causal: every causal request's rows in one target forward. Canvas: several
  uncached canvas requests in one padded forward (canvas_rows.py); a lone one through its own runner
  (sampling/runner.py: its exact windows and masks). Block-cached: every request of the block size in one
  forward. Own: the request's own runner (approximate caches, guidance) or, for a loop that runs its own
  forward (Edit Flows, DiffusionGemma), its step.
- `leave`: a request that ended or was dropped frees its rows.

All logits come from one function (models/output.py: `token_logits`), the mask id excluded.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm.inference.cached_rows import CachedRows
from dllm.inference.canvas_rows import canvas_forward
from dllm.inference.causal_rows import CausalRows
from dllm.inference.request import Request
from dllm.inference.scheduler import Forward
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.results import OwnStep


class Executor:
    """The model's forwards for the engine's requests."""

    def __init__(self, model: nn.Module, special: SpecialIds, recompute: bool = False) -> None:
        self.model, self.special = model, special
        self.device = next(model.parameters()).device
        self.causal = CausalRows(model, special.mask_id, recompute)
        self.cached: dict[int, CachedRows] = {}
        """Per block size, the rows of the block-cached canvas requests."""
        self.exclude = torch.tensor([special.mask_id], device=self.device)  # the mask token is never a prediction

    def start(self, req: Request) -> None:
        """Run an admitted request to its first call (its prefill or first block alone, where it takes shared rows)."""
        req.answer(None)
        if req.done:
            return
        if req.kind == "causal":
            self.causal.join(req)
        elif req.kind == "canvas_cached":
            block = req.loop.canvas.block_length
            if block not in self.cached:
                self.cached[block] = CachedRows(self.model, block, self.special.pad_id, self.device)
            self.cached[block].join(req)

    def run(self, forward: Forward, reqs: list[Request]) -> None:
        """One planned forward; each of `reqs` is sent its answer and runs to its next call (or ends)."""
        if forward.kind == "causal":
            self.causal.step(reqs)
        elif forward.kind == "canvas_cached":
            assert forward.mask is not None
            self.cached[forward.mask].step(self.exclude)
        elif forward.kind == "canvas" and len(reqs) > 1:
            canvas_forward(self.model, reqs, forward.mask, self.special.pad_id, self.exclude)
        else:
            for req in reqs:
                req.answer(_alone(req))

    def close(self) -> None:
        """Remove what the executor registered on the model (the target's feature hooks)."""
        if self.causal.target is not None:
            self.causal.capture(())

    def leave(self, req: Request) -> None:
        """Free a request's rows (it ended or was dropped)."""
        self.causal.leave(req)
        for rows in self.cached.values():
            rows.leave(req)


def _alone(req: Request) -> torch.Tensor | None:
    """A request's call answered by itself: a loop that runs its own forward (None), or a canvas call through the
    loop's own runner."""
    req.batch_rows += req.rows
    if isinstance(req.need, OwnStep):
        return None
    return req.loop.runner.predict(req.loop.x, *req.need)
