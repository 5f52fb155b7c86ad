"""What a linear-attention layer (models/linear_attention.py) keeps between the forwards of a cached decoding.

A Gated DeltaNet layer's memory after a position is its `State`: the last W - 1 inputs of its causal
convolution and the recurrent matrix S per value head. Two caches hold it:

- `RecurrentCache`: states by canvas index, for the exact block cache of block diffusion (the canvas
  loop of sampling/runner.py); one canvas, the same index for every row.
- `RowStates`: one state per row of a ragged causal decoding (sampling/causal.py: `RaggedKVCache`, whose
  rows sit at different lengths, as the K/V buffers of the attention layers next to it). A forward runs Q
  new tokens of every row from that row's state; the row then keeps n <= Q of them (`commit`): all of a
  prefill's prompt, one token of an AR round, the anchor and accepted drafts of a speculative round, none
  of a row that ended. When n is known before the forward (a prefill, an AR round: `owner.keep_B`), the
  tokens past n are no-ops (no decay, no write, as padding is: the state passes through them), so the
  forward's final state is already the state after n tokens. When it is known only after the forward
  (speculative verification), the forward keeps its start state and the per-token inputs of the rule
  (convolution inputs, keys, values, decays, write strengths: O(Q (C + H (K + V))) numbers per row) and
  `commit` re-runs the rule alone from the start state over the same Q tokens, those past n as no-ops:
  exact (the tokens before n are the same tokens, from the same state), and cheaper than keeping the
  state at every position of the round, which would be Q states [H, K, V] per row and layer (64 times
  the memory at K = V = 128) and O(Q^2 K V) per head to form, against O(Q^2 (K + V) + Q K V) for the
  re-run; neither the projections nor any other layer run again.

Shapes: R rows, B batch (= R), C convolution channels, W convolution taps, H value heads, K key width,
V value width, Q tokens of a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dllm.models import gated_delta

CHUNK = 64
"""Tokens per chunk of the gated delta rule (any value gives the same result up to rounding)."""


@dataclass(frozen=True)
class State:
    """A linear layer's memory after some position: the last W - 1 convolution inputs and the recurrence."""

    conv_BCW: torch.Tensor
    S_BHKV: torch.Tensor


class RecurrentCache:
    """A linear layer's states by canvas index, between the forwards of a cached decoding."""

    def __init__(self) -> None:
        self.states: dict[int, State] = {}

    def at(self, index: int) -> State | None:
        """The state before canvas index `index` (None at 0: zeros); a forward from elsewhere is refused."""
        if index == 0:
            return None
        if index not in self.states:
            raise ValueError(
                f"linear-attention layers kept no state at canvas index {index}: decode them without a cache "
                "or with the exact block cache (sampler.cache: block)"
            )
        return self.states[index]

    def keep(self, index: int, state: State) -> None:
        self.states[index] = state
        for old in [i for i in self.states if i < index - 1]:  # only the last clean rows are re-read
            del self.states[old]


@dataclass(frozen=True)
class Pending:
    """A forward's start state and the per-token inputs of its rule, until `RowStates.commit` says how
    many tokens each row keeps: convolution inputs [B, C, W - 1 + Q] (the start window first), keys
    [B, H, Q, K], values [B, H, Q, V], log decays and write strengths [B, H, Q]."""

    start: State
    x_BCL: torch.Tensor
    k_BHQK: torch.Tensor
    v_BHQV: torch.Tensor
    g_BHQ: torch.Tensor
    beta_BHQ: torch.Tensor

    def advance(self, n_B: torch.Tensor) -> State:
        """The state after the first n_B tokens: the rule alone, re-run from the start state with the tokens past
        n_B as no-ops (no decay, no write); the keys stand in for the queries, as only the state is read."""
        keep_B1Q = (torch.arange(self.g_BHQ.shape[-1], device=n_B.device) < n_B[:, None]).unsqueeze(1)
        g_BHQ, beta_BHQ = self.g_BHQ * keep_B1Q, self.beta_BHQ * keep_B1Q
        _, S = gated_delta.chunked(self.k_BHQK, self.k_BHQK, self.v_BHQV, g_BHQ, beta_BHQ, self.start.S_BHKV, CHUNK)
        return State(window_before(self.x_BCL, n_B, self.start.conv_BCW.shape[-1]), S)


class RowStates:
    """One linear layer's state per row of a ragged causal decoding (the module docstring). `owner` is the
    ragged cache (duck-typed: models never import sampling); its `keep_B` is the tokens each row keeps of
    the next forward when known before it, else None."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.state: State | None = None
        """After each row's kept tokens (None: no forward yet, zeros)."""
        self.pending: Pending | None = None

    @property
    def keep_B(self) -> torch.Tensor | None:
        return self.owner.keep_B

    def commit(self, n_B: torch.Tensor) -> None:
        """Each row keeps the first n_B[b] tokens of the last forward (nothing to do when the forward knew n_B)."""
        if self.pending is not None:
            self.state, self.pending = self.pending.advance(n_B), None

    # -- rows joining and leaving a running batch (inference/causal_rows.py), as the K/V buffers' rows do

    def rebuild(self, rows: Sequence[int]) -> None:
        """Rows `rows` of these states, in that order (-1: a new row, zeros)."""
        if self.state is None:
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.state.S_BHKV.device)
        kept = index >= 0
        new = State(*(t.new_zeros(len(rows), *t.shape[1:]) for t in (self.state.conv_BCW, self.state.S_BHKV)))
        new.conv_BCW[kept], new.S_BHKV[kept] = self.state.conv_BCW[index[kept]], self.state.S_BHKV[index[kept]]
        self.state = new

    def move(self, src: Sequence[int], dst: Sequence[int], num_rows: int) -> None:
        """Copy rows `src` to rows `dst`, then keep the first `num_rows` rows."""
        if self.state is None:
            return
        if len(src):
            s, d = (torch.tensor(r, dtype=torch.long, device=self.state.S_BHKV.device) for r in (src, dst))
            self.state.conv_BCW[d], self.state.S_BHKV[d] = self.state.conv_BCW[s], self.state.S_BHKV[s]
        self.state = State(self.state.conv_BCW[:num_rows], self.state.S_BHKV[:num_rows])

    def put(self, index_R: torch.Tensor, other: RowStates, num_rows: int) -> None:
        """Every row of `other` (a prefill's states) into rows `index_R` of these (`num_rows` rows when new)."""
        if other.state is None:
            return
        if self.state is None:
            conv, S = other.state.conv_BCW, other.state.S_BHKV
            self.state = State(conv.new_zeros(num_rows, *conv.shape[1:]), S.new_zeros(num_rows, *S.shape[1:]))
        self.state.conv_BCW[index_R], self.state.S_BHKV[index_R] = other.state.conv_BCW, other.state.S_BHKV


def window_before(x_BCL: torch.Tensor, n_B: torch.Tensor, width: int) -> torch.Tensor:
    """The `width` convolution inputs before row b's token n_B[b] of a forward, x_BCL[b, :, n_B[b] : + width]
    (x_BCL starts with the `width` inputs before the forward's first token)."""
    B, C, _ = x_BCL.shape
    index_BCW = (n_B[:, None] + torch.arange(width, device=n_B.device)).unsqueeze(1).expand(B, C, width)
    return x_BCL.gather(2, index_BCW)
