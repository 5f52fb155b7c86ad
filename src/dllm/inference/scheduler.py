"""The scheduler: which requests run, and which requests' rows share which forward, decided each step.

It is a pure function of the waiting queue and the running set, described as plain values (`Waiting`,
`Running`): no model, no tensors, no clock. The engine (engine.py) asks it twice a step:

1. `admit`: the cancelled requests to drop (waiting or running), and the waiting requests that start now,
   oldest first while their rows fit in `Limits.max_rows` (an empty engine takes any one request, however
   many rows it has, so nothing waits forever) and fewer than `Limits.max_requests` run. Admission stops at
   the first request that does not fit: a later, smaller one never overtakes it (no starvation).
2. `plan`: the step's forwards over the running requests' pending model calls. Every causal request
   (AR, and speculative with a drafter) shares one target forward over one ragged KV cache; uncached
   canvas requests share a forward per attention mask (a block model's block size, or bidirectional)
   and length bucket (a request's canvas longer than half of the bucket's longest: padding at most
   doubles a row's cost, as a CPU forward's cost grows with its padded length); block-cached canvas
   requests share a forward per block size; every other request (approximate prefix/dual caches,
   classifier-free guidance, Edit Flows, DiffusionGemma's canvases, linear-attention canvases) runs a
   forward of its own. Without `Limits.share_forwards` every request runs its own forward (offline
   `generate`: one request).

The back-pressure of a full queue (a 429) is the server's; cancellation is a flag the engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["causal", "canvas", "canvas_cached", "own"]
"""How a request's model calls run: `causal` rows in the shared target forward; `canvas` rows in a shared
uncached canvas forward; `canvas_cached` rows in a shared block-cache forward; `own`: a forward of its own."""


@dataclass(frozen=True)
class Limits:
    max_rows: int = 64
    """Rows (sequences) running at once; a request with more still runs alone."""
    max_requests: int | None = None
    """Requests running at once (1: one at a time, each to its end); None: as many as fit `max_rows`."""
    share_forwards: bool = True
    """Requests share forwards (the running batch); False: each runs its own."""


@dataclass(frozen=True)
class Waiting:
    """A request as the scheduler sees it while it waits."""

    id: int
    rows: int
    """Its rows (sequences): what it takes of `Limits.max_rows`."""
    cancelled: bool = False


@dataclass(frozen=True)
class Running(Waiting):
    """A running request and the model call it waits for."""

    kind: Kind = "own"
    mask: int | None = None
    """The attention mask its next call runs under: a block model's block size, None: bidirectional (canvas);
    the block size (canvas_cached)."""
    length: int = 0
    """The canvas length its next call reads (canvas: the forward's padded length)."""
    cancelled: bool = False


@dataclass(frozen=True)
class Admission:
    admit: tuple[int, ...]
    """Waiting requests that start now, in arrival order."""
    drop: tuple[int, ...]
    """Cancelled requests, waiting or running."""


@dataclass(frozen=True)
class Forward:
    kind: Kind
    ids: tuple[int, ...]
    """The requests whose rows run in it."""
    mask: int | None = None


def admit(waiting: list[Waiting], running: list[Running], limits: Limits) -> Admission:
    """Drop the cancelled; start waiting requests in arrival order while they fit."""
    drop = tuple(r.id for r in [*waiting, *running] if r.cancelled)
    live = [r for r in running if not r.cancelled]
    rows, count, admitted = sum(r.rows for r in live), len(live), []
    for w in waiting:
        if w.cancelled:
            continue
        full = limits.max_requests is not None and count >= limits.max_requests
        if full or (count > 0 and rows + w.rows > limits.max_rows):
            break
        admitted.append(w.id)
        rows, count = rows + w.rows, count + 1
    return Admission(tuple(admitted), drop)


def plan(running: list[Running], limits: Limits) -> list[Forward]:
    """The step's forwards over the running requests' next calls (cancelled ones excluded)."""
    live = [r for r in running if not r.cancelled]
    if not limits.share_forwards:
        return [Forward(r.kind, (r.id,), r.mask) for r in live]
    forwards: list[Forward] = []
    causal = tuple(r.id for r in live if r.kind == "causal")
    if causal:
        forwards.append(Forward("causal", causal))
    for mask, group in _by_mask(live, "canvas").items():
        forwards += [Forward("canvas", ids, mask) for ids in _length_buckets(group)]
    for mask, group in _by_mask(live, "canvas_cached").items():
        forwards.append(Forward("canvas_cached", tuple(r.id for r in group), mask))
    forwards += [Forward("own", (r.id,)) for r in live if r.kind == "own"]
    return forwards


def _by_mask(running: list[Running], kind: Kind) -> dict[int | None, list[Running]]:
    groups: dict[int | None, list[Running]] = {}
    for r in running:
        if r.kind == kind:
            groups.setdefault(r.mask, []).append(r)
    return groups


def _length_buckets(group: list[Running]) -> list[tuple[int, ...]]:
    """Longest first; a new bucket starts where a canvas is at most half of the bucket's longest."""
    buckets: list[list[int]] = []
    longest = 0
    for r in sorted(group, key=lambda r: r.length, reverse=True):
        if not buckets or r.length * 2 <= longest:
            buckets.append([])
            longest = r.length
        buckets[-1].append(r.id)
    return [tuple(b) for b in buckets]
