"""Which K/V rows each rank of a `prefix_canvas` shard plan receives, per layer kind (window-aware exchange).

DiffusionGemma trains one pass over [clean ; canvas] (2L rows) under the prefix_canvas mask
(attention/masks.py, canvas_start 0): clean row q attends clean keys kv <= q (and q - kv < w in a
sliding-window layer of window w); canvas row L + j stands at clean row j, in the canvas block that
starts at s = o + k B (o: its batch row's origin, the response start; k = (j - o) // B, so
s in [j - B + 1, j]); it attends the clean keys kv < s (and s - kv < w in a sliding layer) and the
canvas keys of its own block. The origin varies per batch row, so a static plan covers every origin:

    clean query q:            clean keys [q - w + 1, q]
    canvas query L + j:       clean keys [j - B - w + 2, j - 1]  (the union over s of [s - w + 1, s - 1])
                              canvas keys L + [j - B + 1, j + B - 1]  (every block that may hold j)

(a full layer: w = infinity). `needed_rows` is the union of these over a rank's query rows; a sliding
layer therefore needs, per run of held rows, about w + B rows before it, wherever the sequence is
long. A full layer needs what the all-gather of context.py moves ("as today"): every shared row of
the CP group (all 2L rows in cp mode; the clean rows in bp and csbp) plus, in bp and csbp, the canvas
rows next to its blocks (the canvas-key interval above: a block aligned to a batch row's origin may
straddle two ranks' canvas rows).

`exchange_routes` turns the needs of every rank of the group into one static exchange per layer kind:
rank p receives each needed row it does not hold from one holder, the holder inside p's CP group when
the row has one per CP group (csbp's clean rows), else its only holder (canvas rows, cp's rows). The
exchange runs as one all_to_all_single over the whole context group (context_attention.py
`exchange_rows`; its backward is the reverse all_to_all plus an index_add into the senders' K/V
gradients), so each rank sends exactly the rows its peers need, without padding.

Shapes: L sequence length (2L rows), B block (canvas) size, w window, G ranks of the context group,
N = 2L rows, R rows held.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.parallel.context import ShardPlan


@dataclass(frozen=True, eq=False)
class Routes:
    """One rank's static exchange for one layer kind (the window, None for a full layer)."""

    window: int | None
    send_idx: torch.Tensor
    """Positions in `plan.rows` of the rows sent, peer after peer in group-rank order (LongTensor; a row
    sent to two peers appears twice)."""
    send_counts: list[int]
    """Rows sent to each group rank (0 to itself)."""
    recv_rows: torch.Tensor
    """Global rows received, peer after peer in group-rank order, each peer's ascending (LongTensor)."""
    recv_counts: list[int]
    """Rows received from each group rank (0 from itself)."""


def needed_rows(plan: ShardPlan, window: int | None) -> torch.Tensor:
    """bool [2L]: rows whose K/V this rank's queries need in a layer with `window` (None: a full layer,
    which exchanges what the all-gather would, see the module doc). Held rows are included."""
    if plan.layout != "prefix_canvas":
        raise ValueError(f"window-aware routes are defined for the prefix_canvas layout, not {plan.layout!r}")
    assert plan.block_size is not None  # prefix_canvas always has canvas blocks
    L, B, N = plan.seq_len, plan.block_size, plan.num_rows
    q = plan.rows
    clean_q, canvas_j = q[q < L], q[q >= L] - L
    if window is None and plan.mode == "cp":
        return torch.ones(N, dtype=torch.bool)
    starts, ends = [q], [q + 1]  # the held rows themselves
    if window is None:  # every clean row (the clean half the all-gather covers; bp holds it already)
        starts.append(torch.zeros(1, dtype=torch.long))
        ends.append(torch.full((1,), L))
    else:
        starts += [clean_q - window + 1, canvas_j - B - window + 2]
        ends += [clean_q + 1, canvas_j]
    # canvas keys of every block a held canvas row may be in (the halo), clipped to the canvas half
    starts.append((L + canvas_j - B + 1).clamp_min(L))
    ends.append((L + canvas_j + B).clamp_max(N))
    return _cover(torch.cat(starts), torch.cat(ends), N)


def _cover(starts: torch.Tensor, ends: torch.Tensor, num_rows: int) -> torch.Tensor:
    """bool [N]: the union of the half-open intervals [starts, ends), clipped to [0, N)."""
    starts, ends = starts.clamp(0, num_rows), ends.clamp(0, num_rows)
    keep = starts < ends
    ones = torch.ones(int(keep.sum()), dtype=torch.long)
    step = torch.zeros(num_rows + 1, dtype=torch.long)
    step.index_add_(0, starts[keep], ones)
    step.index_add_(0, ends[keep], -ones)
    return step.cumsum(0)[:num_rows] > 0


def sources(plans: list[ShardPlan], window: int | None) -> torch.Tensor:
    """LongTensor [G, N]: the group rank that sends row x to rank p (entry [p, x]), -1 where p holds x or
    does not need it. A row held once per CP group comes from the holder in p's CP group."""
    G, N = len(plans), plans[0].num_rows
    held = torch.zeros(G, N, dtype=torch.bool)
    for r, plan in enumerate(plans):
        held[r, plan.rows] = True
    out = torch.full((G, N), -1, dtype=torch.long)
    for p, plan in enumerate(plans):
        need = needed_rows(plan, window) & ~held[p]
        for r in [r for r in range(G) if r not in plan.cp_group] + plan.cp_group:  # the CP group's last: it wins
            out[p, need & held[r]] = r
        missing = need & (out[p] < 0)
        assert not bool(missing.any()), f"rows {missing.nonzero().squeeze(1).tolist()} are held by no rank"
    return out


def exchange_routes(plan: ShardPlan, window: int | None) -> Routes:
    """This rank's sends and receives of one layer kind, from every group rank's needs (static per plan)."""
    plans = [plan.peer(r) for r in range(plan.group_size)]
    src = sources(plans, window)
    me = plan.rank
    send_idx, send_counts, recv_rows, recv_counts = [], [], [], []
    for p in range(plan.group_size):
        out_rows = torch.nonzero(src[p] == me).squeeze(1)  # ascending: what p receives from me
        send_idx.append(torch.searchsorted(plan.rows, out_rows))
        send_counts.append(out_rows.numel())
        in_rows = torch.nonzero(src[me] == p).squeeze(1)
        recv_rows.append(in_rows)
        recv_counts.append(in_rows.numel())
    return Routes(window, torch.cat(send_idx), send_counts, torch.cat(recv_rows), recv_counts)
