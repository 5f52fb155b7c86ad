"""Continuous batching of diffusion decoding: canvases join a running batch at the next denoising step.

A server's requests arrive while others decode. Each request is the canvas loop of a `generate` call of
it alone (generate.py: `Loop`, with its own canvas, sampler settings, policy, step budget, generator and
stop function), run as a coroutine (`Loop.decode`) that yields each model call it needs. `CanvasBatch.step`
answers the calls of every running request in one forward: each request's canvas rows up to the end of
what its call reads, right-padded to the longest (padding is masked out of every key), under the
model's mask (bidirectional, or block-causal with padding as a document of its own). Rows much shorter
than the longest would mostly compute padding, so a step runs one forward per length bucket (canvases
longer than half of the bucket's longest) and per mask (`_forwards`). A request joins
before any step and its first call runs in the next forward; one whose loop has returned, or that is
cancelled (`leave`), is gone from the next.

What a request decodes is what its `generate` call alone decodes: its loop, policy and generator are the
same objects and see the same logits, up to the floating-point sums of a batch of another shape
(tests/unit/test_canvas_batch.py checks greedy and sampled requests against `generate`, in float64).

Which requests join (`CanvasBatch.takes`): canvas decoding (masked or uniform-state diffusion, any
policy; not DiffusionGemma's canvas_denoise, whose requests run as calls of their own) without
classifier-free guidance, uncached or with the exact block cache of a block model (not a hybrid
model with linear-attention layers, whose calls run on their own). The
block-cached ones keep their keys in one ragged cache per block size (canvas_kv.py: `CachedRows`): each
runs its first call (prompt and first block) alone, then its windows share one forward with the other
block-cached requests at each step. The approximate caches (prefix, dual: refreshed keys of a whole
bidirectional canvas) and guided requests run as calls of their own, taking turns step by step
(serving/engine.py). A block model's
requests share a forward per block size (the mask's).

Shapes: R batch rows, n a request's rows, L the forward's length, Q a request's block, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.config.sampler import SamplerConfig
from dllm.models.output import ModelOutput
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.canvas_kv import CachedRows
from dllm.sampling.causal import keeps_recurrent_state
from dllm.sampling.generate import Loop, Need
from dllm.sampling.results import GenerationResult, StepEvent


@dataclass(eq=False)
class CanvasGroup:
    """One request in a running canvas batch: its loop, the model call it waits for, and what it returned."""

    loop: Loop
    steps: Generator[Need, torch.Tensor, GenerationResult]
    need: Need | None = None
    """The call it waits for; None once its loop has returned."""
    returned: GenerationResult | None = None
    error: Exception | None = None
    """What its loop raised (it left the batch); None: none."""
    batch_rows: int = 0
    """Rows of the forwards it took part in, summed (their mean: `batch_rows / counters.nfe`)."""

    @property
    def done(self) -> bool:
        return self.need is None

    @property
    def counters(self):
        return self.loop.counters

    @property
    def rows(self) -> int:
        return self.loop.x.shape[0]

    def result(self) -> GenerationResult:
        """What its `generate` call returns (tensors outside inference mode)."""
        assert self.returned is not None, "the request has not ended"
        r = self.returned
        r.canvas_BL = r.canvas_BL.clone()
        return r

    def answer(self, logits_nQV: torch.Tensor | None) -> None:
        """Start the loop (None) or send it its call's logits; it runs to its next call or returns."""
        try:
            self.need = next(self.steps) if logits_nQV is None else self.steps.send(logits_nQV)
        except StopIteration as done:
            self.need, self.returned = None, done.value
        except Exception as e:  # this request's failure; the others go on
            self.need, self.error = None, e


class CanvasBatch:
    """The running canvases of a diffusion model: `join` a request, `step` them all, `leave` a request."""

    def __init__(self, model: nn.Module, special: SpecialIds, max_rows: int) -> None:
        self.model, self.special, self.max_rows = model, special, max_rows
        self.device = next(model.parameters()).device
        self.groups: list[CanvasGroup] = []
        self.cached: dict[int, CachedRows] = {}
        """Per block size, the rows of the requests decoding with the exact block cache."""
        self.mask_col = torch.tensor([special.mask_id], device=self.device)

    @staticmethod
    def takes(cfg: SamplerConfig, model: nn.Module) -> bool:
        """Whether a request of these (resolved) settings can join a running canvas batch of `model`."""
        if cfg.generation in ("causal", "edit_flow", "canvas_denoise") or cfg.cfg_scale > 0:
            return False  # canvas_denoise (DiffusionGemma): a sampler call of its own (canvas_denoiser.py)
        # linear-attention layers read the forward's last block as the noisy one (right padding would be)
        # and keep per-row states the ragged cache holds for causal rows only: their requests run as calls; so do
        # those reading their context causally (causal_context), which the batch's shared masks do not
        return cfg.cache in ("none", "block") and not keeps_recurrent_state(model) and cfg.causal_context != "on"

    @property
    def rows(self) -> int:
        """Rows held by running requests."""
        return sum(g.rows for g in self.groups)

    def fits(self, num_rows: int) -> bool:
        """Whether a request of `num_rows` rows may join now (an empty batch takes any)."""
        return not self.groups or self.rows + num_rows <= self.max_rows

    def reserve(self, num_rows: int, length: int) -> None:
        """Nothing to make room for: a forward's tensors are built for its rows (as RunningBatch's)."""

    @torch.inference_mode()
    def join(self, prompts: Sequence[Sequence[int]], cfg: SamplerConfig, generator: torch.Generator | None = None,
             stop: Callable[[list[int]], bool] | None = None,
             callback: Callable[[StepEvent], None] | None = None) -> CanvasGroup:  # fmt: skip
        """Start a request's loop: its first call runs in the next `step` (done already when it needs none)."""
        if not self.takes(cfg, self.model):
            raise ValueError("a running canvas batch takes uncached, unguided canvas decoding (CanvasBatch.takes)")
        loop = Loop(self.model, [list(p) for p in prompts], cfg, self.special, generator, callback, stop)
        group = CanvasGroup(loop, loop.decode())
        group.answer(None)
        if not group.done and loop.runner.cache is not None:  # the block cache: its first call runs alone
            block = loop.canvas.block_length
            if block not in self.cached:
                self.cached[block] = CachedRows(self.model, block, self.special.pad_id, self.device)
            self.cached[block].join(group)
        if not group.done:
            self.groups.append(group)
        return group

    @torch.inference_mode()
    def leave(self, group: CanvasGroup) -> None:
        """The request stops (its client went away); its rows are gone from the next forward."""
        if group in self.groups:
            self.groups.remove(group)
            self._leave_rows(group)
            group.steps.close()
            group.need = None

    def _leave_rows(self, group: CanvasGroup) -> None:
        for rows in self.cached.values():
            if group in rows.rows:
                rows.leave(group)

    @torch.inference_mode()
    def step(self) -> list[CanvasGroup]:
        """One forward answering every running request's call (one per block size of a block model's
        requests: the mask's); the requests that returned (or failed) with it, which leave the batch."""
        if not self.groups:
            return []
        finished: list[CanvasGroup] = []
        for block, groups in self._forwards():
            finished += self._answer(groups, self._forward(groups, block))
        for rows in self.cached.values():
            if rows.groups:
                groups = list(rows.groups)  # answering may remove a group from rows.groups
                finished += self._answer(groups, self._logits(*rows.forward()))
        return finished

    def _answer(self, groups: list[CanvasGroup], logits: list[torch.Tensor]) -> list[CanvasGroup]:
        """Send each group its logits; the groups that returned (or failed), which leave the batch."""
        finished = []
        for g, logits_nQV in zip(groups, logits, strict=True):
            g.answer(logits_nQV)
            if g.done:
                self.groups.remove(g)
                self._leave_rows(g)
                finished.append(g)
        return finished

    def _forwards(self) -> list[tuple[int | None, list[CanvasGroup]]]:
        """The step's forwards: the requests of one mask (a block model's block size; None: bidirectional),
        longest first, a forward running those whose canvas is longer than half of its longest (padding
        at most doubles a row's cost: a forward's cost grows with its rows' padded length)."""
        masks: dict[int | None, list[CanvasGroup]] = {}
        for g in self.groups:
            if g.loop.runner.mode.buffers:
                continue  # the block cache: its rows' forward is CachedRows'
            c = g.loop.canvas
            masks.setdefault(c.block_length if c.block_attention else None, []).append(g)
        forwards: list[tuple[int | None, list[CanvasGroup]]] = []
        for block, groups in masks.items():
            bucket: list[CanvasGroup] = []
            longest = 0
            for g in sorted(groups, key=self._key_end, reverse=True):
                if bucket and self._key_end(g) * 2 <= longest:
                    forwards.append((block, bucket))
                    bucket = []
                if not bucket:
                    longest = self._key_end(g)
                bucket.append(g)
            forwards.append((block, bucket))
        return forwards

    def _forward(self, groups: list[CanvasGroup], block: int | None) -> list[torch.Tensor]:
        """One model call for the calls of `groups` (block: the block-causal mask's block size; None:
        bidirectional); each request's logits of its active block, its counters counted."""
        ends = [self._key_end(g) for g in groups]
        tokens_RL, positions_RL, valid_RL = self._inputs(groups, ends)
        if block is not None:
            mask = AttentionMask("block_causal", doc_ids_BL=valid_RL.long(), block_size=block)
        else:
            mask = AttentionMask("bidirectional", key_valid_BL=valid_RL)
        out = self.model(tokens_RL, positions_RL, mask)
        R = tokens_RL.shape[0]
        for g, ke in zip(groups, ends, strict=True):
            c = g.counters
            c.nfe, c.query_tokens = c.nfe + 1, c.query_tokens + g.rows * ke
            g.batch_rows += R
        return self._block_logits(out, groups)

    @staticmethod
    def _key_end(g: CanvasGroup) -> int:
        """The canvas length its call reads (the uncached loop's window: the whole canvas, or a block model's
        canvas up to the end of the active block)."""
        assert g.need is not None
        lo, hi, _ = g.need
        canvas = g.loop.canvas
        return hi if canvas.block_attention else canvas.x_BT.shape[1]

    def _inputs(self, groups: list[CanvasGroup], ends: list[int]) -> tuple[torch.Tensor, ...]:
        """Every request's canvas rows [0, key end), right-padded to the longest: tokens, positions, real keys."""
        R, L = sum(g.rows for g in groups), max(ends)
        tokens = torch.full((R, L), self.special.pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros((R, L), dtype=torch.long, device=self.device)
        valid = torch.zeros((R, L), dtype=torch.bool, device=self.device)
        r = 0
        for g, ke in zip(groups, ends, strict=True):
            n, canvas = g.rows, g.loop.canvas
            tokens[r : r + n, :ke] = g.loop.x[:, :ke]
            positions[r : r + n, :ke] = canvas.positions_BT[:, :ke]
            valid[r : r + n, :ke] = canvas.valid_BT[:, :ke]
            r += n
        return tokens, positions, valid

    def _block_logits(self, out, groups: list[CanvasGroup]) -> list[torch.Tensor]:
        """Each request's logits of its active block [n, Q, V] (a shifted model's from the rows before)."""
        hidden, r = [], 0
        for g in groups:
            lo, hi, _ = g.need  # type: ignore[misc]
            s = g.loop.runner.shift
            hidden.append(out.hidden_BLE[r : r + g.rows, lo - s : hi - s])
            r += g.rows
        return self._logits(out, hidden)

    def _logits(self, out: ModelOutput, hidden: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each request's logits (`ModelOutput.token_logits` on its rows only; the mask token never a prediction)."""
        return [out.token_logits(h, self.mask_col) for h in hidden]
