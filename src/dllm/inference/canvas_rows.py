"""One forward answering the uncached canvas calls of several requests (the engine's running canvas batch).

Each request is the canvas loop of a `generate` call of it alone (sampling/canvas_loop.py: `Loop`, with its
own canvas, sampler settings, policy, step budget, generator and stop function). A shared forward runs
each request's canvas rows up to the end of what its call reads (the whole canvas; a block model's canvas
up to the end of the active block), right-padded to the longest (padding is masked out of every key),
under the model's mask (bidirectional, or block-causal with padding as a document of its own). Which
requests share one (the same mask, and a length bucket) is the scheduler's (scheduler.py: `plan`).

What a request decodes is what its `generate` call alone decodes: its loop, policy and generator are the
same objects and see the same logits, up to the floating-point sums of a batch of another shape
(tests/unit/test_canvas_batch.py checks greedy and sampled requests against `generate`, in float64).

Shapes: R rows of the forward, n a request's rows, L the forward's length, Q a request's block, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.inference.request import Request


def key_end(req: Request) -> int:
    """The canvas length a request's uncached call reads (its forward's length before padding)."""
    lo, hi, _ = req.need
    canvas = req.loop.canvas
    return hi if canvas.block_attention else canvas.x_BT.shape[1]


def canvas_forward(model: nn.Module, reqs: list[Request], block: int | None, pad_id: int,
                   exclude: torch.Tensor) -> None:  # fmt: skip
    """One model call for the calls of `reqs` (block: the block-causal mask's block size; None: bidirectional);
    each request is sent the logits of its active block [n, Q, V] (`exclude`: ids never predicted)."""
    ends = [key_end(r) for r in reqs]
    tokens_RL, positions_RL, valid_RL = _inputs(reqs, ends, pad_id)
    if block is not None:
        mask = AttentionMask("block_causal", doc_ids_BL=valid_RL.long(), block_size=block)
    else:
        mask = AttentionMask("bidirectional", key_valid_BL=valid_RL)
    out = model(tokens_RL, positions_RL, mask)
    R, r = tokens_RL.shape[0], 0
    for req, ke in zip(reqs, ends, strict=True):
        c, n = req.counters, req.rows
        c.nfe, c.query_tokens = c.nfe + 1, c.query_tokens + n * ke
        req.batch_rows += R
        lo, hi, _ = req.need
        s = req.loop.runner.shift  # a shifted model's logits of position i come from row i - 1
        req.answer(out.token_logits(out.hidden_BLE[r : r + n, lo - s : hi - s], exclude))
        r += n


def _inputs(reqs: list[Request], ends: list[int], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Every request's canvas rows [0, key end), right-padded to the longest: tokens, positions, real keys."""
    device = reqs[0].loop.x.device
    R, L = sum(r.rows for r in reqs), max(ends)
    tokens = torch.full((R, L), pad_id, dtype=torch.long, device=device)
    positions = torch.zeros((R, L), dtype=torch.long, device=device)
    valid = torch.zeros((R, L), dtype=torch.bool, device=device)
    r = 0
    for req, ke in zip(reqs, ends, strict=True):
        n, canvas = req.rows, req.loop.canvas
        tokens[r : r + n, :ke] = req.loop.x[:, :ke]
        positions[r : r + n, :ke] = canvas.positions_BT[:, :ke]
        valid[r : r + n, :ke] = canvas.valid_BT[:, :ke]
        r += n
    return tokens, positions, valid
