"""What a decoding call returns and what it cost: one result, one set of counters and one step event
for every loop (canvas diffusion in generate.py, Edit Flows in edit_flow.py, causal decoding in
speculative.py, DiffusionGemma's canvases in canvas_denoiser.py).

Shapes: B batch, L canvas, N new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar

import torch

Loop = Literal["canvas", "edit_flow", "causal", "canvas_denoise"]
T = TypeVar("T")


@dataclass
class Counters:
    """What a call cost. Query and cached tokens count rows x positions (padding included)."""

    loop: Loop = "canvas"
    """Which loop ran: the causal loop adds its speculative rates to `as_dict`."""
    nfe: int = 0
    """Model forward calls (a classifier-free-guidance pair runs as one batched call; causal: target forwards,
    the prefill included, not the drafter's)."""
    query_tokens: int = 0
    """Positions run through the model as queries."""
    cached_tokens: int = 0
    """Key positions read from the KV cache instead of being recomputed (cache hits)."""
    tokens_committed: int = 0
    """Tokens decoded over all rows (causal: each row's output up to its end, EOS included)."""
    steps: int = 0
    """Decoding steps (a reused forward counts a step but no NFE; causal: verify rounds of the batch)."""
    reused_forwards: int = 0
    """Steps answered from the previous forward because no token changed (ancestral)."""
    overrun_steps: int = 0
    """Steps past a block's budget, taken instead of leaving a mask."""
    edits: int = 0
    """Edit Flows: insertions, deletions and substitutions drawn, over all rows."""
    rounds: int = 0
    """Causal: verify rounds summed over the rows still running (one per AR token after the first)."""
    drafted: int = 0
    """Causal: draft tokens proposed to the rows still running (0 without a drafter)."""
    accepted: int = 0
    """Causal: draft tokens the target accepted."""

    def as_dict(self) -> dict[str, float]:
        """The counts and their rates; the causal loop's also tau (tokens a row gains per round: accepted
        drafts + the target's own token, 1 for AR decoding), the acceptance rate and forwards per token."""
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "loop"}
        d["tokens_per_forward"] = self.tokens_committed / max(self.nfe, 1)
        if self.loop == "causal":
            d["forwards_per_token"] = self.nfe / max(self.tokens_committed, 1)
            d["tau"] = (self.accepted + self.rounds) / max(self.rounds, 1)
            d["acceptance_rate"] = self.accepted / max(self.drafted, 1)
        return d

    def add(self, other: Counters) -> None:
        """Add another call's counts (totals over the batches of a command)."""
        for f in fields(self):
            if f.name != "loop":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.loop = other.loop


@dataclass
class GenerationResult:
    sequences: list[list[int]]
    """Generated ids per prompt (cut at the first EOS when stop_at_eos)."""
    canvas_BL: torch.Tensor
    """The whole final canvas, prompts and padding included (causal: each row's prompt, then its new tokens)."""
    counters: Counters
    gen_start_B: list[int] = field(default_factory=list)
    """Canvas index of each row's first generated token."""
    logits_BNV: torch.Tensor | None = None
    """Causal decoding with `return_logits`: the target's logits each new token was chosen from (float32)."""

    @property
    def nfe(self) -> int:
        return self.counters.nfe

    @property
    def tokens_committed(self) -> int:
        return self.counters.tokens_committed

    @property
    def tokens_per_forward(self) -> float:
        return self.counters.tokens_committed / max(self.counters.nfe, 1)


class OwnStep:
    """The call of a loop that runs its own forward inside its step (Edit Flows, DiffusionGemma's canvases): the
    engine answers it with None when the scheduler gives the loop its step."""

    def __repr__(self) -> str:
        return "OWN_STEP"


OWN_STEP = OwnStep()


def run_alone(steps: Generator[OwnStep, None, T]) -> T:
    """Drive a loop that runs its own forwards (it yields only `OWN_STEP`) to its end, with nothing beside it."""
    try:
        while True:
            next(steps)
    except StopIteration as end:
        return end.value


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
    draft_BT: torch.Tensor | None = None
    """canvas_denoise: the canvas with the current proposals where `canvas_BT`, which holds only what is decided,
    has masks (what a denoising view shows; text streams from `canvas_BT`); None: `canvas_BT` is that view."""
