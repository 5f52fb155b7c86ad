"""The gated delta rule (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks"), in pure torch.

It is the token mixer of the linear-attention layers of hybrid models (Qwen3.5). Each head keeps a
state matrix S [K, V]; token t with decay g_t <= 0 (log space) and write strength beta_t in (0, 1)
updates it and reads it:

    S'_t = exp(g_t) S_{t-1}                           (forget)
    S_t  = S'_t + k_t (beta_t (v_t - S'_t^T k_t))^T   (delta rule: write the error of what S'_t predicts)
    o_t  = S_t^T q_t

`recurrent` runs this token by token (the reference). `chunked` gives the same result with matmuls:
inside a chunk of C tokens the writes u_t = beta_t (v_t - S'_t^T k_t) depend on each other through a
unit lower-triangular system (the WY / UT form of the Householder-like products, Yang et al. 2024,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length", section 3), solved once
per chunk; only the state crosses chunks. With G_t the decay summed from the chunk start to t,
S_0 the state before the chunk and P_ts = exp(G_t - G_s) (s <= t):

    (I + strict_lower(beta k k^T * P)) U = beta V - (beta exp(G) K) S_0
    O   = exp(G) Q S_0 + lower(Q K^T * P) U
    S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T U

Documents: `start_BL` marks tokens that start a new segment (a document): the state is zeroed before
such a token, as if its decay were -inf. The chunked form does not put -inf into the summed decays (their
differences would lose all precision); it masks instead: P_ts is 0 across a segment start, a token reads
the state before its chunk only while it is in that state's segment, and the state after a chunk keeps
only the writes of the chunk's last segment.

`block_reads` is block diffusion's noisy read: each block starts from a given state, writes all its
tokens, and every token of the block reads the state after the block.

`chunked` is the reference of the linear layers' rule (`model.linear_attention_kernel: torch`, `torch_rule`);
flash-linear-attention's Triton kernel is the optional GPU path (`fla`, models/fla_rule.py), tested
against `chunked` on a GPU only (tests/gpu/test_fla.py); elsewhere these functions run as torch matmuls.

Queries and keys come in as the caller wants them read (normalised and scaled there). Both functions
take an initial state (None: zeros) and return the final one; they compute in float32 at least
(float64 inputs stay float64) and return outputs in the inputs' dtype, the state in the compute dtype.

Shapes: B batch, H heads, L sequence, K key width, V value width, N chunks, C chunk length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _zero_state(k_BHLK: torch.Tensor, v_BHLV: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    B, H, _, K = k_BHLK.shape
    return torch.zeros(B, H, K, v_BHLV.shape[-1], dtype=dtype, device=k_BHLK.device)


def recurrent(
    q_BHLK: torch.Tensor,
    k_BHLK: torch.Tensor,
    v_BHLV: torch.Tensor,
    g_BHL: torch.Tensor,
    beta_BHL: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    start_BL: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token: outputs [B, H, L, V] and the state after the last token [B, H, K, V]."""
    dtype = _compute_dtype(q_BHLK)
    q, k, v, g, beta = (t.to(dtype) for t in (q_BHLK, k_BHLK, v_BHLV, g_BHL, beta_BHL))
    S = _zero_state(k, v, dtype) if state_BHKV is None else state_BHKV.to(dtype)
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        if start_BL is not None:
            S = S * (~start_BL[:, t, None, None, None]).to(dtype)
        k_t = k[:, :, t]
        error_BHV = v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k_t)
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, error_BHV * beta[:, :, t, None])
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.to(q_BHLK.dtype), S


def chunked(
    q_BHLK: torch.Tensor,
    k_BHLK: torch.Tensor,
    v_BHLV: torch.Tensor,
    g_BHL: torch.Tensor,
    beta_BHL: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    chunk: int = 64,
    start_BL: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule chunk by chunk (the same result as `recurrent` up to rounding): outputs [B, H, L, V]
    and the final state [B, H, K, V]."""
    out, S, _ = chunked_states(q_BHLK, k_BHLK, v_BHLV, g_BHL, beta_BHL, state_BHKV, chunk, start_BL)
    return out, S


def chunked_states(
    q_BHLK: torch.Tensor,
    k_BHLK: torch.Tensor,
    v_BHLV: torch.Tensor,
    g_BHL: torch.Tensor,
    beta_BHL: torch.Tensor,
    state_BHKV: torch.Tensor | None = None,
    chunk: int = 64,
    start_BL: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked`, and also the state before each chunk [B, H, N, K, V] (block diffusion reads the clean
    state at each block start). The sequence is padded to whole chunks with tokens that neither decay nor
    write (g = 0, beta = 0, k = 0), so the state after the padding is the state after L."""
    dtype = _compute_dtype(q_BHLK)
    L, C = q_BHLK.shape[2], chunk
    pad = -L % C
    q, k, v = (F.pad(t.to(dtype), (0, 0, 0, pad)) for t in (q_BHLK, k_BHLK, v_BHLV))
    g, beta = (F.pad(t.to(dtype), (0, pad)) for t in (g_BHL, beta_BHL))
    B, H, _, K = q.shape
    q_BHNCK, k_BHNCK = q.view(B, H, -1, C, K), k.view(B, H, -1, C, K)
    v_BHNCV = v.view(B, H, -1, C, v.shape[-1])
    G_BHNC = g.view(B, H, -1, C).cumsum(-1)
    seg = _segments(start_BL, pad, C, dtype)
    U_BHNCV, W_BHNCK, P_BHNCC = _chunk_writes(k_BHNCK, v_BHNCV, G_BHNC, beta.view(B, H, -1, C), seg)
    scores_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * P_BHNCC
    q_decayed = q_BHNCK * (G_BHNC.exp() * seg.carry).unsqueeze(-1)
    k_to_end = k_BHNCK * ((G_BHNC[..., -1:] - G_BHNC).exp() * seg.tail).unsqueeze(-1)
    S = _zero_state(k, v, dtype) if state_BHKV is None else state_BHKV.to(dtype)
    decay_BHN = G_BHNC[..., -1].exp() * seg.carry_end  # the state before a chunk, at its end
    outs, starts = [], []
    for n in range(q_BHNCK.shape[2]):
        starts.append(S)
        U = U_BHNCV[:, :, n] - W_BHNCK[:, :, n] @ S  # the writes, given the state before the chunk
        outs.append(q_decayed[:, :, n] @ S + scores_BHNCC[:, :, n] @ U)
        S = S * decay_BHN[:, :, n, None, None] + k_to_end[:, :, n].transpose(-1, -2) @ U
    out = torch.cat(outs, dim=2)[:, :, :L] if outs else v[:, :, :L]
    starts_BHNKV = torch.stack(starts, dim=2) if starts else S.unsqueeze(2)[:, :, :0]
    return out.to(q_BHLK.dtype), S, starts_BHNKV


def torch_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The `torch` entry of DELTA_RULES (config/registries.py): `chunked` itself."""
    return chunked


def block_reads(
    q_BHLK: torch.Tensor,
    k_BHLK: torch.Tensor,
    v_BHLV: torch.Tensor,
    g_BHL: torch.Tensor,
    beta_BHL: torch.Tensor,
    starts_BHNKV: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Every block of `block` tokens at once, each from its own start state (starts_BHNKV[:, :, n]): the
    block's tokens are written, and each of them reads the state after the whole block, S_end^T q_t
    (bidirectional inside the block: token t reads the writes of the tokens after it too). Outputs
    [B, H, L, V]; L is whole blocks."""
    dtype = _compute_dtype(q_BHLK)
    B, H, L, K = q_BHLK.shape
    q, k, v, g, beta = (t.to(dtype) for t in (q_BHLK, k_BHLK, v_BHLV, g_BHL, beta_BHL))
    k_BHNCK, v_BHNCV = k.view(B, H, -1, block, K), v.view(B, H, -1, block, v.shape[-1])
    G_BHNC = g.view(B, H, -1, block).cumsum(-1)
    U0, W, _ = _chunk_writes(k_BHNCK, v_BHNCV, G_BHNC, beta.view(B, H, -1, block))
    S0 = starts_BHNKV.to(dtype)
    U_BHNCV = U0 - W @ S0
    k_to_end = k_BHNCK * (G_BHNC[..., -1:] - G_BHNC).exp().unsqueeze(-1)
    end_BHNKV = S0 * G_BHNC[..., -1, None, None].exp() + k_to_end.transpose(-1, -2) @ U_BHNCV
    out_BHNCV = q.view(B, H, -1, block, K) @ end_BHNKV
    return out_BHNCV.reshape(B, H, L, -1).to(q_BHLK.dtype)


@dataclass(frozen=True)
class _Segments:
    """0/1 factors per chunk position from the segment starts (all 1 without documents): `same` [.., C, C]
    t and s in one segment; `carry` [.., C] t still in the segment of the state before the chunk; `tail`
    [.., C] s in the segment of the chunk's last token."""

    same: torch.Tensor | float = 1.0
    carry: torch.Tensor | float = 1.0
    tail: torch.Tensor | float = 1.0

    @property
    def carry_end(self) -> torch.Tensor | float:
        """Whether the chunk's last token is still in the entering state's segment [.., N]."""
        return self.carry[..., -1] if isinstance(self.carry, torch.Tensor) else self.carry


def _segments(start_BL: torch.Tensor | None, pad: int, C: int, dtype: torch.dtype) -> _Segments:
    if start_BL is None:
        return _Segments()
    seg_BL = start_BL.long().cumsum(-1)
    seg_BL = torch.cat([seg_BL, seg_BL[:, -1:].expand(-1, pad)], dim=1)  # padding joins the last segment
    seg_B1NC = seg_BL.view(seg_BL.shape[0], 1, -1, C)
    before_B1N = F.pad(seg_B1NC[..., :-1, -1], (1, 0))  # the segment of the state entering each chunk
    return _Segments(
        (seg_B1NC.unsqueeze(-1) == seg_B1NC.unsqueeze(-2)).to(dtype),
        (seg_B1NC == before_B1N.unsqueeze(-1)).to(dtype),
        (seg_B1NC == seg_B1NC[..., -1:]).to(dtype),
    )


def _chunk_writes(
    k_BHNCK: torch.Tensor,
    v_BHNCV: torch.Tensor,
    G_BHNC: torch.Tensor,
    beta_BHNC: torch.Tensor,
    seg: _Segments | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per chunk, the writes split as U = U0 - W S_0 (U0 [.., C, V], W [.., C, K]: the solutions of the
    unit lower-triangular system for beta V and for beta exp(G) K), and the decays P [.., C, C] between
    positions (P_ts = exp(G_t - G_s) for s <= t in one segment, 0 above the diagonal)."""
    seg = seg or _Segments()
    C = k_BHNCK.shape[-2]
    upper = torch.ones(C, C, dtype=torch.bool, device=k_BHNCK.device).triu(1)
    # mask before exp: above the diagonal G_t - G_s >= 0 could overflow
    P = (G_BHNC.unsqueeze(-1) - G_BHNC.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp() * seg.same
    k_beta = k_BHNCK * beta_BHNC.unsqueeze(-1)
    system = (k_beta @ k_BHNCK.transpose(-1, -2)) * P  # its diagonal is replaced by 1 (unitriangular)
    rhs = torch.cat([v_BHNCV * beta_BHNC.unsqueeze(-1), k_beta * (G_BHNC.exp() * seg.carry).unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    U0, W = solved.split([v_BHNCV.shape[-1], k_BHNCK.shape[-1]], dim=-1)
    return U0, W, P
