"""THE sampling loop: every policy and cache of masked and block diffusion decoding in one place.

The canvas is [prompt ; gen_length masks] per row. Blocks are decoded left to right (LLaDA's
semi-autoregressive schedule, Nie et al. 2025; block diffusion, Arriola et al. 2025); inside a block
each step runs the model, proposes a token per position, and the policy (policies.py) commits some of
the masked ones. This module owns the model call, the cache (cache.py) and the counters.

Layouts:
- bidirectional models: prompts left-padded to a common length P; blocks of `block_length` start at P.
- block models (attention: block): blocks are aligned to positions counted from each prompt's start,
  as in training, so a prompt that ends inside a block shares it with the first generated tokens.
  Rows are left-padded by whole blocks; a row's own tail past its gen_length is padding.
  Padding is a separate "document" for the mask (it sees only padding; real tokens never see it).

Model calls (Runner): the whole canvas (no cache); the active block and everything after it against
a cached prefix (prefix cache), only the active block against cached prefix and suffix (dual cache),
both refreshed by a full forward at each block start or every `refresh_every` steps; for block models
the canvas up to the active block under the block-causal mask (no cache), or with the exact block
cache only the active block (plus the previous block's clean tokens once, whose keys are then final).
Shifted models (position i predicted from hidden i-1) run one extra query row before the slice.

The loop never returns a mask: a block that is not done after its step budget keeps going, one step
at a time (counted in `overrun_steps`). The budget is steps / (gen_length / block_length) per canvas
block; for block models a prompt that ends inside a block makes one block more (partial at both ends).
Shapes: B batch, T canvas, V vocabulary, R region, Q query rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dllm.config.sampler import SamplerConfig
from dllm.diffusion.corruption import uniform_token_ids
from dllm.sampling.canvas import Canvas, SpecialIds, left_pad
from dllm.sampling.policies import make_policy, select_topk
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


# --------------------------------------------------------------------------------------------------
# the loop


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
    prefix already ends the row (stop strings); `callback` sees the canvas after every step.

    The loop runs under `torch.inference_mode` (less dispatch work per op than `no_grad`: ~10% of a
    small model's forward); the returned canvas is an ordinary tensor, usable in autograd later."""
    with torch.inference_mode():
        result = _generate(model, prompts, cfg, special, generator, callback, stop)
    result.canvas_BL = result.canvas_BL.clone()  # inference tensors cannot enter autograd
    return result


def _generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    cfg: SamplerConfig,
    special: SpecialIds,
    generator: torch.Generator | None,
    callback: Callable[[StepEvent], None] | None,
    stop: Callable[[list[int]], bool] | None,
) -> GenerationResult:
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    device = next(model.parameters()).device
    block_attention = cfg.attention == "block"
    shift = resolve_shift(cfg, model)
    if shift and min(len(p) for p in prompts) == 0:
        raise ValueError("a shifted model predicts position i from i-1: every prompt needs at least one token")
    canvas = Canvas.build(prompts, cfg, special, block_attention, device, shift)
    counters = Counters()
    runner = Runner(model, canvas, cfg, special, shift, counters)
    loop = Loop(runner, canvas, cfg, special, generator, callback, stop)
    if cfg.policy in ("ancestral", "first_hitting"):
        loop.reverse_process()
    elif cfg.policy == "uniform":
        loop.uniform_process()
    else:
        loop.commit_loop()
    x = loop.x
    assert not bool((x == special.mask_id).any()), "the loop decodes every masked position"
    sequences = []
    for i, row in enumerate(x.tolist()):
        s = canvas.gen_start_B[i]
        out = row[s : s + cfg.gen_length]
        if cfg.stop_at_eos and special.eos_id in out:
            out = out[: out.index(special.eos_id)]
        sequences.append(out)
    return GenerationResult(sequences, x, counters, canvas.gen_start_B)


def resolve_shift(cfg: SamplerConfig, model: torch.nn.Module) -> bool:
    if cfg.shift != "auto":
        return cfg.shift == "on"
    return bool(getattr(getattr(model, "cfg", None), "shift_logits", False))


class Loop:
    def __init__(self, runner: Runner, canvas: Canvas, cfg: SamplerConfig, special: SpecialIds,
                 generator, callback, stop) -> None:  # fmt: skip
        self.runner, self.canvas, self.cfg, self.special = runner, canvas, cfg, special
        self.generator, self.callback, self.stop = generator, callback, stop
        self.x = canvas.x_BT.clone()
        self.counters = runner.counters
        self.steps_per_block = cfg.total_steps // cfg.num_blocks

    # -- helpers ------------------------------------------------------------------------------------
    def masked(self) -> torch.Tensor:
        return self.x == self.special.mask_id

    def commit(self, lo: int, hi: int, commit_BR: torch.Tensor, tokens_BR: torch.Tensor, block: int, step: int):
        region = self.x[:, lo:hi]
        self.x[:, lo:hi] = torch.where(commit_BR, tokens_BR, region)
        self.counters.tokens_committed += int(commit_BR.sum())
        self.counters.steps += 1
        if self.callback is not None:
            committed = torch.zeros_like(self.x, dtype=torch.bool)
            committed[:, lo:hi] = commit_BR
            self.callback(StepEvent(self.x, committed, block, step, self.canvas.gen_start_B, self.special.mask_id))

    def all_rows_ended(self) -> bool:
        """Every row's output can no longer change: an EOS (or a stop) with no mask before it."""
        if not self.cfg.stop_at_eos and self.stop is None:
            return False
        for i, row in enumerate(self.x.tolist()):
            s = self.canvas.gen_start_B[i]
            gen = row[s : s + self.cfg.gen_length]
            decided = gen[: gen.index(self.special.mask_id)] if self.special.mask_id in gen else gen
            ended = self.cfg.stop_at_eos and self.special.eos_id in decided
            if not ended and self.stop is not None:
                ended = self.stop(decided)
            if not ended:
                return False
        return True

    def finish_early(self) -> None:
        """Every row has ended: the masks left lie after each row's end and are cut from the output."""
        self.x = torch.where(self.masked(), self.special.eos_id, self.x)

    # -- scheduled and parallel policies ---------------------------------------------------------------
    def commit_loop(self) -> None:
        cfg = self.cfg
        policy = make_policy(cfg.policy, cfg.threshold, cfg.factor)
        sub = cfg.sub_block_length or cfg.block
        for b, (lo, hi) in enumerate(self.canvas.blocks):
            regions = [(r, r + sub) for r in range(lo, hi, sub)]
            budget = max(self.steps_per_block // len(regions), 1)
            step_in_block = 0
            for rlo, rhi in regions:
                eligible = self.masked()[:, rlo:rhi]
                sched = commit_schedule(eligible.sum(-1), budget)
                k = 0
                while bool(self.masked()[:, rlo:rhi].any()):
                    refresh = step_in_block == 0 or (
                        cfg.refresh_every is not None and step_in_block % cfg.refresh_every == 0
                    )
                    logits = self.runner.predict(self.x, lo, hi, refresh)[:, rlo - lo : rhi - lo]
                    prop = full_proposal(logits, cfg.temperature, self.generator, cfg.top_k, cfg.top_p)
                    eligible = self.masked()[:, rlo:rhi]
                    if k >= budget:  # past the budget: keep going rather than leave a mask
                        self.counters.overrun_steps += 1
                    if policy.scheduled:
                        n_B = sched[:, k] if k < budget else torch.ones_like(sched[:, 0])
                        commit = select_topk(policy.scores(prop, self.generator), eligible, n_B)
                    else:
                        commit = policy.commit(prop, eligible)
                    self.commit(rlo, rhi, commit, prop.tokens_BR, b, step_in_block)
                    k += 1
                    step_in_block += 1
                    if cfg.stop_at_eos and self.all_rows_ended():
                        return self.finish_early()
            if self.stop is not None and self.all_rows_ended():
                return self.finish_early()
        return None

    # -- MDLM reverse process ------------------------------------------------------------------------
    def reverse_process(self) -> None:
        """ancestral: each step from t to s = t - 1/N unmasks each masked position with probability
        (t - s) / t (linear schedule) with a token drawn from the model; a step that unmasks nothing
        leaves the input unchanged, so its forward is reused (exact). first_hitting: one position per
        forward, in uniformly random order (the exact process for time-agnostic models)."""
        cfg, first_hitting = self.cfg, self.cfg.policy == "first_hitting"
        for b, (lo, hi) in enumerate(self.canvas.blocks):
            N = hi - lo if first_hitting else self.steps_per_block
            logits, step = None, 0
            while bool(self.masked()[:, lo:hi].any()):
                eligible = self.masked()[:, lo:hi]
                if step >= N:
                    self.counters.overrun_steps += 1
                if first_hitting:
                    u = torch.rand(eligible.shape, generator=self.generator, device=self.x.device)
                    unmask = select_topk(u, eligible, torch.ones_like(eligible[:, 0], dtype=torch.long))
                else:
                    t, s = 1 - step / N, max(1 - (step + 1) / N, 0.0)
                    p = (t - s) / t if step < N - 1 else 1.0
                    u = torch.rand(eligible.shape, generator=self.generator, device=self.x.device)
                    unmask = eligible & (u < p)
                changed = bool(unmask.any())
                if logits is None or not cfg.reuse_unchanged or self._dirty:
                    logits = self.runner.predict(self.x, lo, hi, refresh=True)
                    self._dirty = False
                else:
                    self.counters.reused_forwards += 1
                prop = full_proposal(logits, cfg.temperature, self.generator, cfg.top_k, cfg.top_p)
                self.commit(lo, hi, unmask, prop.tokens_BR, b, step)
                self._dirty = changed
                step += 1
                if cfg.stop_at_eos and self.all_rows_ended():
                    return self.finish_early()
            if self.stop is not None and self.all_rows_ended():
                return self.finish_early()
        return None

    _dirty = False

    # -- uniform-state decoding ---------------------------------------------------------------------
    def uniform_process(self) -> None:
        """Uniform-state models have no mask: the block starts as uniformly random tokens; each step
        predicts x_0 everywhere, keeps the alpha(s) share of most confident predictions and re-noises
        the rest with fresh random tokens; the last step keeps every prediction."""
        cfg, special = self.cfg, self.special
        if special.num_tokens is None:
            raise ValueError("uniform decoding needs SpecialIds.num_tokens (the tokenizer's vocabulary)")
        for b, (lo, hi) in enumerate(self.canvas.blocks):
            region = self.masked()[:, lo:hi]
            self.x[:, lo:hi] = torch.where(region, self._random_tokens(region.shape), self.x[:, lo:hi])
            N = self.steps_per_block
            n_B = region.sum(-1)
            for step in range(N):
                logits = self.runner.predict(self.x, lo, hi, refresh=True)
                prop = full_proposal(logits, cfg.temperature, self.generator, cfg.top_k, cfg.top_p)
                alpha_s = (step + 1) / N  # linear schedule: alpha(s) = 1 - s, s = 1 - (step + 1) / N
                keep_B = torch.floor(alpha_s * n_B.double() + 1e-9).long()
                keep = select_topk(prop.prob_BR, region, keep_B)
                noise = self._random_tokens(region.shape)
                new = torch.where(keep, prop.tokens_BR, torch.where(region, noise, self.x[:, lo:hi]))
                self.x[:, lo:hi] = new
                self.counters.steps += 1
                if self.callback is not None:
                    committed = torch.zeros_like(self.x, dtype=torch.bool)
                    committed[:, lo:hi] = keep
                    self.callback(StepEvent(self.x, committed, b, step, self.canvas.gen_start_B, special.mask_id))
            self.counters.tokens_committed += int(n_B.sum())
            if self.all_rows_ended():  # EOS or a stop string in every row's decoded blocks
                return self.finish_early()
        return None

    def _random_tokens(self, shape) -> torch.Tensor:
        """Uniform over the tokenizer's ids without the mask id (as the uniform objective corrupts)."""
        assert self.special.num_tokens is not None
        u = torch.rand(shape, generator=self.generator, device=self.x.device)
        return uniform_token_ids(u, self.special.num_tokens, self.special.mask_id)
