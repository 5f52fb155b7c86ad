"""Edit Flows sampling: tau-leaping over the model's edit rates (Havasi et al. 2025).

A row is `[anchor] + prompt + completion` (the layout the edit_flow objective trains on: the anchor
is the mask id, and an insertion after the last prefix token starts the completion). The completion
starts empty and time runs from 0 to `end_time` in `num_steps` steps (the grid: below). Each step is one batched
forward (rows padded to the longest, padding masked out of attention); then, per editable position i
with time-free intensities lambda (insert after i, delete i, substitute i) and total lambda_i, one
event happens with probability 1 - exp(-(K(s) - K(t)) lambda_i), of kind chosen in proportion to
the intensities (at most one event per position, so the edits of a step never conflict); inserted
and substituted tokens are drawn from the head's token distributions (at the sampler's temperature;
0 takes the most probable token, as the canvas samplers' greedy default does). All edits of a step are
applied at once, from the intensities of the sequence before the step. The prompt is never edited;
a completion stops growing at `max_new_tokens`.

The time: the rate is u = w(t) * lambda with w = kappa' / (1 - kappa) (diffusion/objectives/edit_flow.py),
and the step [t, s] uses the integral of w over it, K(s) - K(t) with K = -log(1 - kappa)
(diffusion/edit_schedule.py), not w at the step's start: with lambda held fixed over the step this is
exact for the factorised rate, where w(t) * h is not (it underestimates the step's weight, badly near
t = 1, and is 0 for the first step of the cubic schedule). The last step ends at `end_time`, the
training's 1 - eps, not at 1: K(1) is infinite, so ending at 1 would fire every position whose
lambda is above 0, and a softplus intensity never is exactly 0 (a finished answer would get one
spurious edit per position); the model never saw x_t from later than 1 - eps either.

The grid (`grid`): by default the steps take equal shares of K(end_time) ("weight": t_k with
K(t_k) = k / N * K(end_time)), since the intensities are time-free and K is the process's own clock;
equal steps in t ("time") put most of K into the last steps (K grows like -log(1 - t)), where many
positions then fire together (with x_0 empty: several insertions into different gaps for the same
missing token, i.e. overlong answers). The per-step fire probability is 1 - exp(-(K(s) - K(t)) lambda)
on either grid.

`TauLeaping.step` is the policy and `tau_leaping_step` applies it to a batch (neither calls the
model); `edit_flow_steps` owns the model call, the counters and the step callback, with the same
counters, result and step events as the other loops (results.py). The inference engine steps it as a
request (`EditFlowLoop`, generation edit_flow); `sample_edit_flow` runs it alone with explicit generators.
Randomness is one generator per row, so a row's result does not depend on its batch mates.

Shapes: B batch, L padded row length, V vocabulary, E hidden.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.sampler import SamplerConfig
from dllm.diffusion.edit_schedule import cumulative_weight, time_of_weight
from dllm.models.edit_flow import DELETE, INSERT, SUBSTITUTE, edit_token_log_probs
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.compiled import compile_blocks
from dllm.sampling.results import OWN_STEP, Counters, GenerationResult, OwnStep, StepEvent, run_alone

KEEP = -1
"""Event kind of a position that is left as it is."""


@dataclass(frozen=True)
class RowEdits:
    """One row's events of a step, per editable position (from the last prefix token on)."""

    kind_N: torch.Tensor
    """KEEP, INSERT (after the position), DELETE or SUBSTITUTE."""
    token_N: torch.Tensor
    """Token inserted or substituted (unused for KEEP and DELETE)."""


class TauLeaping:
    """Draws a step's edit events from intensities and token distributions (one row at a time)."""

    def __init__(
        self, num_steps: int, kappa: str = "cubic", end_time: float = 1.0, temperature: float = 1.0,
        grid: str = "weight",
    ) -> None:  # fmt: skip
        assert num_steps > 0 and 0.0 < end_time <= 1.0 and temperature >= 0 and grid in ("weight", "time")
        self.num_steps, self.kappa, self.end_time, self.temperature = num_steps, kappa, end_time, temperature
        k_N = torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
        if grid == "time" or end_time == 1.0:  # K(1) is infinite: no equal shares of it
            times = (k_N * end_time).tolist()
        else:
            times = time_of_weight(kappa, k_N * cumulative_weight(kappa, end_time)).tolist()
        self.times = [*times[:-1], end_time]
        """Step boundaries t_0 = 0 < ... < t_N = end_time."""

    def weight(self, step: int) -> float:
        """K(s) - K(t) of step `step` over [t, s] (inf for a last step that ends at t = 1)."""
        t, s = self.times[step], self.times[step + 1]
        return cumulative_weight(self.kappa, s) - cumulative_weight(self.kappa, t)

    @staticmethod
    def fire_probability(weight: float, total_N: torch.Tensor) -> torch.Tensor:
        """1 - exp(-weight * lambda) per position (float64); with an infinite weight, 1 where lambda > 0."""
        total_N = total_N.double()
        if weight == float("inf"):
            return (total_N > 0).double()
        return -torch.expm1(-weight * total_N)

    def step(
        self, rates_N3: torch.Tensor, ins_logp_NV: torch.Tensor, sub_logp_NV: torch.Tensor, generator: torch.Generator,
        weight: float,
    ) -> RowEdits:  # fmt: skip
        """`rates_N3`: the intensities lambda; `weight`: K(s) - K(t) of the step (`self.weight`).
        Position 0 is the last prefix token: it may only insert (the prompt is never edited)."""
        rates_N3 = rates_N3.clone()
        rates_N3[0, DELETE] = rates_N3[0, SUBSTITUTE] = 0.0
        total_N = rates_N3.sum(-1)
        u_N = torch.rand(total_N.shape, generator=generator, dtype=torch.float64)
        fires_N = u_N < self.fire_probability(weight, total_N)
        kind_N = torch.full_like(total_N, KEEP, dtype=torch.long)
        token_N = torch.zeros_like(kind_N)
        idx = fires_N.nonzero(as_tuple=True)[0]
        if idx.numel():
            kind_N[idx] = torch.multinomial(rates_N3[idx].double(), 1, generator=generator)[:, 0]
            logp_NV = torch.where((kind_N[idx] == INSERT)[:, None], ins_logp_NV[idx], sub_logp_NV[idx])
            if self.temperature == 0:  # greedy tokens (the events themselves stay random)
                token_N[idx] = logp_NV.argmax(-1)
            else:
                probs_NV = torch.softmax(logp_NV.double() / self.temperature, -1)
                token_N[idx] = torch.multinomial(probs_NV, 1, generator=generator)[:, 0]
        return RowEdits(kind_N, token_N)


def apply_edits(completion: list[int], edits: RowEdits, max_completion: int) -> list[int]:
    """The completion after a step's events (event 0 belongs to the last prefix token, event i >= 1
    to completion token i - 1); insertions stop at `max_completion` tokens."""
    kinds, tokens = edits.kind_N.tolist(), edits.token_N.tolist()
    out: list[int] = []
    room = max_completion - len(completion) + sum(k == DELETE for k in kinds)
    for i, (kind, token) in enumerate(zip(kinds, tokens, strict=True)):
        if i > 0 and kind != DELETE:
            out.append(token if kind == SUBSTITUTE else completion[i - 1])
        if kind == INSERT and room > 0:
            out.append(token)
            room -= 1
    return out


@dataclass
class EditFlowOutput:
    completions: list[list[int]]
    """Each row's generated tokens (the prompt and the anchor left out)."""
    nfe: int = 0
    """Model forwards (one per step for the whole batch)."""
    edits_per_step: list[int] = field(default_factory=list)
    """Edits applied in each step, summed over rows."""


def tau_leaping_step(
    out, prompts: list[list[int]], completions: list[list[int]], policy: TauLeaping, step: int,
    generators: list[torch.Generator], *, num_tokens: int, anchor_id: int, max_new_tokens: int,
) -> tuple[list[list[int]], int]:  # fmt: skip
    """One step's events for every row from the forward `out` of the rows `[anchor] + prompt + completion`
    (the policy's part: no model call); the completions after the step and the number of edits."""
    assert out.edit is not None, "an edit-flow run needs a model built with model.edit_head"
    weight, edits, new = policy.weight(step), 0, []
    rates_BL3, ins_BLE = out.edit(out.hidden_BLE)  # the heads once for the batch, then one row at a time
    ins_logp_BLV = edit_token_log_probs(out.head, ins_BLE, num_tokens, anchor_id)
    sub_logp_BLV = edit_token_log_probs(out.head, out.hidden_BLE, num_tokens, anchor_id)
    batch = [t.to("cpu", torch.float64) for t in (rates_BL3, ins_logp_BLV, sub_logp_BLV)]  # CPU generators
    for b, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        lo, hi = len(prompt), 1 + len(prompt) + len(completion)  # the last prefix token on
        row_edits = policy.step(*(t[b, lo:hi] for t in batch), generators[b], weight)
        edits += int((row_edits.kind_N != KEEP).sum())
        new.append(apply_edits(completion, row_edits, max_new_tokens))
    return new, edits


class EditFlowLoop:
    """One Edit Flows request (`decode`: its steps, each running its own forward): `steps` tau-leaping steps,
    up to gen_length new tokens; one generator per row, seeded from `generator`, so a row's output does not
    depend on its batch mates. `stop` does not end it early: until the last step any row can still change."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds,
                 generator: torch.Generator | None, callback: Callable[[StepEvent], None] | None) -> None:  # fmt: skip
        seeds = torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
        self.generators = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
        if cfg.compile:
            compile_blocks(model)
        self.policy = TauLeaping(cfg.total_steps, cfg.edit_kappa if cfg.edit_kappa != "auto" else "cubic",
                                 cfg.edit_end_time or 1.0 - 1e-3, cfg.temperature)  # fmt: skip
        self.model, self.prompts, self.cfg, self.special, self.callback = model, prompts, cfg, special, callback
        self.counters = Counters(loop="edit_flow")
        self.rows = len(prompts)

    def decode(self) -> Generator[OwnStep, None, GenerationResult]:
        special, cfg, model = self.special, self.cfg, self.model
        completions = yield from edit_flow_steps(
            model, self.prompts, self.policy, self.generators, anchor_id=special.mask_id, pad_id=special.pad_id,
            num_tokens=special.num_tokens or model.cfg.vocab_size, max_new_tokens=cfg.gen_length,
            counters=self.counters, callback=self.callback,
        )  # fmt: skip
        sequences = [
            c[: c.index(special.eos_id)] if cfg.stop_at_eos and special.eos_id in c else c for c in completions
        ]
        device = next(model.parameters()).device
        canvas, _ = pad_rows([[special.mask_id, *p, *c] for p, c in zip(self.prompts, completions, strict=True)],
                             special.pad_id, device)  # fmt: skip
        self.counters.tokens_committed = sum(map(len, sequences))
        return GenerationResult(sequences, canvas, self.counters, [1 + len(p) for p in self.prompts])


def edit_flow_steps(
    model: torch.nn.Module, prompts: list[list[int]], policy: TauLeaping, generators: list[torch.Generator], *,
    anchor_id: int, pad_id: int, num_tokens: int, max_new_tokens: int, counters: Counters,
    callback: Callable[[StepEvent], None] | None = None,
) -> Generator[OwnStep, None, list[list[int]]]:  # fmt: skip
    """The loop of an Edit Flows run, one step at a time (it yields `OWN_STEP` before each): per step one
    batched forward of the rows `[anchor] + prompt + completion` (padded, padding masked out of attention),
    the policy's events (sampling/edit_flow.py), the counters and the step callback (the new rows as the
    canvas, the inserted or substituted positions as committed). Returns each row's completion."""
    device = next(model.parameters()).device
    completions: list[list[int]] = [[] for _ in prompts]
    gen_start = [1 + len(p) for p in prompts]
    for step in range(policy.num_steps):
        yield OWN_STEP
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


def sample_edit_flow(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    num_steps: int,
    anchor_id: int,
    pad_id: int,
    num_tokens: int,
    max_new_tokens: int,
    generators: list[torch.Generator],
    kappa: str = "cubic",
    end_time: float = 1.0 - 1e-3,
    temperature: float = 1.0,
    grid: str = "weight",
) -> EditFlowOutput:
    """Tau-leaping from an empty completion after each prompt, from t = 0 to `end_time` under the
    training's `kappa` schedule; `generators`: one per row. `temperature` applies to the inserted and
    substituted tokens (0: the most probable one); when and where edits happen is always drawn.
    The loop is `edit_flow_steps`; this is its entry point with explicit generators."""
    assert len(generators) == len(prompts) and num_steps > 0
    policy = TauLeaping(num_steps, kappa, end_time, temperature, grid)
    counters, per_step = Counters(loop="edit_flow"), []
    with torch.no_grad():
        completions = run_alone(edit_flow_steps(
            model, prompts, policy, generators, anchor_id=anchor_id, pad_id=pad_id, num_tokens=num_tokens,
            max_new_tokens=max_new_tokens, counters=counters, callback=lambda event: per_step.append(event.edits),
        ))  # fmt: skip
    return EditFlowOutput(completions, counters.nfe, per_step)


def pad_rows(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows left-aligned in [B, L] with `pad_id` after each row's end, and which positions are real."""
    L = max(len(r) for r in rows)
    tokens = torch.full((len(rows), L), pad_id, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    return tokens, torch.arange(L, device=device)[None, :] < lengths[:, None]
