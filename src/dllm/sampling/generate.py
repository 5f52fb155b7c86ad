"""THE sampling loop: one loop for every policy and cache of masked, block and uniform-state diffusion.

The canvas (canvas.py) is [prompt ; gen_length masks] per row. Blocks are decoded left to right (LLaDA's
semi-autoregressive schedule, Nie et al. 2025; block diffusion, Arriola et al. 2025), each in regions
(sub-blocks, Fast-dLLM v2; else the whole block). Each step of a region runs the model (runner.py, or
reuses the last forward when nothing was written since: the same input gives the same logits),
proposes a token per position (proposals.py) and lets the policy (policies.py) say what to write. This
module owns the loop, the counters, the step callback and the early exits.

The loop never returns a mask: a region that is not done after its step budget keeps going, one step
at a time (counted in `overrun_steps`). The budget is steps / (gen_length / block_length) per canvas
block, split evenly over its sub-blocks; for block models a prompt that ends inside a block makes one
block more (partial at both ends).
Shapes: B batch, T canvas, V vocabulary, R region.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import Canvas, SpecialIds, left_pad
from dllm.sampling.compiled import compile_blocks
from dllm.sampling.edit_flow import TauLeaping, pad_rows, tau_leaping_step
from dllm.sampling.policies import Commit, StepState, make_policy
from dllm.sampling.proposals import commit_schedule, filter_logits, full_proposal, propose
from dllm.sampling.runner import Runner

__all__ = [
    "Counters", "GenerationResult", "SpecialIds", "StepEvent", "commit_schedule", "filter_logits",
    "full_proposal", "generate", "left_pad", "propose",
]  # fmt: skip


@dataclass
class Counters:
    """What a call cost. Query and cached tokens count rows x positions (padding included)."""

    nfe: int = 0
    """Model forward calls (a classifier-free-guidance pair runs as one batched call)."""
    query_tokens: int = 0
    """Positions run through the model as queries."""
    cached_tokens: int = 0
    """Key positions read from the KV cache instead of being recomputed (cache hits)."""
    tokens_committed: int = 0
    """Masked positions decoded, over all rows."""
    steps: int = 0
    """Decoding steps (a reused forward counts a step but no NFE)."""
    reused_forwards: int = 0
    """Steps answered from the previous forward because no token changed (ancestral)."""
    overrun_steps: int = 0
    """Steps past a block's budget, taken instead of leaving a mask."""
    edits: int = 0
    """Edit Flows: insertions, deletions and substitutions drawn, over all rows."""

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(self.__dict__)
        d["tokens_per_forward"] = self.tokens_committed / max(self.nfe, 1)
        return d


@dataclass
class GenerationResult:
    sequences: list[list[int]]
    """Generated ids per prompt (cut at the first EOS when stop_at_eos)."""
    canvas_BL: torch.Tensor
    """The whole final canvas, prompts and padding included."""
    counters: Counters
    gen_start_B: list[int] = field(default_factory=list)
    """Canvas index of each row's first generated token."""

    @property
    def nfe(self) -> int:
        return self.counters.nfe

    @property
    def tokens_committed(self) -> int:
        return self.counters.tokens_committed

    @property
    def tokens_per_forward(self) -> float:
        return self.counters.tokens_committed / max(self.counters.nfe, 1)


@dataclass(frozen=True)
class StepEvent:
    """Passed to the per-step callback (streaming, live views): the canvas after the step."""

    canvas_BT: torch.Tensor
    """The loop's own canvas (updated in place by later steps: clone it to keep it)."""
    committed_BT: torch.Tensor
    """Positions decoded at this step."""
    block: int
    step: int
    gen_start_B: list[int]
    mask_id: int
    edits: int = 0
    """Edit Flows: edits applied at this step, over all rows (the canvas is then each row's new sequence)."""


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    cfg: SamplerConfig,
    special: SpecialIds,
    *,
    generator: torch.Generator | None = None,
    callback: Callable[[StepEvent], None] | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> GenerationResult:
    """Decode `gen_length` tokens after each prompt. `stop(row_ids)` says whether a row's decided
    prefix already ends the row (stop strings); `callback` sees the canvas after every step. `cfg`
    must be resolved (`config.rules.resolve_sampler`): its shift is on or off, never auto.
    `cfg.compile` compiles the model's blocks in place (sampling.compiled), once; later calls reuse them.

    The loop runs under `torch.inference_mode` (less dispatch work per op than `no_grad`: ~10% of a
    small model's forward); the returned canvas is an ordinary tensor, usable in autograd later."""
    with torch.inference_mode():
        if cfg.generation == "edit_flow":  # no canvas: tau-leaping over edit rates (sampling/edit_flow.py)
            result = _edit_flow(model, prompts, cfg, special, generator, callback)
        else:
            result = Loop(model, prompts, cfg, special, generator, callback, stop).run()
    result.canvas_BL = result.canvas_BL.clone()  # inference tensors cannot enter autograd
    return result


def _edit_flow(model, prompts, cfg: SamplerConfig, special: SpecialIds, generator, callback) -> GenerationResult:
    """An Edit Flows run: `steps` tau-leaping steps, up to gen_length new tokens; one generator per
    row, seeded from `generator`, so a row's output does not depend on its batch mates. `stop` does
    not end it early: until the last step any row can still change."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
    gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
    if cfg.compile:
        compile_blocks(model)
    policy = TauLeaping(cfg.total_steps, cfg.edit_kappa if cfg.edit_kappa != "auto" else "cubic",
                        cfg.edit_end_time or 1.0 - 1e-3, cfg.temperature)  # fmt: skip
    counters = Counters()
    completions = edit_flow_loop(model, prompts, policy, gens, anchor_id=special.mask_id, pad_id=special.pad_id,
                                 num_tokens=special.num_tokens or model.cfg.vocab_size, max_new_tokens=cfg.gen_length,
                                 counters=counters, callback=callback)  # fmt: skip
    sequences = [c[: c.index(special.eos_id)] if cfg.stop_at_eos and special.eos_id in c else c for c in completions]
    device = next(model.parameters()).device
    canvas, _ = pad_rows([[special.mask_id, *p, *c] for p, c in zip(prompts, completions, strict=True)],
                         special.pad_id, device)  # fmt: skip
    counters.tokens_committed = sum(map(len, sequences))
    return GenerationResult(sequences, canvas, counters, [1 + len(p) for p in prompts])


def edit_flow_loop(
    model: torch.nn.Module, prompts: list[list[int]], policy: TauLeaping, generators: list[torch.Generator], *,
    anchor_id: int, pad_id: int, num_tokens: int, max_new_tokens: int, counters: Counters,
    callback: Callable[[StepEvent], None] | None = None,
) -> list[list[int]]:  # fmt: skip
    """The loop of an Edit Flows run: per step one batched forward of the rows `[anchor] + prompt +
    completion` (padded, padding masked out of attention), the policy's events (sampling/edit_flow.py),
    the counters and the step callback (the new rows as the canvas, the inserted or substituted
    positions as committed). Returns each row's completion."""
    device = next(model.parameters()).device
    completions: list[list[int]] = [[] for _ in prompts]
    gen_start = [1 + len(p) for p in prompts]
    for step in range(policy.num_steps):
        tokens_BL, valid_BL = pad_rows([[anchor_id, *p, *c] for p, c in zip(prompts, completions, strict=True)],
                                       pad_id, device)  # fmt: skip
        positions = torch.arange(tokens_BL.shape[1], device=device).expand_as(tokens_BL)
        out = model(tokens_BL, positions, AttentionMask("bidirectional", key_valid_BL=valid_BL))
        counters.nfe, counters.steps = counters.nfe + 1, counters.steps + 1
        counters.query_tokens += int(valid_BL.sum())
        before = completions
        completions, edits = tau_leaping_step(out, prompts, completions, policy, step, generators,
                                              num_tokens=num_tokens, anchor_id=anchor_id,
                                              max_new_tokens=max_new_tokens)  # fmt: skip
        counters.edits += edits
        if callback is not None:
            rows = [[anchor_id, *p, *c] for p, c in zip(prompts, completions, strict=True)]
            canvas, _ = pad_rows(rows, pad_id, device)
            committed = torch.zeros_like(canvas, dtype=torch.bool)
            for b, (old, new) in enumerate(zip(before, completions, strict=True)):
                for i in _changed(old, new):
                    committed[b, gen_start[b] + i] = True
            callback(StepEvent(canvas, committed, 0, step, gen_start, anchor_id, edits))
    return completions


def _changed(old: list[int], new: list[int]) -> list[int]:
    """Positions of `new` not carried over from `old` (a greedy left-to-right match: inserted or substituted)."""
    out, j = [], 0
    for i, tok in enumerate(new):
        if j < len(old) and old[j] == tok:
            j += 1
        else:
            out.append(i)
    return out


class Loop:
    """One generate call: the canvas, its undecided positions, the counters, and the loop over them."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds,
                 generator, callback, stop) -> None:  # fmt: skip
        if not prompts:
            raise ValueError("generate needs at least one prompt")
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

    def run(self) -> GenerationResult:
        for b, (lo, hi) in enumerate(self.canvas.blocks):
            if self.decode_block(b, lo, hi) or (self.stop is not None and self.all_rows_ended()):
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

    def decode_block(self, b: int, lo: int, hi: int) -> bool:
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
            while bool((eligible := self.undecided_BT[:, rlo:rhi]).any()):
                every = cfg.refresh_every  # prefix / dual caches: a full forward every N steps as well
                refresh = step_in_block == 0 or (every is not None and step_in_block % every == 0)
                logits = self.predict(lo, hi, refresh)[:, rlo - lo : rhi - lo]
                prop = full_proposal(logits, cfg.temperature, self.generator, cfg.top_k, cfg.top_p)
                self.counters.overrun_steps += int(k >= budget)
                commit = self.policy.step(prop, StepState(eligible, schedule_BS, k, budget, self.generator))
                self.write(rlo, rhi, commit, b, step_in_block)
                k, step_in_block = k + 1, step_in_block + 1
                if cfg.stop_at_eos and self.all_rows_ended():
                    return True
        return False

    def predict(self, lo: int, hi: int, refresh: bool) -> torch.Tensor:
        """Logits of the block: a forward, or the last one when nothing was written since (exact)."""
        if self.last_logits is None or self.written or not self.cfg.reuse_unchanged:
            self.last_logits = self.runner.predict(self.x, lo, hi, refresh)
        else:
            self.counters.reused_forwards += 1
        return self.last_logits

    def write(self, rlo: int, rhi: int, commit: Commit, block: int, step: int) -> None:
        """Apply a policy's commit to the region [rlo, rhi), count it, and show it to the callback."""
        at = commit.positions_BR if commit.renoise_BR is None else commit.positions_BR | commit.renoise_BR
        self.x[:, rlo:rhi] = torch.where(at, commit.tokens_BR, self.x[:, rlo:rhi])
        num = int(commit.positions_BR.sum())
        if commit.final:
            self.undecided_BT[:, rlo:rhi] &= ~commit.positions_BR
            self.counters.tokens_committed += num
        self.written = num > 0 or commit.renoise_BR is not None
        self.counters.steps += 1
        if self.callback is not None:
            committed = torch.zeros_like(self.x, dtype=torch.bool)
            committed[:, rlo:rhi] = commit.positions_BR
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
