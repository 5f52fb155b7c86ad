"""What each step of the loop writes into the active region. A policy never calls the model.

Every policy is an object with `step(proposal, state) -> Commit`: it gets the step's proposals (token,
its probability, the runner-up's probability, the entropy of the distribution) and the region's state
(undecided positions, step, budget, generator) and says which positions take which tokens.

- scheduled policies (low_confidence, random, margin, entropy) score positions and commit the k best,
  k from the region's even schedule (LLaDA's semi-autoregressive remasking, Nie et al. 2025);
- threshold commits every position whose proposal has probability >= tau, and at least the most
  confident one per row (Fast-dLLM's confidence-aware parallel decoding, Wu et al. 2025);
- factor commits the n most confident positions with (n + 1) * (1 - p_n) < f, at least one
  (Fast-dLLM's factor-based rule: more tokens per step when the model is sure of many);
- ancestral simulates the MDLM reverse process (Sahoo et al. 2024) with the linear schedule;
  first_hitting unmasks one position per step in random order (Zheng et al. 2024);
- uniform decodes uniform-state models (no mask token): the region starts as random tokens and each
  step keeps the alpha(s) share of most confident predictions and re-noises the rest;
- llada2 is LLaDA2.0's block sampler: the masks with p > tau when there are at least k of them, else
  the k most confident, k an even share of the block per step; llada2_edit is LLaDA2.1's: at least
  `min_commit` masks per step, and decided tokens of the block are rewritten where the model proposes
  another token with p > edit_threshold, for up to `max_post_steps` steps after the block is full
  (LLaDA2.0 / LLaDA2.1 technical reports, inclusionAI 2025).

Shapes: B batch, R region (positions of the active block or sub-block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.config.registries import POLICIES
from dllm.config.sampler import SamplerConfig
from dllm.diffusion.corruption import uniform_token_ids
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.proposals import Proposal

__all__ = ["Commit", "Proposal", "StepState", "make_policy", "most_confident", "select_topk"]


@dataclass(frozen=True)
class StepState:
    """The active region at one step, as a policy sees it."""

    eligible_BR: torch.Tensor
    """Undecided positions: masked (uniform: the whole region until its last step)."""
    schedule_BS: torch.Tensor
    """commit_schedule of the region: its undecided positions at the start spread evenly over the budget."""
    step: int
    """Steps already taken in this region."""
    budget: int
    """The region's step budget; the loop keeps going past it (overrun) rather than leave a mask."""
    generator: torch.Generator | None
    tokens_BR: torch.Tensor | None = None
    """Editing policies: the region's tokens before this step."""
    editable_BR: torch.Tensor | None = None
    """Editing policies: decided generated positions of the rows still stepping (what an edit may rewrite)."""
    settled_B: torch.Tensor | None = None
    """Editing policies: steps of the region each row has taken with nothing undecided, this one included."""


@dataclass(frozen=True)
class Commit:
    """What a step writes into the region."""

    positions_BR: torch.Tensor
    """Positions decided at this step; they take `tokens_BR` (the callback's `committed_BT`)."""
    tokens_BR: torch.Tensor
    """The tokens written at `positions_BR` (and at `renoise_BR`)."""
    renoise_BR: torch.Tensor | None = None
    """Uniform decoding: positions rewritten with the fresh noise `tokens_BR` holds there."""
    final: bool = True
    """The decided positions leave the undecided set (uniform: only at the region's last step)."""
    edits_BR: torch.Tensor | None = None
    """Decided positions rewritten with `tokens_BR` (token editing); they stay decided."""
    again_B: torch.Tensor | None = None
    """Rows that ask for another step of the region though nothing in them is undecided (token editing)."""


class Policy:
    """Defaults: built without settings, the loop's budget, regions start as masks."""

    scheduled = False
    edits = False
    """The policy rewrites decided tokens: the loop gives it StepState's editing fields."""
    block_only = False
    """The policy decodes whole blocks of block-causal models only (its POLICIES tag `block`)."""

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        return cls()

    def budget(self, steps: int, length: int) -> int:
        """The step budget of a region of `length` positions given `steps` by the block's budget."""
        return steps

    def start(self, state: StepState) -> torch.Tensor | None:
        """What the undecided positions hold before the first step (None: the mask token)."""
        return None

    def step(self, prop: Proposal, state: StepState) -> Commit:
        raise NotImplementedError


class Scheduled(Policy):
    """Commit the k best-scoring undecided positions, k from the region's even schedule (one past it)."""

    scheduled = True

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        raise NotImplementedError

    def step(self, prop: Proposal, state: StepState) -> Commit:
        if state.step < state.budget:
            k_B = state.schedule_BS[:, state.step]
        else:  # past the budget: one token per step rather than leave a mask
            k_B = torch.ones_like(state.schedule_BS[:, 0])
        return Commit(select_topk(self.scores(prop, state.generator), state.eligible_BR, k_B), prop.tokens_BR)


class LowConfidence(Scheduled):
    """Commit the positions whose proposed token has the highest probability (LLaDA's default)."""

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return prop.prob_BR


class RandomOrder(Scheduled):
    """Commit random positions (the original masked-diffusion reverse process)."""

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return torch.rand(prop.prob_BR.shape, generator=generator, device=prop.prob_BR.device)


class Margin(Scheduled):
    """Commit the positions where the top-1 beats the top-2 probability by the most (Kim et al. 2025)."""

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return prop.margin_BR


class Entropy(Scheduled):
    """Commit the positions with the lowest predictive entropy (Dream's `entropy` remasking)."""

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return -prop.entropy_BR


class Parallel(Policy):
    """Commit as many undecided positions as the rule trusts (at least one per row)."""

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, prop: Proposal, state: StepState) -> Commit:
        return Commit(self.commit(prop, state.eligible_BR), prop.tokens_BR)


class Threshold(Parallel):
    """Every eligible position with p >= tau, and each row's most confident one."""

    def __init__(self, tau: float) -> None:
        self.tau = tau

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        return cls(cfg.threshold)

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        return (eligible_BR & (prop.prob_BR >= self.tau)) | most_confident(prop.prob_BR, eligible_BR)


class Factor(Parallel):
    """The n most confident eligible positions with (n + 1) * (1 - p_n) < f (p sorted descending), n >= 1."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        return cls(cfg.factor)

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        probs = torch.where(eligible_BR, prop.prob_BR.double(), torch.zeros_like(prop.prob_BR, dtype=torch.float64))
        sorted_p, _ = probs.sort(dim=-1, descending=True, stable=True)
        n = torch.arange(1, probs.shape[-1] + 1, device=probs.device, dtype=torch.float64)
        ok = (n + 1) * (1 - sorted_p) < self.factor
        # the rule holds for a prefix of the sorted list (p_n only falls as n grows): count it
        prefix = ok.long().cumprod(dim=-1).sum(-1)
        k_B = prefix.clamp_min(1).minimum(eligible_BR.sum(-1))
        return select_topk(prop.prob_BR, eligible_BR, k_B)


class Ancestral(Policy):
    """MDLM's ancestral sampler: the step from t to s = t - 1/N unmasks each masked position with
    probability (t - s) / t (linear schedule; MDLM, Sahoo et al. 2024); the last step unmasks the
    rest. A step that unmasks nothing leaves the input unchanged, so the loop reuses its forward."""

    def step(self, prop: Proposal, state: StepState) -> Commit:
        N, k, eligible = state.budget, state.step, state.eligible_BR
        t, s = 1 - k / N, max(1 - (k + 1) / N, 0.0)
        p = (t - s) / t if k < N - 1 else 1.0
        u = torch.rand(eligible.shape, generator=state.generator, device=eligible.device)
        return Commit(eligible & (u < p), prop.tokens_BR)


class FirstHitting(Policy):
    """One position per forward, in uniformly random order: the exact reverse process of a
    time-agnostic masked model (first-hitting sampler, Zheng et al. 2024). Its budget is the region."""

    def budget(self, steps: int, length: int) -> int:
        return length

    def step(self, prop: Proposal, state: StepState) -> Commit:
        eligible = state.eligible_BR
        u = torch.rand(eligible.shape, generator=state.generator, device=eligible.device)
        return Commit(select_topk(u, eligible, torch.ones_like(eligible[:, 0], dtype=torch.long)), prop.tokens_BR)


class Uniform(Policy):
    """Uniform-state decoding: the region starts as uniformly random tokens; each step predicts x_0
    everywhere, keeps the alpha(s) share of most confident predictions and re-noises the rest with
    fresh random tokens (linear schedule alpha(s) = 1 - s); the last step keeps every prediction."""

    def __init__(self, num_tokens: int, mask_id: int) -> None:
        self.num_tokens, self.mask_id = num_tokens, mask_id

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        if special is None or special.num_tokens is None:
            raise ValueError("uniform decoding needs SpecialIds.num_tokens (the tokenizer's vocabulary)")
        return cls(special.num_tokens, special.mask_id)

    def start(self, state: StepState) -> torch.Tensor:
        return self.noise(state)

    def step(self, prop: Proposal, state: StepState) -> Commit:
        alpha_s = (state.step + 1) / state.budget  # s = 1 - (step + 1) / N
        keep_B = torch.floor(alpha_s * state.eligible_BR.sum(-1).double() + 1e-9).long()
        keep = select_topk(prop.prob_BR, state.eligible_BR, keep_B)
        tokens = torch.where(keep, prop.tokens_BR, self.noise(state))
        return Commit(keep, tokens, renoise_BR=state.eligible_BR & ~keep, final=alpha_s >= 1)

    def noise(self, state: StepState) -> torch.Tensor:
        """Uniform over the tokenizer's ids without the mask id (as the uniform objective corrupts)."""
        u = torch.rand(state.eligible_BR.shape, generator=state.generator, device=state.eligible_BR.device)
        return uniform_token_ids(u, self.num_tokens, self.mask_id)


class LLaDA2(Parallel):
    """LLaDA2.0: the masks with p > tau if at least k pass, else the k most confident; k is step s's share of
    an even split of the region's length (not of its masks) over the budget, one past the budget."""

    block_only = True

    def __init__(self, tau: float) -> None:
        self.tau = tau

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        return cls(cfg.threshold)

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor, k: int = 1) -> torch.Tensor:
        return threshold_or_topk(prop.prob_BR, eligible_BR, self.tau, k)

    def step(self, prop: Proposal, state: StepState) -> Commit:
        R, N, s = state.eligible_BR.shape[-1], state.budget, state.step
        k = R // N + int(s < R % N) if s < N else 1
        return Commit(self.commit(prop, state.eligible_BR, k), prop.tokens_BR)


class LLaDA2Edit(Parallel):
    """LLaDA2.1: commit as LLaDA2.0 with a fixed k (`min_commit`), and edit: a decided generated token of the
    region takes the proposal when it differs and has p > edit_tau. A row keeps stepping after its last mask
    while its steps still edit, up to `max_post_steps` such steps."""

    edits = block_only = True

    def __init__(self, tau: float, edit_tau: float, min_commit: int, max_post_steps: int) -> None:
        self.tau, self.edit_tau, self.min_commit, self.max_post_steps = tau, edit_tau, min_commit, max_post_steps

    @classmethod
    def from_config(cls, cfg: SamplerConfig, special: SpecialIds | None) -> Policy:
        return cls(cfg.threshold, cfg.edit_threshold, cfg.min_commit, cfg.max_post_steps)

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        return threshold_or_topk(prop.prob_BR, eligible_BR, self.tau, self.min_commit)

    def step(self, prop: Proposal, state: StepState) -> Commit:
        commit = self.commit(prop, state.eligible_BR)
        if state.tokens_BR is None or state.editable_BR is None or state.settled_B is None:
            return Commit(commit, prop.tokens_BR)  # not run by the loop's editing path: commit only
        edits = state.editable_BR & (prop.prob_BR > self.edit_tau) & (prop.tokens_BR != state.tokens_BR)
        full_after = torch.full_like(edits[:, 0], self.max_post_steps >= 1)  # a step once the last mask is filled
        again_B = torch.where(
            state.eligible_BR.any(-1), full_after, edits.any(-1) & (state.settled_B < self.max_post_steps)
        )
        return Commit(commit, prop.tokens_BR, edits_BR=edits, again_B=again_B)


def threshold_or_topk(prob_BR: torch.Tensor, eligible_BR: torch.Tensor, tau: float, k: int) -> torch.Tensor:
    """Per row: the eligible positions with p > tau when at least k pass, else the k most probable."""
    high_BR = eligible_BR & (prob_BR > tau)
    k_B = torch.full_like(eligible_BR[:, 0], k, dtype=torch.long).minimum(eligible_BR.sum(-1))
    enough_B = high_BR.sum(-1) >= k
    return torch.where(enough_B[:, None], high_BR, select_topk(prob_BR, eligible_BR, k_B))


def make_policy(cfg: SamplerConfig, special: SpecialIds | None = None) -> Policy:
    """The policy `cfg.policy`, built from the sampler fields it uses (uniform: also the special ids)."""
    return POLICIES.resolve(cfg.policy).from_config(cfg, special)


def most_confident(prob_BR: torch.Tensor, eligible_BR: torch.Tensor) -> torch.Tensor:
    """Each row's single most probable eligible position (none for a row with nothing eligible)."""
    return select_topk(prob_BR, eligible_BR, torch.ones(prob_BR.shape[0], dtype=torch.long, device=prob_BR.device))


def select_topk(scores_BL: torch.Tensor, eligible_BL: torch.Tensor, k_B: torch.Tensor) -> torch.Tensor:
    """Bool [B, L]: the k_B[b] highest-scoring eligible positions of each row."""
    # eligible scores stay finite (even a -inf score), so they always rank above ineligible positions
    floor = torch.finfo(torch.float64).min
    finite = scores_BL.double().nan_to_num(nan=floor, neginf=floor)
    masked = torch.where(eligible_BL, finite, torch.tensor(float("-inf"), dtype=torch.float64))
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (rank < k_B[:, None]) & eligible_BL
