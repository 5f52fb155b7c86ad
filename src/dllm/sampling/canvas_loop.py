"""THE canvas loop of masked, block and uniform-state diffusion: one request, advanced one model call at a time.

The canvas (canvas.py) is [prompt ; gen_length masks] per row. Blocks are decoded left to right (LLaDA's
semi-autoregressive schedule, Nie et al. 2025; block diffusion, Arriola et al. 2025), each in regions
(sub-blocks, Fast-dLLM v2; else the whole block). Each step of a region runs the model (runner.py, or
reuses the last forward when nothing was written since: the same input gives the same logits),
proposes a token per position (proposals.py) and lets the policy (policies.py) say what to write. The
loop owns the counters, the step callback and the early exits.

An editing policy (LLaDA2.1's, policies.py) may also rewrite decided tokens of the region and keep a row
stepping after its last mask; the loop gives it the region's tokens and what it may rewrite.

The loop never returns a mask: a region that is not done after its step budget keeps going, one step
at a time (counted in `overrun_steps`). The budget is steps / (gen_length / block_length) per canvas
block, split evenly over its sub-blocks; for block models a prompt that ends inside a block makes one
block more (partial at both ends).
Shapes: B batch, T canvas, V vocabulary, R region.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

import torch

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import Canvas, SpecialIds
from dllm.sampling.compiled import compile_blocks
from dllm.sampling.policies import Commit, StepState, make_policy
from dllm.sampling.proposals import commit_schedule, full_proposal
from dllm.sampling.results import Counters, GenerationResult, StepEvent
from dllm.sampling.runner import Runner

Need = tuple[int, int, bool]
"""A model call the canvas loop needs: the active block [lo, hi) and whether it refreshes a cache."""


class Loop:
    """One request: the canvas, its undecided positions, the counters, and the loop over them (`decode`)."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds,
                 generator, callback, stop) -> None:  # fmt: skip
        if cfg.shift == "auto":
            raise ValueError("sampler.shift is auto: resolve the sampler first (config.rules.resolve_sampler)")
        shift = cfg.shift == "on"
        if shift and min(len(p) for p in prompts) == 0:
            raise ValueError("a shifted model predicts position i from i-1: every prompt needs at least one token")
        self.cfg, self.special, self.generator, self.callback, self.stop = cfg, special, generator, callback, stop
        self.policy = make_policy(cfg, special)
        if cfg.compile:
            compile_blocks(model)
        device = next(model.parameters()).device
        self.canvas = Canvas.build(prompts, cfg, special, cfg.attention == "block", device, shift)
        self.counters = Counters()
        self.runner = Runner(model, self.canvas, cfg, special, shift, self.counters)
        self.x = self.canvas.x_BT.clone()
        self.undecided_BT = self.x == special.mask_id
        self.last_logits: torch.Tensor | None = None  # the block's last forward, reused while nothing is written
        self.written = True

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    def decode(self) -> Generator[Need, torch.Tensor, GenerationResult]:
        """The loop as a coroutine: it yields each model call it needs (the active block [lo, hi) and
        whether the call refreshes a cache) and is sent that call's logits [B, hi - lo, V]. The inference
        engine's executor answers with the loop's own runner (`runner.predict`: its windows and caches), or
        many loops' calls with one shared forward (inference/canvas_rows.py, inference/cached_rows.py)."""
        for b, (lo, hi) in enumerate(self.canvas.blocks):
            ended = yield from self.decode_block(b, lo, hi)
            if ended or (self.stop is not None and self.all_rows_ended()):
                # every row has ended: what is left lies after each row's end and is cut from the output
                self.x = torch.where(self.undecided_BT, self.special.eos_id, self.x)
                break
        assert not bool((self.x == self.special.mask_id).any()), "the loop decodes every masked position"
        sequences = []
        for row, s in zip(self.x.tolist(), self.canvas.gen_start_B, strict=True):
            out = row[s : s + self.cfg.gen_length]
            if self.cfg.stop_at_eos and self.special.eos_id in out:
                out = out[: out.index(self.special.eos_id)]
            sequences.append(out)
        return GenerationResult(sequences, self.x, self.counters, self.canvas.gen_start_B)

    def decode_block(self, b: int, lo: int, hi: int) -> Generator[Need, torch.Tensor, bool]:
        """Decode block b = [lo, hi) one region (sub-block) at a time; True once every row has ended."""
        cfg = self.cfg
        sub = cfg.sub_block_length or hi - lo
        steps_per_block = cfg.total_steps // cfg.num_blocks
        budget = self.policy.budget(max(steps_per_block // ((hi - lo) // sub), 1), sub)
        step_in_block = 0
        for rlo in range(lo, hi, sub):
            rhi = rlo + sub
            eligible = self.undecided_BT[:, rlo:rhi]
            schedule_BS = commit_schedule(eligible.sum(-1), budget)
            start = self.policy.start(StepState(eligible, schedule_BS, 0, budget, self.generator))
            if start is not None:
                self.x[:, rlo:rhi] = torch.where(eligible, start, self.x[:, rlo:rhi])
            self.last_logits, k = None, 0
            # editing policies: rows that asked for another step, and each row's steps with nothing undecided
            again_B = torch.zeros(self.x.shape[0], dtype=torch.bool, device=self.x.device)
            settled_B = torch.zeros_like(again_B, dtype=torch.long)
            while bool(((eligible := self.undecided_BT[:, rlo:rhi]).any(-1) | again_B).any()):
                every = cfg.refresh_every  # prefix / dual caches: a full forward every N steps as well
                refresh = step_in_block == 0 or (every is not None and step_in_block % every == 0)
                logits = (yield from self.predict(lo, hi, refresh))[:, rlo - lo : rhi - lo]
                prop = full_proposal(logits, cfg.temperature, self.generator, cfg.top_k, cfg.top_p)
                self.counters.overrun_steps += int(k >= budget)
                settled_B = torch.where(eligible.any(-1), 0, settled_B + 1)
                state = StepState(eligible, schedule_BS, k, budget, self.generator)
                commit = self.policy.step(prop, self.edit_view(state, rlo, rhi, again_B, settled_B))
                self.write(rlo, rhi, commit, b, step_in_block)
                again_B = torch.zeros_like(again_B) if commit.again_B is None else commit.again_B
                k, step_in_block = k + 1, step_in_block + 1
                if cfg.stop_at_eos and not self.policy.edits and self.all_rows_ended():
                    return True
        # an editing policy may still change a row's tokens inside the block: its rows end at the block's end
        return bool(cfg.stop_at_eos and self.policy.edits and self.all_rows_ended())

    def edit_view(
        self, state: StepState, rlo: int, rhi: int, again_B: torch.Tensor, settled_B: torch.Tensor
    ) -> StepState:
        """An editing policy's view of the step: also the region's tokens, what it may rewrite (decided generated
        positions of rows still stepping) and each row's steps with nothing undecided; others get `state`."""
        if not self.policy.edits:
            return state
        live_B = state.eligible_BR.any(-1) | again_B
        editable_BR = self.canvas.gen_BT[:, rlo:rhi] & ~state.eligible_BR & live_B[:, None]
        return replace(state, tokens_BR=self.x[:, rlo:rhi].clone(), editable_BR=editable_BR, settled_B=settled_B)

    def predict(self, lo: int, hi: int, refresh: bool) -> Generator[Need, torch.Tensor, torch.Tensor]:
        """Logits of the block: a model call, or the last one when nothing was written since (exact)."""
        if self.last_logits is None or self.written or not self.cfg.reuse_unchanged:
            self.last_logits = yield (lo, hi, refresh)
        else:
            self.counters.reused_forwards += 1
        return self.last_logits

    def write(self, rlo: int, rhi: int, commit: Commit, block: int, step: int) -> None:
        """Apply a policy's commit to the region [rlo, rhi), count it, and show it to the callback."""
        at = commit.positions_BR if commit.renoise_BR is None else commit.positions_BR | commit.renoise_BR
        edited = commit.edits_BR is not None and bool(commit.edits_BR.any())
        at = at | commit.edits_BR if edited else at  # type: ignore[operator]
        self.x[:, rlo:rhi] = torch.where(at, commit.tokens_BR, self.x[:, rlo:rhi])
        num = int(commit.positions_BR.sum())
        if commit.final:
            self.undecided_BT[:, rlo:rhi] &= ~commit.positions_BR
            self.counters.tokens_committed += num
        self.written = num > 0 or commit.renoise_BR is not None or edited
        self.counters.steps += 1
        if self.callback is not None:
            committed = torch.zeros_like(self.x, dtype=torch.bool)
            committed[:, rlo:rhi] = commit.positions_BR if not edited else commit.positions_BR | commit.edits_BR
            self.callback(StepEvent(self.x, committed, block, step, self.canvas.gen_start_B, self.special.mask_id))

    def all_rows_ended(self) -> bool:
        """Every row's output can no longer change: an EOS (or a stop) with nothing undecided before it."""
        if not self.cfg.stop_at_eos and self.stop is None:
            return False
        mask_id, eos_id = self.special.mask_id, self.special.eos_id
        rows = torch.where(self.undecided_BT, mask_id, self.x).tolist()  # uniform: noise is undecided too
        for row, s in zip(rows, self.canvas.gen_start_B, strict=True):
            gen = row[s : s + self.cfg.gen_length]
            decided = gen[: gen.index(mask_id)] if mask_id in gen else gen
            ended = self.cfg.stop_at_eos and eos_id in decided
            if not ended and self.stop is not None:
                ended = self.stop(decided)
            if not ended:
                return False
        return True
