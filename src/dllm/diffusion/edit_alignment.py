"""Optimal edit alignment of two token sequences (the auxiliary alignment of Edit Flows, Havasi et al. 2025).

An alignment writes x_0 and x_1 as two equally long sequences z_0, z_1 over the vocabulary plus a GAP
symbol, with never a gap in both at one column: a column (a, GAP) deletes a, (GAP, b) inserts b,
(a, b) with a != b substitutes, (a, a) keeps. The optimal alignment uses the fewest edits (the
Levenshtein distance, unit costs). Columns past a row's alignment length hold PAD.

The dynamic programme is vectorised over the batch, one row of the table at a time: within a row,
D[i, j] = min_k<=j (T[k] + j - k) with T[k] = min(D[i-1, k-1] + cost, D[i-1, k] + 1), which is a
cumulative minimum (no loop over j). The backtrace is one loop over at most N + M steps for all rows.
Ties break deterministically: keep/substitute before delete before insert (walking back from the end).

Shapes: B batch, N length of x_0 (padded), M length of x_1 (padded), A = N + M alignment columns.
"""

from __future__ import annotations

import torch

GAP = -1
"""Id of a gap in z_0 / z_1 (an insertion or a deletion)."""
PAD = -2
"""Id of an alignment column past a row's end."""


def edit_distance_table(x0_BN: torch.Tensor, x1_BM: torch.Tensor) -> torch.Tensor:
    """D [B, N+1, M+1]: D[b, i, j] is the edit distance of x0[b, :i] and x1[b, :j] (padding is
    harmless: entries only depend on prefixes)."""
    B, N = x0_BN.shape
    M = x1_BM.shape[1]
    j_M1 = torch.arange(M + 1, device=x0_BN.device)
    rows = [j_M1.expand(B, M + 1)]
    for i in range(1, N + 1):
        prev = rows[-1]
        cost_BM = (x0_BN[:, i - 1 : i] != x1_BM).long()
        t = torch.empty_like(prev)
        t[:, 0] = i  # D[i, 0]: delete i tokens
        t[:, 1:] = torch.minimum(prev[:, :-1] + cost_BM, prev[:, 1:] + 1)
        rows.append(torch.cummin(t - j_M1, dim=1).values + j_M1)  # insertions along the row
    return torch.stack(rows, dim=1)


def align(
    x0_BN: torch.Tensor, len0_B: torch.Tensor, x1_BM: torch.Tensor, len1_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An optimal alignment of each row's x_0[:len0] and x_1[:len1]: (z0 [B, A], z1 [B, A], length [B]).

    Token ids must be >= 0. Columns [0, length) hold the alignment (GAP marks a gap), the rest PAD.
    Removing the gaps from z0 / z1 gives back x_0 / x_1; the number of columns with z0 != z1 is the
    edit distance."""
    B, N = x0_BN.shape
    M = x1_BM.shape[1]
    D = edit_distance_table(x0_BN, x1_BM)
    rows_B = torch.arange(B, device=x0_BN.device)
    i, j = len0_B.clone().long(), len1_B.clone().long()
    z0_rev, z1_rev, live_rev = [], [], []
    for _ in range(N + M):
        live = (i > 0) | (j > 0)
        if not bool(live.any()):
            break
        here = D[rows_B, i, j]
        a = x0_BN[rows_B, (i - 1).clamp(0, max(N - 1, 0))] if N else torch.full_like(i, PAD)
        b = x1_BM[rows_B, (j - 1).clamp(0, max(M - 1, 0))] if M else torch.full_like(j, PAD)
        diag_ok = (i > 0) & (j > 0)
        diag = diag_ok & (D[rows_B, (i - 1).clamp_min(0), (j - 1).clamp_min(0)] + (a != b).long() == here)
        dele = ~diag & (i > 0) & (D[rows_B, (i - 1).clamp_min(0), j] + 1 == here)
        ins = live & ~diag & ~dele
        z0_rev.append(torch.where(diag | dele, a, GAP))
        z1_rev.append(torch.where(diag | ins, b, GAP))
        live_rev.append(live)
        i = i - (diag | dele).long()
        j = j - (diag | ins).long()
    return _left_align(z0_rev, z1_rev, live_rev, B, N + M, x0_BN.device)


def _left_align(z0_rev, z1_rev, live_rev, B: int, A: int, device) -> tuple[torch.Tensor, ...]:
    """The backtrace emits columns last-first; each row's columns are reversed into [0, length)."""
    length_B = torch.zeros(B, dtype=torch.long, device=device)
    z0 = torch.full((B, A), PAD, dtype=torch.long, device=device)
    z1 = torch.full((B, A), PAD, dtype=torch.long, device=device)
    if not live_rev:
        return z0, z1, length_B
    live_SB = torch.stack(live_rev)  # S backtrace steps; a row's live steps come first
    length_B = live_SB.sum(0)
    step_S1 = torch.arange(live_SB.shape[0], device=device)[:, None]
    col_SB = (length_B[None, :] - 1 - step_S1).clamp_min(0)
    rows_SB = torch.arange(B, device=device).expand_as(col_SB)
    sel = live_SB
    z0[rows_SB[sel], col_SB[sel]] = torch.stack(z0_rev)[sel]
    z1[rows_SB[sel], col_SB[sel]] = torch.stack(z1_rev)[sel]
    return z0, z1, length_B


def num_edits(z0_BA: torch.Tensor, z1_BA: torch.Tensor) -> torch.Tensor:
    """Edits per row [B]: aligned columns whose two sides differ (PAD columns agree)."""
    return (z0_BA != z1_BA).sum(-1)


def strip_gaps(z_A: torch.Tensor) -> torch.Tensor:
    """One aligned row without its gaps and padding: the sequence it spells."""
    return z_A[z_A >= 0]
