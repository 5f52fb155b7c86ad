"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3.5's `linear` layers).

    q, k, v = act(causal depthwise conv(in_proj_qkv x))     (W taps over the sequence, per channel)
    beta = sigmoid(in_proj_b x)                              (write strength per value head)
    g = -exp(A_log) softplus(in_proj_a x + dt_bias)          (log decay per value head, <= 0)
    o = gated delta rule(l2norm(q) / sqrt(K), l2norm(k), v, g, beta)   (models/gated_delta.py)
    out = out_proj(rmsnorm(o) * w * silu(in_proj_z x))       (a norm per value head, gated)

Key heads are shared by groups of value heads (each key head serves H / G consecutive value heads).
The parameter names are those of Hugging Face's Qwen3.5 checkpoints, so the family's weight map is 1:1.

Padding (`mask.key_valid_BL`): a padding position is a no-op token: its input is zeroed (no write, and
zeros to the convolution, as Hugging Face does) and its decay is 0, so the state passes through it
unchanged. Left padding is therefore exactly an unpadded row (the state is still zero after it), and
right padding changes nothing before it. Documents (`mask.doc_ids_BL`): the state is zeroed at each
document start and the convolution does not reach across one (gated_delta's segments). Sampling's block
canvas marks its padding as a document of its own, so a padded prompt decodes as it does alone.

Which tokens are clean (run causally: token t reads the state after itself, as in an autoregressive
model) and which are noisy depends on the mask kind:

- causal: every token is clean;
- block_diffusion (training, the 2L layout [x_t ; x_0]): the clean half x_0 runs causally from a zero
  state; noisy block n of x_t starts from the clean state at its start (after x_0's tokens before the
  block), its convolution reads x_0's inputs before the block, all its tokens are written, and each of
  them reads the state after the whole block (bidirectional inside the block, gated_delta.block_reads);
  tokens of a noisy block after a document start inside it are no-ops (documents should start on block
  boundaries, as `pad_to_multiple` and block sampling's canvas make them; a block that starts a document
  starts from a zero state);
- block_causal (decoding a canvas up to the active block): the forward's last block (by canvas index,
  `query_offset` + row) is the noisy block, the tokens before it are clean;
- bidirectional: the whole forward is one noisy block (decoding with the cache: only the active block).

So the state a noisy block reads is exactly the state an autoregressive pass over the clean prefix
leaves. With a cache (`kv`, a sampling.cache.LayerKV; `kv.recurrent` holds a RecurrentCache) a forward
starts from the state kept at its first canvas index, keeps the state after its clean tokens (and
before the last of them, which a shifted model re-reads), and never keeps a noisy block's writes.
In a ragged causal decoding (`kv.recurrent` a RowStates: sampling/causal.py's cache, whose rows sit at
different lengths) every token is clean and each row starts from its own state; which tokens a row keeps
decides the state it is left with (models/linear_state.py).

Shapes: B batch, L sequence, E hidden width, H value heads, G key heads, K key width, V value width,
C convolution channels (2 G K + H V), W convolution taps, N blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.config.registries import ACTIVATIONS, DELTA_RULES
from dllm.models import gated_delta
from dllm.models.linear_state import CHUNK, Pending, RecurrentCache, RowStates, State, window_before


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's V features, scaled by its weight, then gated by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


@dataclass(frozen=True)
class Features:
    """Per-token inputs of the mixer: convolution inputs, output gates, log decays and write strengths."""

    qkv_BLC: torch.Tensor
    z_BLHV: torch.Tensor
    g_BHL: torch.Tensor
    beta_BHL: torch.Tensor
    start_BL: torch.Tensor | None = None
    """Tokens that start a document (None: no documents)."""
    same_BLW: torch.Tensor | None = None
    """[.., d]: the token d rows back is in the same document (convolution taps; None: no documents)."""

    def rows(self, lo: int, hi: int) -> Features:
        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[:, lo:hi]

        return Features(self.qkv_BLC[:, lo:hi], self.z_BLHV[:, lo:hi], self.g_BHL[:, :, lo:hi],
                        self.beta_BHL[:, :, lo:hi], cut(self.start_BL), cut(self.same_BLW))  # fmt: skip

    def without_writes(self, noop_BL: torch.Tensor) -> Features:
        """The tokens of `noop_BL` neither decay nor write the state."""
        keep_B1L = (~noop_BL).unsqueeze(1)
        return dataclasses.replace(self, g_BHL=self.g_BHL * keep_B1L, beta_BHL=self.beta_BHL * keep_B1L)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, W = cfg.hidden_size, cfg.linear_conv_kernel
        self.num_heads, self.num_key_heads = cfg.linear_value_heads, cfg.linear_key_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        GK, HV = self.num_key_heads * self.key_dim, self.num_heads * self.value_dim
        C = 2 * GK + HV
        self.in_proj_qkv = nn.Linear(E, C, bias=False)
        self.in_proj_z = nn.Linear(E, HV, bias=False)
        self.in_proj_b = nn.Linear(E, self.num_heads, bias=False)
        self.in_proj_a = nn.Linear(E, self.num_heads, bias=False)
        # a module for its weight [C, 1, W] (the checkpoints' layout); the forward pads causally itself
        self.conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(HV, E, bias=False)
        self.act = ACTIVATIONS.resolve(cfg.activation)
        # the chunked rule of causal rows: gated_delta.chunked, or a kernel with its signature (models/fla_rule.py)
        self.rule = DELTA_RULES.resolve(cfg.linear_attention_kernel)()

    def forward(self, x_BLE: torch.Tensor, mask: AttentionMask, kv: Any = None) -> torch.Tensor:
        """Outputs [B, L, E] of every row (see the module docstring for clean and noisy rows)."""
        # a ragged causal decoding (sampling/causal.py): every token clean, each row from its own state; the
        # mask (kind, per-row offsets) is the attention layers' business there
        rows = kv.recurrent if kv is not None and isinstance(kv.recurrent, RowStates) else None
        if rows is not None and mask.kind not in ("causal", "bidirectional"):  # (one query per row: all keys)
            raise ValueError(f"linear-attention layers keep per-row states for causal decoding only, not {mask.kind}")
        valid_BL = None if rows is not None else _check_mask(mask, x_BLE.shape[1])
        if valid_BL is not None:
            x_BLE = x_BLE * valid_BL.unsqueeze(-1).to(x_BLE.dtype)
        f = self._features(x_BLE, valid_BL)
        if mask.doc_ids_BL is not None:
            f = dataclasses.replace(f, **_documents(mask, x_BLE.shape[1], self.conv1d.weight.shape[-1]))
        if rows is not None:
            o_BHLV = self._ragged(f, rows)
        elif mask.kind == "block_diffusion":
            assert mask.block_size is not None
            if mask.views != 1:  # objectives give these layers one x_t per row (training/build.py)
                raise ValueError(
                    f"linear-attention layers run the 2L layout [x_t ; x_0], not {mask.views} noisy copies"
                )
            o_BHLV = self._two_halves(f, mask.block_size)
        else:
            o_BHLV = self._sequence(f, mask, kv)
        B, L, _ = x_BLE.shape
        o_BLHV = self.norm(o_BHLV.transpose(1, 2).to(x_BLE.dtype), f.z_BLHV)
        return self.out_proj(o_BLHV.reshape(B, L, -1))

    def _features(self, x_BLE: torch.Tensor, valid_BL: torch.Tensor | None) -> Features:
        B, L, _ = x_BLE.shape
        z_BLHV = self.in_proj_z(x_BLE).view(B, L, self.num_heads, self.value_dim)
        # log decay and write strength in float32 at least (A = exp(A_log) would overflow in half precision; a
        # float64 model stays float64, so that forwards over different lengths agree far below float32 rounding)
        dtype = torch.promote_types(x_BLE.dtype, torch.float32)
        a_BLH, dt_bias = self.in_proj_a(x_BLE).to(dtype), self.dt_bias.to(dtype)
        g_BLH = -self.A_log.to(dtype).exp() * F.softplus(a_BLH + dt_bias)
        if valid_BL is not None:  # padding neither decays nor writes the state
            g_BLH = g_BLH * valid_BL.unsqueeze(-1)
        beta_BLH = torch.sigmoid(self.in_proj_b(x_BLE).to(dtype))
        return Features(self.in_proj_qkv(x_BLE), z_BLHV, g_BLH.transpose(1, 2), beta_BLH.transpose(1, 2))

    def _sequence(self, f: Features, mask: AttentionMask, kv: Any) -> torch.Tensor:
        """Clean rows causally from the state at the forward's start, then the noisy block if any."""
        L, start = f.qkv_BLC.shape[1], mask.query_offset
        num_clean = _num_clean(mask, L)
        cache = None if kv is None else _recurrent_cache(kv)
        if cache is None and start:
            raise ValueError("linear-attention layers need their cache to run a slice of the canvas")
        state = (None if cache is None else cache.at(start)) or self._zero_state(f)
        outs, lo = [], 0
        # with a cache, stop before the last clean row too: a shifted model re-reads it at every step
        for hi in sorted({max(num_clean - 1, 0), num_clean} if cache is not None else {num_clean}):
            if hi > lo:
                o, state = self._causal(f.rows(lo, hi), state)
                outs.append(o)
                lo = hi
            if cache is not None and start + hi:
                cache.keep(start + hi, state)
        if num_clean < L:
            outs.append(self._noisy_block(f.rows(num_clean, L), state))
        return torch.cat(outs, dim=2)

    def _ragged(self, f: Features, rows: RowStates) -> torch.Tensor:
        """Q tokens of every row from its state (models/linear_state.py): with the kept counts known, the tokens
        past them are no-ops and the state after them is kept now; else the rule's inputs wait for `commit`."""
        start = rows.state if rows.state is not None else self._zero_state(f)
        x_BCL = torch.cat([start.conv_BCW, f.qkv_BLC.transpose(1, 2).to(start.conv_BCW.dtype)], dim=-1)
        q, k, v = self._qkv(self._conv(x_BCL, None))
        keep_B = rows.keep_B
        if keep_B is not None:
            Q = f.qkv_BLC.shape[1]
            f = f.without_writes(torch.arange(Q, device=keep_B.device) >= keep_B[:, None])
        o_BHLV, S = self.rule(q, k, v, f.g_BHL, f.beta_BHL, start.S_BHKV, CHUNK)
        if keep_B is not None:
            rows.state = State(window_before(x_BCL, keep_B, start.conv_BCW.shape[-1]), S)
        else:
            rows.pending = Pending(start, x_BCL, k, v, f.g_BHL, f.beta_BHL)
        return o_BHLV

    def _causal(self, f: Features, state: State) -> tuple[torch.Tensor, State]:
        x_BCL = torch.cat([state.conv_BCW, f.qkv_BLC.transpose(1, 2).to(state.conv_BCW.dtype)], dim=-1)
        q, k, v = self._qkv(self._conv(x_BCL, f.same_BLW))
        o_BHLV, S = self.rule(q, k, v, f.g_BHL, f.beta_BHL, state.S_BHKV, CHUNK, f.start_BL)
        return o_BHLV, State(x_BCL[..., x_BCL.shape[-1] - state.conv_BCW.shape[-1] :], S)

    def _noisy_block(self, f: Features, state: State) -> torch.Tensor:
        """One noisy block from `state`: all its tokens written, each reading the state after the block."""
        x_BCL = torch.cat([state.conv_BCW, f.qkv_BLC.transpose(1, 2).to(state.conv_BCW.dtype)], dim=-1)
        q, k, v = self._qkv(self._conv(x_BCL, f.same_BLW))
        S_BHKV = state.S_BHKV
        if f.start_BL is not None:
            f = f.without_writes(_after_a_start(f.start_BL.unsqueeze(1)).flatten(1))
            S_BHKV = S_BHKV * (~f.start_BL[:, 0, None, None, None]).to(S_BHKV.dtype)
        return gated_delta.block_reads(q, k, v, f.g_BHL, f.beta_BHL, S_BHKV.unsqueeze(2), q.shape[2])

    def _two_halves(self, f: Features, block: int) -> torch.Tensor:
        """Block diffusion's [x_t ; x_0]: x_0 causally, each noisy block from x_0's state at its start."""
        L = f.qkv_BLC.shape[1] // 2
        noisy, clean = f.rows(0, L), f.rows(L, 2 * L)
        zero = self._zero_state(f)
        x_BCL = torch.cat([zero.conv_BCW, clean.qkv_BLC.transpose(1, 2).to(zero.conv_BCW.dtype)], dim=-1)
        q, k, v = self._qkv(self._conv(x_BCL, clean.same_BLW))
        o_clean, _, starts_BHNKV = gated_delta.chunked_states(
            q, k, v, clean.g_BHL, clean.beta_BHL, chunk=block, start_BL=clean.start_BL
        )
        q, k, v = self._qkv(self._conv_blocks(noisy.qkv_BLC, clean.qkv_BLC, block, noisy.same_BLW))
        if noisy.start_BL is not None:  # a block that starts a document starts from zeros
            start_BNb = noisy.start_BL.view(noisy.start_BL.shape[0], -1, block)
            noisy = noisy.without_writes(_after_a_start(start_BNb).flatten(1))
            starts_BHNKV = starts_BHNKV * (~start_BNb[:, None, :, 0, None, None]).to(starts_BHNKV.dtype)
        o_noisy = gated_delta.block_reads(q, k, v, noisy.g_BHL, noisy.beta_BHL, starts_BHNKV, block)
        return torch.cat([o_noisy, o_clean], dim=2)

    def _conv(self, x_BCL: torch.Tensor, same_BLW: torch.Tensor | None) -> torch.Tensor:
        """The depthwise convolution over inputs that start with the W - 1 before the first row, then the
        activation: [B, L, C] for the L rows; with documents, taps across a document start read zeros."""
        w = self.conv1d.weight
        if same_BLW is None:
            return self.act(F.conv1d(x_BCL.to(w.dtype), w, groups=x_BCL.shape[1])).transpose(1, 2)
        W = w.shape[-1]
        L = x_BCL.shape[-1] - (W - 1)
        x_BLC = x_BCL.transpose(1, 2).to(w.dtype)
        y_BLC = sum(x_BLC[:, W - 1 - d : W - 1 - d + L] * same_BLW[..., d, None] * w[:, 0, W - 1 - d] for d in range(W))
        return self.act(y_BLC)

    def _conv_blocks(
        self, noisy_BLC: torch.Tensor, clean_BLC: torch.Tensor, block: int, same_BLW: torch.Tensor | None
    ) -> torch.Tensor:
        """The convolution of the noisy half: a tap reaching before its block reads the clean input there."""
        L, w_CW = noisy_BLC.shape[1], self.conv1d.weight[:, 0]
        W = w_CW.shape[-1]
        in_block_L1 = (torch.arange(L, device=noisy_BLC.device) % block)[:, None]
        y_BLC = torch.zeros_like(noisy_BLC, dtype=w_CW.dtype)
        for lag in range(W):  # y_t = sum over lags d of w[W - 1 - d] x_{t - d}
            noisy, clean = (F.pad(x, (0, 0, lag, 0))[:, :L] for x in (noisy_BLC, clean_BLC))
            tap = torch.where(in_block_L1 >= lag, noisy, clean).to(w_CW.dtype) * w_CW[:, W - 1 - lag]
            y_BLC = y_BLC + (tap if same_BLW is None else tap * same_BLW[..., lag, None])
        return self.act(y_BLC)

    def _qkv(self, conv_BLC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (L2-normalised, scaled by K^-1/2) and keys (L2-normalised) [B, H, L, K], values [B, H, L, V]."""
        GK = self.num_key_heads * self.key_dim
        q, k, v = conv_BLC.split([GK, GK, self.num_heads * self.value_dim], dim=-1)
        q_BHLK = _l2norm(self._heads(q, self.key_dim)) * self.key_dim**-0.5
        return q_BHLK, _l2norm(self._heads(k, self.key_dim)), self._heads(v, self.value_dim)

    def _heads(self, x_BLF: torch.Tensor, width: int) -> torch.Tensor:
        """[B, L, heads * width] -> [B, H, L, width], key heads repeated to the H value heads."""
        B, L, _ = x_BLF.shape
        x = x_BLF.view(B, L, -1, width).transpose(1, 2)
        return x.repeat_interleave(self.num_heads // x.shape[1], dim=1) if x.shape[1] != self.num_heads else x

    def _zero_state(self, f: Features) -> State:
        B, C = f.qkv_BLC.shape[0], f.qkv_BLC.shape[-1]
        W, dtype = self.conv1d.weight.shape[-1], torch.promote_types(f.qkv_BLC.dtype, torch.float32)
        conv = f.qkv_BLC.new_zeros(B, C, W - 1, dtype=self.conv1d.weight.dtype)
        return State(conv, f.qkv_BLC.new_zeros(B, self.num_heads, self.key_dim, self.value_dim, dtype=dtype))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), in float32 at least (the eps placement of the reference kernels)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


def _documents(mask: AttentionMask, L: int, W: int) -> dict[str, torch.Tensor]:
    """Document starts [B, L] and same-document convolution taps [B, L, W] of the forward's rows (rows from
    `query_offset`; block_diffusion: both halves read position i mod L)."""
    assert mask.doc_ids_BL is not None
    two_halves = mask.kind == "block_diffusion"
    start, n = mask.query_offset, L // 2 if two_halves else L
    ext_BX = F.pad(mask.doc_ids_BL[:, : start + n], (W, 0), value=-1)[:, start:]  # W rows before the first
    rows_BL = ext_BX[:, W:]
    start_BL = (rows_BL != ext_BX[:, W - 1 : -1]) & (ext_BX[:, W - 1 : -1] >= 0)  # nothing before index 0
    same_BLW = torch.stack([rows_BL == ext_BX[:, W - d : W - d + n] for d in range(W)], dim=-1)
    if two_halves:
        start_BL, same_BLW = start_BL.repeat(1, 2), same_BLW.repeat(1, 2, 1)
    return {"start_BL": start_BL, "same_BLW": same_BLW}


def _after_a_start(start_BNb: torch.Tensor) -> torch.Tensor:
    """[B, N, b]: the tokens of each block at or after a document start other than its first token."""
    inner = start_BNb.clone()
    inner[..., 0] = False
    return inner.cumsum(-1) > 0


def _recurrent_cache(kv: Any) -> RecurrentCache:
    if kv.recurrent is None:
        kv.recurrent = RecurrentCache()
    return kv.recurrent


def _num_clean(mask: AttentionMask, L: int) -> int:
    """Rows before the noisy block: all (causal), none (bidirectional), or those before the last block."""
    if mask.kind == "causal":
        return L
    if mask.kind == "bidirectional":
        return 0
    assert mask.block_size is not None
    last = (mask.query_offset + L - 1) // mask.block_size * mask.block_size
    return max(last - mask.query_offset, 0)


def _check_mask(mask: AttentionMask, L: int) -> torch.Tensor | None:
    """Padding per row [B, L] (None: none); what a recurrence cannot honour is refused."""
    if mask.window is not None:
        raise ValueError("linear-attention layers have no sliding window; use an attention-only family for one")
    if mask.query_offset_B is not None:
        raise ValueError("linear-attention layers do not decode with per-row offsets (a ragged cache) yet")
    valid = mask.key_valid_BL
    if valid is None:
        return None
    if mask.kind == "block_diffusion":  # both halves read position i mod L
        return torch.cat([valid, valid], dim=1)
    return valid[:, mask.query_offset : mask.query_offset + L]
