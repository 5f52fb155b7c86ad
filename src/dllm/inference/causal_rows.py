"""The rows of every running causal request in one ragged KV cache: a step is one target forward of them all.

A causal request (AR decoding, or speculative decoding with a drafter: sampling/causal_loop.py) is
prefilled alone: its prompts in one forward into a cache of their own, whose keys are then copied into
free rows of the shared buffers (`RaggedKVCache.put`); an empty batch's first request is prefilled in the
buffers themselves. From then on each step runs every running row in one forward: a request's rows run
the Q tokens its call holds (1 for AR, the anchor and the drafts for speculative decoding), right-padded
to the step's longest Q. A padded token sits past its row's kept tokens: the keys it writes are never
read and are overwritten by the row's next forward (as a rejected draft's are). The head runs on the
rows a request reads only, in one matmul. After the answers, every row keeps what its loop kept
(`CausalLoop.kept_B`), and the requests that ended leave.

Rows: buffer row s holds one row's tokens at positions [0, length). When a request leaves, the last
running rows move into its rows (a copy of those rows only) and the buffers end after the running rows;
with none running no row is left, but the buffers' memory stays. Room for arriving requests is made in
one copy (`reserve`), or none where the memory already has the rows (RaggedKVCache.rebuild); the
capacity in positions grows by half at least, so a server's buffers reach their working size once.

A hybrid model's linear-attention layers keep one state per buffer row next to the attention layers' K/V
rows (sampling/causal.py, models/linear_state.py); they move, join and leave with their rows. A step
whose every call knows what its rows keep (AR rounds) keeps the states at once; one with a verification
keeps them at the commit.

Shapes: R buffer rows, n a request's rows, Q the step's longest call, M logit rows, V vocabulary, F features.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import nn

from dllm.inference.request import Request
from dllm.sampling.causal import Recompute, Target
from dllm.sampling.causal_loop import CausalCall
from dllm.sampling.results import Counters


class CausalRows:
    """The running causal requests' rows: `join` (prefill), `step` (one forward of every row), `leave`."""

    def __init__(self, model: nn.Module, mask_id: int, recompute: bool = False) -> None:
        self.model, self.mask_id, self.recompute = model, mask_id, recompute
        self.device = next(model.parameters()).device
        self.counters = Counters(loop="causal")
        """Every forward of the rows (totals over the requests)."""
        self.target: Target | None = None
        self.owner: list[Request | None] = []
        """Per buffer row, the request holding it."""
        self.rows: dict[Request, list[int]] = {}
        self._capturing: AbstractContextManager | None = None
        """The target's feature hooks while running requests read target blocks (`capture`)."""

    @property
    def requests(self) -> list[Request]:
        return list(self.rows)

    def join(self, req: Request) -> None:
        """Run the request's prefill (alone) and give its rows buffer rows, unless every row ended with its
        first token (it is done then)."""
        call: CausalCall = req.need
        assert call.prefill, "a causal request joins with its prefill"
        n = call.tokens_BQ.shape[0]
        if self.target is None:  # the first request: prefilled in the buffers themselves
            kind = Recompute if self.recompute else Target
            self.target = kind(self.model, n, req.loop.capacity, self.counters, (), self.mask_id)
            self.capture(call.layer_ids)
            self._answer(req, self.target, call)
            self.target.commit(req.loop.kept_B)
            self.owner, rows = [req] * n, list(range(n))
        else:
            assert not self.recompute, "the no-cache reference decodes one request"
            P = call.tokens_BQ.shape[1]
            prefill = Target(self.model, n, P, self.counters, call.layer_ids, self.mask_id)
            self._answer(req, prefill, call)
            if req.done:
                return
            prefill.commit(req.loop.kept_B)
            self.reserve(n, req.loop.capacity)
            rows = [r for r, owner in enumerate(self.owner) if owner is None][:n]
            self.target.cache.put(rows, prefill.cache, P, len(self.owner))
            self.target.length_B[torch.tensor(rows, device=self.device)] = prefill.length_B
            for r in rows:
                self.owner[r] = req
        self.rows[req] = rows
        if req.done:
            self.leave(req)

    def _answer(self, req: Request, target: Target, call: CausalCall) -> None:
        before = (self.counters.query_tokens, self.counters.cached_tokens)
        answer = target.forward(call.tokens_BQ, call.logit_rows_BR, call.keep_B)
        c = req.counters
        c.nfe, c.query_tokens = c.nfe + 1, c.query_tokens + self.counters.query_tokens - before[0]
        c.cached_tokens += self.counters.cached_tokens - before[1]
        req.batch_rows += call.tokens_BQ.shape[0]
        req.answer(answer)

    def reserve(self, num_rows: int, length: int) -> None:
        """Make room for `num_rows` more rows of up to `length` positions in one copy of the buffers: a caller
        that admits several requests at once reserves for all of them first. The capacity grows by half at
        least, so that rows of growing lengths do not copy at every join."""
        assert self.target is not None
        free = self.owner.count(None)
        capacity = self.target.cache.capacity
        if length > capacity:
            capacity = max(length, capacity + capacity // 2)
        if num_rows > free or capacity > self.target.cache.capacity:
            self._rebuild(list(range(len(self.owner))) + [-1] * max(num_rows - free, 0), capacity)

    def step(self, reqs: list[Request]) -> None:
        """One forward of every running row (`reqs`: the running requests, each waiting with a CausalCall): each
        request is sent its rows' logits and features, then every row keeps what its loop kept."""
        assert self.target is not None and set(reqs) == set(self.rows), "a step runs every causal request's rows"
        calls: list[CausalCall] = [r.need for r in reqs]
        tokens_RQ, wanted_RQ, keep_R = self._gather(reqs, calls)
        R, Q = tokens_RQ.shape
        layer_ids = tuple(dict.fromkeys(i for c in calls for i in c.layer_ids))
        self.capture(layer_ids)  # the blocks this step's loops read (their drafters')
        key_end = int(self.target.length_B.max()) + Q
        if key_end > self.target.cache.capacity:  # a short row padded to a long row's call: room for its queries
            self.reserve(0, key_end)
        before = (self.counters.query_tokens, self.counters.cached_tokens)
        logits_MV, features_RQF = self.target.forward(tokens_RQ, wanted_RQ, keep_R)
        # each request's share of the forward's query and cached positions (rows x positions, padding included)
        query, cached = self.counters.query_tokens - before[0], self.counters.cached_tokens - before[1]
        at_RQ = wanted_RQ.flatten().cumsum(0).view(R, Q) - 1  # each wanted row's index into the M logit rows
        kept_R = torch.zeros(R, dtype=torch.long, device=self.device)
        for req, call in zip(reqs, calls, strict=True):
            index, (n, q) = self._index(req), call.tokens_BQ.shape
            at_nR = at_RQ[index, :q] if call.logit_rows_BR is None else at_RQ[index[:, None], call.logit_rows_BR]
            features = None if features_RQF is None else _layers(features_RQF[index, :q], layer_ids, call.layer_ids)
            c = req.counters
            c.nfe, c.query_tokens, c.cached_tokens = (
                c.nfe + 1,
                c.query_tokens + query * n // R,
                c.cached_tokens + cached * n // R,
            )
            req.batch_rows += R
            req.answer((logits_MV[at_nR], features))
            if req.error is None:
                kept_R[index] = req.loop.kept_B
        self.target.commit(kept_R)
        for req in reqs:
            if req.done:
                self.leave(req)

    def _gather(
        self, reqs: list[Request], calls: list[CausalCall]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's tokens [R, Q] (each request's rows right-padded to the longest call), the rows whose logits
        are read, and what each row keeps when every call knows it before the forward (else None)."""
        R, Q = len(self.owner), max(c.tokens_BQ.shape[1] for c in calls)
        tokens_RQ = torch.zeros(R, Q, dtype=torch.long, device=self.device)
        wanted_RQ = torch.zeros(R, Q, dtype=torch.bool, device=self.device)
        keep_R = torch.zeros(R, dtype=torch.long, device=self.device)
        for req, call in zip(reqs, calls, strict=True):
            index, q = self._index(req), call.tokens_BQ.shape[1]
            tokens_RQ[index, :q] = call.tokens_BQ
            if call.logit_rows_BR is None:
                wanted_RQ[index, :q] = True
            else:
                wanted_RQ[index[:, None], call.logit_rows_BR] = True
            if call.keep_B is not None:
                keep_R[index] = call.keep_B
        known = all(c.keep_B is not None for c in calls)
        return tokens_RQ, wanted_RQ, keep_R if known else None

    def capture(self, layer_ids: tuple[int, ...]) -> None:
        """Keep the hooks capturing `layer_ids` registered while the running requests read those blocks, rather
        than registering them in every forward (none: no hooks)."""
        assert self.target is not None
        if layer_ids == self.target.layer_ids:
            return
        if self._capturing is not None:
            self._capturing.__exit__(None, None, None)
            self._capturing = None
        self.target.layer_ids = layer_ids
        if layer_ids:
            self._capturing = self.target.capturing()
            self._capturing.__enter__()

    def _index(self, req: Request) -> torch.Tensor:
        return torch.tensor(self.rows[req], dtype=torch.long, device=self.device)

    def leave(self, req: Request) -> None:
        """The request's rows stop (it ended, or its client went away) and are free for others."""
        if req not in self.rows:
            return
        assert self.target is not None
        for r in self.rows.pop(req):
            self.owner[r] = None
        if not self.rows:  # no row runs: no buffer row either; the memory stays for the next requests
            self.capture(())
            self.target.cache.move([], [], 0)
            self.target.length_B = self.target.length_B[:0]
            self.owner = []
            return
        # the last running rows move into the freed ones (a copy of those rows only), and the buffers end
        # after the running rows: a forward never runs a free row
        running = len(self.owner) - self.owner.count(None)
        holes = [r for r in range(running) if self.owner[r] is None]
        tail = [r for r in range(running, len(self.owner)) if self.owner[r] is not None]
        self.target.cache.move(tail, holes, running)
        length_R = self.target.length_B.clone()
        length_R[torch.tensor(holes, dtype=torch.long)] = self.target.length_B[torch.tensor(tail, dtype=torch.long)]
        self.target.length_B = length_R[:running]
        moved = dict(zip(tail, holes, strict=True))
        for old, new in moved.items():
            self.owner[new] = self.owner[old]
        del self.owner[running:]
        for other in self.rows:
            self.rows[other] = [moved.get(r, r) for r in self.rows[other]]

    def _rebuild(self, rows: list[int], capacity: int) -> None:
        """Keep buffer rows `rows` (in that order; -1: a new free row) in buffers of `capacity` positions."""
        assert self.target is not None
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        kept = index >= 0
        length_R = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        length_R[kept] = self.target.length_B[index[kept]]
        self.target.cache.rebuild(rows, capacity)
        self.target.length_B, self.target.capacity = length_R, capacity
        self.owner = [self.owner[r] if r >= 0 else None for r in rows]
        moved = {old: new for new, old in enumerate(rows) if old >= 0}
        for req in self.rows:
            self.rows[req] = [moved[r] for r in self.rows[req]]


def _layers(features_nQF: torch.Tensor, captured: tuple[int, ...], wanted: tuple[int, ...]) -> torch.Tensor | None:
    """The features of the blocks `wanted` (in that order) from those of `captured` (concatenated in its order)."""
    if not wanted:
        return None
    if wanted == captured:
        return features_nQF
    E = features_nQF.shape[-1] // len(captured)
    return torch.cat([features_nQF[..., captured.index(i) * E : (captured.index(i) + 1) * E] for i in wanted], -1)
