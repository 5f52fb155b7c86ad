"""A request as the engine holds it: one decoding loop (sampling/), advanced one model call at a time.

Every decoding loop is a coroutine (`decode()`): it yields the model call it needs next and is sent that
call's answer; it returns its `GenerationResult`. The canvas loop (sampling/canvas_loop.py: `Loop`) yields
`(lo, hi, refresh)` and takes the active block's logits; the causal loop (sampling/causal_loop.py) yields a
`CausalCall` and takes its rows' logits and features; loops that run their own forward inside their step
(Edit Flows, DiffusionGemma's canvases) yield `OWN_STEP` and take None. A loop never runs a shared
forward itself, and nothing in a loop calls back into the engine or the server.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

from dllm.inference.scheduler import Kind
from dllm.sampling.results import Counters, GenerationResult


@dataclass(eq=False)
class Request:
    """One running or waiting decoding: its loop, the call it waits for, and how it ended."""

    id: int
    loop: Any
    """The decoding loop (CausalLoop, Loop, Denoiser, EditFlowLoop): its `decode()`, `counters`, rows."""
    kind: Kind
    steps: Generator[Any, Any, GenerationResult] = field(init=False)
    need: Any = None
    """The model call it waits for; None before it starts and once it has ended."""
    started: bool = False
    result: GenerationResult | None = None
    error: Exception | None = None
    """What its loop raised (it left; the others go on); None: none."""
    cancelled: bool = False
    """Set by whoever submitted it (a client that went away): dropped at the next step."""
    batch_rows: int = 0
    """Rows of the forwards it took part in, summed (their mean: `batch_rows / counters.nfe`)."""

    def __post_init__(self) -> None:
        self.steps = self.loop.decode()

    @property
    def done(self) -> bool:
        return self.started and self.need is None

    @property
    def counters(self) -> Counters:
        return self.loop.counters

    @property
    def rows(self) -> int:
        return int(self.loop.rows)

    def answer(self, value: Any) -> None:
        """Start the loop (first call) or send it its call's answer; it runs to its next call or ends."""
        try:
            self.need = self.steps.send(value) if self.started else next(self.steps)
        except StopIteration as end:
            self.need, self.result = None, end.value
        except Exception as e:  # this request's failure; the others go on
            self.need, self.error = None, e
        self.started = True

    def close(self) -> None:
        """Stop the loop where it is (cancelled)."""
        self.steps.close()
        self.need, self.started = None, True
