"""The block-cached canvas requests of the engine's running batch: their keys and values in one ragged cache.

A block model decoding with the exact block cache (sampling/cache.py: `BlockCache`) runs, at each step, only the
active block (plus, once, the previous block's clean rows) against the keys of everything before it,
which are final. Requests of one block size share those forwards here: every request's rows are rows of
one `RaggedKVCache` (sampling/causal.py) whose buffer index is the canvas index of the request's own canvas.

- Joining: the request's loop makes its first call alone, through its own runner and cache (the prompt and
  the first block, as a causal request's prefill), and the keys it wrote are copied into the rows of
  the shared buffers it takes; its runner's cache is then dropped.
- A step: each request's window (qs, qe, ke) comes from its own `BlockCache`; its queries x[qs:qe] are
  right-padded to the longest window Q of the step and run at buffer indices qs + [0, Q) under the
  block-causal mask with per-row query offsets, padding (of the canvas, and past its end) a document of
  its own. A padded query sits past its request's active block: the keys it writes are rewritten before
  any query reads them (a later block's, when that block is active) or are never read (past the canvas),
  and it sees at least its own key, so no row of the forward is empty.
- Leaving: the last rows move into the freed rows (`RaggedKVCache.move`), as the causal rows' do.

Shapes: R rows, Q the step's longest window, K kv heads, T buffer positions, D head dim, E hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.inference.request import Request
from dllm.sampling.causal import RaggedKVCache


class CachedRows:
    """The rows of the block-cached requests of one block size, in one ragged KV cache."""

    def __init__(self, model: nn.Module, block: int, pad_id: int, device: torch.device) -> None:
        self.model, self.block, self.pad_id, self.device = model, block, pad_id, device
        self.requests: list[Request] = []
        self.rows: dict[Request, list[int]] = {}
        self.kv = RaggedKVCache(0, torch.zeros(0, dtype=torch.long, device=device))

    @property
    def num_rows(self) -> int:
        return sum(len(r) for r in self.rows.values())

    def join(self, req: Request) -> None:
        """Run the request's first call alone (its runner's own cache), answer it, and copy the keys it wrote
        into new rows of the shared buffers."""
        loop = req.loop
        assert req.need is not None and loop.runner.cache is not None
        lo, hi, refresh = req.need
        logits = loop.runner.predict(loop.x, lo, hi, refresh)
        own = loop.runner.cache
        R, n, T = self.num_rows, req.rows, loop.canvas.x_BT.shape[1]
        capacity = max(self.kv.capacity, T + 2 * self.block + 1)  # room for a step's padded queries
        if self.kv.layers:
            self.kv.rebuild([*range(R), *([-1] * n)], capacity)
        self.kv.capacity = capacity
        rows = list(range(R, R + n))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for i, layer in own.layers.items():
            dst = self.kv.layer(i)
            for name in ("k_BKTD", "v_BKTD"):
                src = getattr(layer, name)
                if getattr(dst, name) is None:
                    dst.allocate(name, src, R + n, capacity)
                getattr(dst, name)[index, :, :hi] = src[:, :, :hi]
        loop.runner.cache = None  # its keys live here now
        self.requests.append(req)
        self.rows[req] = rows
        req.answer(logits)
        if req.done:  # the first block was its last (or its loop failed)
            self.leave(req)

    def leave(self, req: Request) -> None:
        """Free the request's rows: the last rows move into them and the buffers end after the rows left."""
        if req not in self.rows:
            return
        freed = self.rows.pop(req)
        self.requests.remove(req)
        R = self.num_rows
        holes = [r for r in freed if r < R]
        tail = sorted(r for rows in self.rows.values() for r in rows if r >= R)
        self.kv.move(tail, holes, R)
        moved = dict(zip(tail, holes, strict=True))
        for g, rows in self.rows.items():
            self.rows[g] = [moved.get(r, r) for r in rows]

    def step(self, exclude: torch.Tensor) -> None:
        """One forward of every request's next window; each is sent the logits of its active block [n, hi - lo, V]
        (`exclude`: ids never predicted), its counters counted; the requests that ended leave."""
        windows = []
        for g in self.requests:
            lo, hi, refresh = g.need  # type: ignore[misc]
            c = g.loop.canvas
            windows.append(g.loop.runner.mode.window(lo, hi, c.x_BT.shape[1], g.loop.runner.shift, refresh, True))
        R, Q = self.num_rows, max(qe - qs for qs, qe, _ in windows)
        key_end = max(qs for qs, _, _ in windows) + Q
        tokens = torch.full((R, Q), self.pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros((R, Q), dtype=torch.long, device=self.device)
        docs = torch.zeros((R, key_end), dtype=torch.long, device=self.device)
        offset = torch.zeros(R, dtype=torch.long, device=self.device)
        for g, (qs, qe, ke) in zip(self.requests, windows, strict=True):
            index = torch.tensor(self.rows[g], dtype=torch.long, device=self.device)
            c, T = g.loop.canvas, g.loop.canvas.x_BT.shape[1]
            tokens[index, : qe - qs] = g.loop.x[:, qs:qe]
            positions[index, : qe - qs] = c.positions_BT[:, qs:qe]
            docs[index, : min(T, key_end)] = c.valid_BT[:, :key_end].long()
            offset[index] = qs
            counters = g.counters
            counters.nfe += 1
            counters.query_tokens += g.rows * (qe - qs)
            counters.cached_tokens += g.rows * (ke - (qe - qs))
            g.batch_rows += R
        self.kv.write_BQ, self.kv.key_end, self.kv.write_start = offset[:, None] + torch.arange(Q), key_end, None
        mask = AttentionMask("block_causal", doc_ids_BL=docs, block_size=self.block, query_offset_B=offset)
        out = self.model(tokens, positions, mask, cache=self.kv)
        logits = []  # every request's, before any leaves (leaving moves rows)
        for g, (qs, _, _) in zip(self.requests, windows, strict=True):
            lo, hi, _ = g.need  # type: ignore[misc]
            s = g.loop.runner.shift
            logits.append(out.token_logits(out.hidden_BLE[self.rows[g], lo - s - qs : hi - s - qs], exclude))
        for g, logits_nQV in zip(list(self.requests), logits, strict=True):
            g.answer(logits_nQV)
            if g.done:
                self.leave(g)
