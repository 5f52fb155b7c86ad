"""Continuous batching of AR decoding: rows join a running batch between forwards and leave when done.

A server's requests arrive while others decode. `RunningBatch` keeps every running row of a causal
model in one ragged KV cache (causal.py), and each `step` is one target forward of one token per row.
A request that arrives is prefilled alone (its prompts in one forward, into a cache of its own that is
then copied into free rows of the batch's), and its rows decode from the next step on; a request whose
rows have all ended, or that is cancelled (`leave`), frees its rows for the next one.

Each request is a `Group` of rows (the choices of one prompt, or several prompts) with its own sampler
settings and generator, so its tokens are those of a `generate` call of it alone: greedy rows token for
token (up to the floating-point sums of a different batch), sampled rows from the same generator in the
same order: the prefill draws once over the group's rows and each step once more, rows that ended riding
along until the whole group has, as in the causal loop (speculative.py). tests/unit/test_continuous.py
checks both against `generate`.

Rows: buffer row s holds one row's tokens at positions [0, length). When a request leaves, the last
running rows move into its rows (a copy of those rows only) and the buffers end after the running rows,
so a forward runs running rows only (a request's rows that ended ride along until the whole request
has, as in the causal loop); with none running no row is left, but the buffers' memory stays. Room
for arriving requests is made in one copy (`reserve`), or none where the memory already has the rows
(RaggedKVCache.rebuild); the capacity in positions grows by half at least. So a server's buffers reach
their working size once and stay at it, rather than being allocated and freed with every wave of requests.

A hybrid model's linear-attention layers keep one state per buffer row next to the attention layers' K/V
rows (causal.py, models/linear_state.py): a prefill keeps each prompt's state, a step the state after each
running row's anchor, and the states move, join and leave with their rows.

Speculative decoding (a drafter's own per-row state) does not join a running batch: the server
interleaves those calls step by step instead (serving/engine.py). Diffusion canvases have a running
batch of their own (canvas_batch.py).

Shapes: R buffer rows, n a group's rows, P prompt length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import Target, right_pad
from dllm.sampling.results import Counters, GenerationResult, StepEvent
from dllm.sampling.speculative import choose


@dataclass(eq=False)
class Group:
    """One request's rows in a running batch: its prompts, sampler settings and generator, and what it decoded."""

    prompts: list[list[int]]
    cfg: SamplerConfig
    generator: torch.Generator | None
    stop: Callable[[list[int]], bool] | None
    eos_id: int
    pad_id: int
    mask_id: int
    callback: Callable[[StepEvent], None] | None = None
    """Sees the request's canvas after every step (`show`); None: nobody watches."""
    rows: list[int] = field(default_factory=list)
    """The buffer rows it holds (one per prompt, in order), while it runs."""
    tokens: list[list[int]] = field(default_factory=list)
    """Per row, the tokens decoded (an EOS included)."""
    ended: list[bool] = field(default_factory=list)
    counters: Counters = field(default_factory=lambda: Counters(loop="causal"))
    batch_rows: int = 0
    """Rows of the forwards it took part in, summed (their mean: `batch_rows / counters.steps`)."""
    error: Exception | None = None
    """What its decoding raised (as a canvas batch's requests); the causal batch fails as a whole instead."""

    @property
    def done(self) -> bool:
        return all(self.ended)

    def show(self, took: list[bool]) -> None:
        """The step callback, as the causal loop's: the request's canvas [n, P + N] (each row's prompt, its
        tokens, masks where nothing is decided yet, then padding) and the positions decided with this step."""
        if self.callback is None:
            return
        N, P = self.cfg.gen_length, max(len(p) for p in self.prompts)
        canvas, committed = [], []
        for prompt, tokens, new in zip(self.prompts, self.tokens, took, strict=True):
            made = tokens[:N]
            row = prompt + made + [self.mask_id] * (N - len(made))
            canvas.append(row + [self.pad_id] * (P + N - len(row)))
            committed.append([new and t == len(prompt) + len(made) - 1 for t in range(P + N)])
        event = StepEvent(torch.tensor(canvas), torch.tensor(committed), 0, self.counters.steps,
                          [len(p) for p in self.prompts], self.mask_id)  # fmt: skip
        self.callback(event)

    def take(self, chosen: list[int]) -> None:
        """This forward's token of every row that has not ended; which rows end with it (N tokens, an EOS,
        or the stop function on its tokens)."""
        if not self.tokens:
            self.tokens, self.ended = [[] for _ in chosen], [False] * len(chosen)
        else:  # the prefill's token is no round
            self.counters.rounds += self.ended.count(False)
        eos = self.eos_id if self.cfg.stop_at_eos else None
        for r, token in enumerate(chosen):
            if self.ended[r]:
                continue
            row = self.tokens[r]
            row.append(token)
            # a running row's tokens are its decided text (with stop_at_eos, an EOS has ended it)
            self.ended[r] = (
                len(row) >= self.cfg.gen_length or token == eos or (self.stop is not None and self.stop(row))
            )

    def sequences(self) -> list[list[int]]:
        """Each row's decided tokens (at most gen_length), cut before its first EOS."""
        out = []
        for tokens in self.tokens:
            row = tokens[: self.cfg.gen_length]
            if self.cfg.stop_at_eos and self.eos_id in row:
                row = row[: row.index(self.eos_id)]
            out.append(row)
        return out

    def result(self) -> GenerationResult:
        """As the causal loop returns it: the sequences, the canvas [n, P + N] (each row's prompt, its tokens,
        EOS on the positions of N it did not reach, then padding) and the group's counters."""
        N, P = self.cfg.gen_length, max(len(p) for p in self.prompts)
        sequences = self.sequences()
        canvas = []
        for prompt, tokens in zip(self.prompts, self.tokens, strict=True):
            made = tokens[:N]
            row = prompt + made + [self.eos_id] * (N - len(made))
            canvas.append(row + [self.pad_id] * (P + N - len(row)))
        c = self.counters
        c.tokens_committed = sum(min(len(s) + 1, len(t[:N])) for s, t in zip(sequences, self.tokens, strict=True))
        return GenerationResult(sequences, torch.tensor(canvas, dtype=torch.long), c, [len(p) for p in self.prompts])


class RunningBatch:
    """The running rows of a causal model: `join` a request, `step` them all one token, `leave` a request."""

    def __init__(self, model: nn.Module, special: SpecialIds, max_rows: int) -> None:
        self.model, self.special, self.max_rows = model, special, max_rows
        self.device = next(model.parameters()).device
        self.counters = Counters(loop="causal")
        """Every forward of the batch (the prefills are counted in their groups')."""
        self.groups: list[Group] = []
        self.target = Target(self.model, 0, 0, self.counters, (), self.special.mask_id)
        self.owner: list[Group | None] = []
        """Per buffer row, the group holding it."""
        self.anchor_R = torch.zeros(0, dtype=torch.long, device=self.device)
        """Per buffer row, the token it runs next (decided, not yet in the cache)."""

    def _release(self) -> None:
        """No row runs: no buffer row either. The buffers' memory stays, for the next requests to join
        into without allocating (a server's working set: its size is reached once, not at every wave)."""
        self.target.cache.move([], [], 0)
        self.target.length_B = self.target.length_B[:0]
        self.owner = []
        self.anchor_R = self.anchor_R[:0]

    @property
    def rows(self) -> int:
        """Rows held by running requests."""
        return sum(len(g.rows) for g in self.groups)

    def fits(self, num_rows: int) -> bool:
        """Whether a request of `num_rows` rows may join now (an empty batch takes any)."""
        return not self.groups or self.rows + num_rows <= self.max_rows

    @torch.inference_mode()
    def join(self, prompts: Sequence[Sequence[int]], cfg: SamplerConfig, generator: torch.Generator | None = None,
             stop: Callable[[list[int]], bool] | None = None,
             callback: Callable[[StepEvent], None] | None = None) -> Group:  # fmt: skip
        """Prefill `prompts` alone and choose their first tokens; the rows run from the next `step` (none
        when every row ended with its first token: the group is then done already). `callback` sees the
        request's canvas after each step (`Group.show`)."""
        group = Group([list(p) for p in prompts], cfg, generator, stop, self.special.eos_id, self.special.pad_id,
                      self.special.mask_id, callback)  # fmt: skip
        tokens_nP, len_n = right_pad(group.prompts, self.device)
        n, P = tokens_nP.shape
        prefill = Target(self.model, n, P, group.counters, (), self.special.mask_id)
        logits_n1V, _ = prefill.forward(tokens_nP, (len_n - 1)[:, None], keep_B=len_n)  # linear layers: the prompts
        first_n = choose(cfg, logits_n1V[:, 0], generator)
        group.take(first_n.tolist())
        group.batch_rows += n
        if group.done:
            return group
        self.reserve(n, max(len_n.tolist()) + cfg.gen_length)
        rows = [r for r, g in enumerate(self.owner) if g is None][:n]
        self.target.cache.put(rows, prefill.cache, P, len(self.owner))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.target.length_B[index] = len_n
        self.anchor_R[index] = first_n
        for r in rows:
            self.owner[r] = group
        group.rows = rows
        self.groups.append(group)
        return group

    @torch.inference_mode()
    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for `num_rows` more rows of up to `length` tokens (prompt + new) in one copy of the
        buffers: a caller that admits several requests at once reserves for all of them first. The
        capacity grows by half at least, so that rows of growing lengths do not copy at every join."""
        free = self.owner.count(None)
        capacity = self.target.cache.capacity
        if length + 1 > capacity:
            capacity = max(length + 1, capacity + capacity // 2)
        if num_rows > free or capacity > self.target.cache.capacity:
            self._rebuild(list(range(len(self.owner))) + [-1] * max(num_rows - free, 0), capacity)

    @torch.inference_mode()
    def step(self) -> list[Group]:
        """One forward of every running row; each row keeps the token its request's settings choose. The
        requests that ended with it, which leave the batch."""
        if not self.groups:
            return []
        keep = [0] * len(self.owner)  # the anchors of running rows are kept (an ended row's stays where it was)
        for g in self.groups:
            for r, ended in zip(g.rows, g.ended, strict=True):
                keep[r] = 0 if ended else 1
        keep_R = torch.tensor(keep, device=self.device)
        logits_R1V, _ = self.target.forward(self.anchor_R[:, None], keep_B=keep_R)
        logits_RV = logits_R1V[:, 0]
        greedy = logits_RV.argmax(-1)
        greedy_rows = greedy.tolist()  # the step's host sync
        next_R = greedy.clone()
        cached, live_rows, finished = self.target.cache.key_end - 1, self.rows, []
        for g in self.groups:
            if g.cfg.temperature == 0:
                chosen = [greedy_rows[r] for r in g.rows]
            else:  # one draw over the group's rows from its own generator, as its causal loop alone draws
                index = torch.tensor(g.rows, dtype=torch.long, device=self.device)
                drawn = choose(g.cfg, logits_RV[index], g.generator)
                next_R[index] = drawn
                chosen = drawn.tolist()
            c = g.counters
            c.nfe, c.steps = c.nfe + 1, c.steps + 1
            c.query_tokens, c.cached_tokens = c.query_tokens + len(g.rows), c.cached_tokens + len(g.rows) * cached
            g.batch_rows += live_rows
            took = [not e for e in g.ended]
            g.take(chosen)
            g.show(took)
            if g.done:
                finished.append(g)
        self.target.commit(keep_R)  # the anchors ran: cached now
        self.anchor_R = next_R
        for g in finished:
            self.leave(g)
        return finished

    @torch.inference_mode()
    def leave(self, group: Group) -> None:
        """The group's rows stop (it ended, or its client went away) and are free for others."""
        if group not in self.groups:
            return
        self.groups.remove(group)
        for r in group.rows:
            self.owner[r] = None
        if not self.groups:
            self._release()
            return
        # the last running rows move into the freed ones (a copy of those rows only), and the buffers end
        # after the running rows: a forward never runs a free row
        running = len(self.owner) - self.owner.count(None)
        holes = [r for r in range(running) if self.owner[r] is None]
        tail = [r for r in range(running, len(self.owner)) if self.owner[r] is not None]
        self.target.cache.move(tail, holes, running)
        moved = dict(zip(tail, holes, strict=True))
        src = torch.tensor(tail, dtype=torch.long, device=self.device)
        dst = torch.tensor(holes, dtype=torch.long, device=self.device)
        length_R, anchor_R = self.target.length_B.clone(), self.anchor_R.clone()
        length_R[dst], anchor_R[dst] = self.target.length_B[src], self.anchor_R[src]
        self.target.length_B, self.anchor_R = length_R[:running], anchor_R[:running]
        for old, new in moved.items():
            self.owner[new] = self.owner[old]
        del self.owner[running:]
        for g in self.groups:
            g.rows = [moved.get(r, r) for r in g.rows]

    def _rebuild(self, rows: list[int], capacity: int) -> None:
        """Keep buffer rows `rows` (in that order; -1: a new free row) in buffers of `capacity` positions."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        kept = index >= 0
        length_R = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        anchor_R = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        length_R[kept] = self.target.length_B[index[kept]]
        anchor_R[kept] = self.anchor_R[index[kept]]
        self.target.cache.rebuild(rows, capacity)
        self.target.length_B, self.target.capacity, self.anchor_R = length_R, capacity, anchor_R
        self.owner = [self.owner[r] if r >= 0 else None for r in rows]
        moved = {old: new for new, old in enumerate(rows) if old >= 0}
        for g in self.groups:
            g.rows = [moved[r] for r in g.rows]
