"""DFlash drafters: block-diffusion proposals conditioned on a frozen AR target's hidden states.

Chen et al. 2025, "DFlash: Block Diffusion for Flash Speculative Decoding". A drafter proposes the
b - 1 tokens after the last accepted one in a single forward. Its input block is [anchor, MASK x
(b-1)], embedded with the target's (frozen) embedding; the outputs of chosen target blocks at the
context positions are concatenated (F = len(ids) * E), fused to E by a projection and a norm, and
every drafter block attends to keys/values projected (by that block's own k/v projections) from
this fused context plus the draft block itself, bidirectionally inside the block. The target's LM
head turns the drafter's last states into proposals, in place (block row k predicts position
anchor + k). The target is held by reference: its weights are neither drafter parameters nor saved.

The same blocks serve training (many anchors per sequence in one forward, each block seeing only
the context before its anchor: `draft_mask_mod`) and decoding (`start`/`extend`/`propose`, the
Drafter protocol of the speculative loop: the projected context keys/values are cached per layer, and
one round is one drafter forward: `extend` defers its new positions to `propose`, which runs them as
key/value rows next to its b block tokens, written in place into the cache: O(new positions + b)).

Architectures (`DFlashConfig.architecture`): `dflash`, the published drafter (z-lab's DFlashDraftModel:
Qwen3 blocks, the fused context straight into each block's key/value projections), `dllm`, the first
drafters trained here (blocks of the target's layout, the fused context through each block's input norm
before its projections), and `dflash2` (z-lab's DFlash2DraftModel: models/dflash2.py, a subclass).
The public configs' input_embedding_scale, output_multiplier and final_logit_softcapping act on the embedded
block and on the draft logits (`draft_logits`; `head`, which training's chunked cross-entropy takes, holds the
multiplier but not the softcapping, which training never sets). Their `layer_types` / `is_causal` make a block
causal inside its draft block and/or limit it to a sliding window (`layer_sees`, in the training mask and in
propose's). Drafter folders: models/dflash_io.py.

Shapes: B batch, N draft tokens (A anchors x b), A anchors per row, b block size, C context
positions, T state capacity, E hidden, F features, H/K query/key-value heads, D head width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from dllm.attention.backends.flex import FlexBackend
from dllm.attention.masks import MaskMod, dense_mask
from dllm.config.drafter import DFlashConfig
from dllm.config.model import ModelConfig
from dllm.errors import CheckpointError
from dllm.models.output import ModelOutput
from dllm.models.transformer import Block, Transformer, apply_rope, make_norm, rope_cos_sin, rope_inv_freq

FLEX_TILE = 128  # FlexAttention's default BlockMask tile


@dataclass(frozen=True)
class DraftTokens:
    """The drafter's `tokens` input: draft blocks plus the target context they read (as
    `SelfConditioned` carries a second input for self-conditioned models)."""

    ids_BN: torch.Tensor
    """A draft blocks per row, concatenated: [anchor, MASK x (b-1)] each."""
    context_BCF: torch.Tensor
    """Target features at positions 0..C-1 (captured block outputs, in target_layer_ids order)."""
    context_len_BA: torch.Tensor
    """Block a of row r reads context positions [context_start_BA[r, a], context_len_BA[r, a]) (up to its
    anchor's position)."""
    context_start_BA: torch.Tensor | None = None
    """Where its anchor's document starts in a packed row (decoding reads one document's context); None: 0."""


class PrefixKV:
    """Context keys/values put before a forward's own: `update` is what `Attention` calls on a
    `sampling.cache.LayerKV`, so the native attention block runs unchanged over [context ; block]."""

    def __init__(self, k_BKCD: torch.Tensor, v_BKCD: torch.Tensor) -> None:
        self.k, self.v = k_BKCD, v_BKCD

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)


LayerKind = tuple[bool, int | None]
"""(causal inside the draft block, sliding window or None) of a drafter block (`DFlashConfig.layer_kind`)."""
FULL: LayerKind = (False, None)


def layer_sees(q_pos: torch.Tensor, k_pos: torch.Tensor, kind: LayerKind) -> torch.Tensor:
    """Whether a query at position q_pos sees a key at k_pos in a block of `kind` (the public code's rule for
    layer_types and is_causal): causal: k <= q; window W: q - k < W, and k - q < W when not causal."""
    causal, window = kind
    sees = (k_pos <= q_pos) if causal else torch.ones_like(k_pos + q_pos, dtype=torch.bool)
    if window is not None:
        sees = sees & (q_pos - k_pos < window)
        if not causal:
            sees = sees & (k_pos - q_pos < window)
    return sees


def draft_mask_mod(
    context_len_BA: torch.Tensor, block_size: int, num_context: int, context_start_BA: torch.Tensor | None = None,
    kind: LayerKind = FULL,
) -> MaskMod:  # fmt: skip
    """Keys [context (C) ; draft blocks (N)], queries the N draft tokens: query q of block a = q // b
    sees context key kv iff context_start[a] <= kv < context_len[a] (features of its document before its
    anchor) and block key kv iff it is in the same block (bidirectional inside it); never another block.
    A causal or sliding-window `kind` also needs `layer_sees` of their positions (the anchor's is context_len[a])."""

    def mod(b, h, q, kv):
        block = q // block_size
        in_context = kv < num_context
        before_anchor = kv < context_len_BA[b, block]
        if context_start_BA is not None:
            before_anchor = before_anchor & (kv >= context_start_BA[b, block])
        same_block = (kv - num_context).clamp_min(0) // block_size == block
        sees = (in_context & before_anchor) | (~in_context & same_block)
        if kind == FULL:
            return sees
        anchor = context_len_BA[b, block]
        k_pos = torch.where(in_context, kv, anchor + (kv - num_context) % block_size)
        return sees & layer_sees(anchor + q % block_size, k_pos, kind)

    return mod


class DraftAttention:
    """The drafter's attention (per-anchor context lengths are not an AttentionMask kind): SDPA with a dense
    bool mask [B, 1, Q, K] (or None), or FlexAttention with the same pattern as a BlockMask (`draft_block_mask`),
    which skips the tiles of other anchors' context and blocks."""

    def __init__(self, flex_compile: bool) -> None:
        self.flex = FlexBackend(compiled=flex_compile)

    def __call__(self, q, k, v, mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        if isinstance(mask, BlockMask):
            return self.flex.run(q, k, v, mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def uses_flex(backend: str, device: torch.device, grad: bool) -> bool:
    """Whether the training draft mask is a BlockMask: backend `flex` (or `auto` on a GPU), except for a call
    that needs gradients on CPU, where FlexAttention has no backward (torch 2.13)."""
    wanted = backend == "flex" or (backend == "auto" and device.type == "cuda")
    return wanted and not (grad and device.type == "cpu")


@dataclass
class DraftState:
    """Per-call decoding state: each layer's keys/values of the fused target context, by position."""

    k: list[torch.Tensor]
    """Per layer [B, K, T, D]."""
    v: list[torch.Tensor]
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    """Features [B, N, F] and positions [B, N] `extend` was given and the next `propose` writes (in its
    own forward: one pass per round over the new context and the block)."""
    rope_TD: tuple[torch.Tensor, torch.Tensor] | None = None
    """RoPE's cos and signed sin of every position [0, T), computed once per call (None: no RoPE)."""
    arange_b: torch.Tensor | None = None
    """[0, b): the offsets of propose's block rows from its anchor's position."""
    hidden_BdE: torch.Tensor | None = None
    """The final states of the last `propose`'s draft rows (DFlash2's candidate selector reads them)."""

    def rope(self, positions_BL: torch.Tensor) -> tuple | None:
        """The RoPE tables [B, 1, L, D] of these positions (rows of the per-call table)."""
        if self.rope_TD is None:
            return None
        cos_TD, sin_TD = self.rope_TD
        return cos_TD[positions_BL][:, None], sin_TD[positions_BL][:, None]


class BufferKV:
    """The decoding drafter's `LayerKV`: a forward over [block (b) ; new context (N)] writes the context's
    keys/values at their positions, then the block's at its own (anchor_pos + [0, b): the positions the next
    verification rewrites), in place, and attention reads the buffer [0, end): no copy of the context."""

    def __init__(self, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, positions_BL: torch.Tensor, b: int, end: int):
        self.k, self.v, self.positions_BL, self.b, self.end = k_BKTD, v_BKTD, positions_BL, b, end

    def update(self, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, K, L, D = k_BKLD.shape
        index = self.positions_BL[:, None, :, None].expand(B, K, L, D)
        num_context = L - self.b
        if num_context > 0:  # the context first: a rejected position it holds is the block's, written after it
            self.k.scatter_(2, index[:, :, self.b :], k_BKLD[:, :, self.b :])
            self.v.scatter_(2, index[:, :, self.b :], v_BKLD[:, :, self.b :])
        self.k.scatter_(2, index[:, :, : self.b], k_BKLD[:, :, : self.b])
        self.v.scatter_(2, index[:, :, : self.b], v_BKLD[:, :, : self.b])
        return self.k[:, :, : self.end], self.v[:, :, : self.end]


class DFlashDrafter(nn.Module):
    """Feature fusion -> `num_layers` native blocks over [context ; block] -> norm -> the target's head."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.dcfg = cfg
        # the blocks' own layout (the target's, or Qwen3's); `cfg` names it so Transformer's init helpers apply
        self.cfg: ModelConfig = cfg.block_config
        self.context_norm = cfg.architecture == "dllm"  # the fused context through each block's input norm
        self.block_size = cfg.block_size
        self.target_layer_ids = tuple(cfg.target_layer_ids)
        self.mask_id = cfg.mask_id
        self.layer_kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
        E = self.cfg.hidden_size
        self.fc = nn.Linear(cfg.feature_size, E, bias=False)
        self.hidden_norm = make_norm(self.cfg)
        attend = DraftAttention(self.cfg.flex_compile)
        self.layers = nn.ModuleList(Block(self.cfg, attend) for _ in range(cfg.num_layers))  # type: ignore[arg-type]
        self.norm = make_norm(self.cfg)
        self.register_buffer("inv_freq", rope_inv_freq(self.cfg.dim_per_head, self.cfg.rope_theta), persistent=False)
        self._target: tuple[Transformer, ...] = ()  # a tuple: not a submodule, not in state_dict or parameters()

    # -- the target, by reference ------------------------------------------------------------------
    def attach(self, target: Transformer) -> DFlashDrafter:
        """Use `target`'s embedding and LM head (frozen: its parameters stop requiring gradients)."""
        tcfg = target.cfg
        if (tcfg.hidden_size, len(target.layers)) != (self.cfg.hidden_size, self.dcfg.target.num_layers):
            raise CheckpointError(
                f"the target (hidden {tcfg.hidden_size}, {len(target.layers)} layers) is not the architecture this "
                f"drafter was built for (hidden {self.cfg.hidden_size}, {self.dcfg.target.num_layers} layers)"
            )
        target.requires_grad_(False)
        target.eval()
        self._target = (target,)
        return self

    @property
    def target(self) -> Transformer:
        if not self._target:
            raise RuntimeError("attach(target) the drafter to its target before using it")
        return self._target[0]

    def head(self, hidden_BLE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The target's output head (its weight stays the target's: frozen, not the drafter's), the features
        times output_multiplier (a factor on the logits; no softcapping: `draft_logits`)."""
        features, weight, bias = self.target.head(hidden_BLE)
        scale = self.dcfg.output_multiplier
        return (features if scale == 1.0 else features * scale), weight, None if bias is None else bias * scale

    def draft_logits(self, hidden_BLE: torch.Tensor) -> torch.Tensor:
        """The draft logits of final states: the target's head, output_multiplier, final_logit_softcapping."""
        logits = self.target.logits(hidden_BLE)
        if self.dcfg.output_multiplier != 1.0:
            logits = logits * self.dcfg.output_multiplier
        cap = self.dcfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def embed(self, ids_BL: torch.Tensor, positions_BL: torch.Tensor) -> torch.Tensor:
        """A draft block embedded by the target's embedding (times input_embedding_scale), in the drafter's dtype."""
        x = self.target.embed(ids_BL, positions_BL).to(self.fc.weight.dtype)
        scale = self.dcfg.input_embedding_scale
        return x if scale == 1.0 else x * scale

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """The native transformer's initialisation (normal(0, init_std), scaled residual outputs, norms 1)."""
        Transformer.init_weights(self, generator)  # type: ignore[arg-type]

    @staticmethod
    def check_init_from_target(cfg: DFlashConfig, layer_ids: list[int] | tuple[int, ...]) -> None:
        """ValueError unless target block layer_ids[i] has drafter block i's weights (names and shapes): one
        per block, architecture dllm (the target's layout), and no block of another kind (the target's first
        block may lack an input norm, a mixture-of-experts or linear-attention block has other weights)."""
        if len(layer_ids) != cfg.num_layers or cfg.architecture != "dllm":
            raise ValueError(f"one target block per drafter block ({cfg.num_layers}) of architecture dllm, "
                             f"not {len(layer_ids)} for {cfg.architecture}")  # fmt: skip
        with torch.device("meta"):
            for i, j in enumerate(layer_ids):
                mine = {k: v.shape for k, v in Block(cfg.block_config, None, i).state_dict().items()}  # type: ignore[arg-type]
                theirs = {k: v.shape for k, v in Block(cfg.target, None, j).state_dict().items()}  # type: ignore[arg-type]
                differ = ", ".join(sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))[:3])
                if differ:
                    raise ValueError(f"target block {j} has other weights than drafter block {i} ({differ}); "
                                     "name another")  # fmt: skip

    @torch.no_grad()
    def init_from_target(self, target: Transformer, layer_ids: list[int] | tuple[int, ...]) -> None:
        """Start block i from a copy of the target's block layer_ids[i] and the final norm from the target's
        (architecture dllm: the blocks have the target's layout), instead of a random initialisation."""
        self.check_init_from_target(self.dcfg, layer_ids)
        for block, i in zip(self.layers, layer_ids, strict=True):
            block.load_state_dict(target.layers[i].state_dict())
        if target.norm is not None:
            self.norm.load_state_dict(target.norm.state_dict())

    @torch.no_grad()
    def init_buffers(self) -> None:
        self.inv_freq.copy_(rope_inv_freq(self.cfg.dim_per_head, self.cfg.rope_theta).to(self.inv_freq.device))

    # -- the forward (training: many anchors per row) ----------------------------------------------
    def forward(
        self, tokens: DraftTokens, positions_BN: torch.Tensor, mask: Any = None, cache: Any = None
    ) -> ModelOutput:
        """Final states [B, N, E] of the draft blocks; row k of a block predicts position anchor + k.
        The attention pattern comes from `tokens.context_len_BA` (`mask` is unused: None)."""
        assert cache is None, "a drafter decodes through start/extend/propose"
        context_BCF = tokens.context_BCF
        grad = torch.is_grad_enabled() and self.fc.weight.requires_grad
        flex = uses_flex(self.cfg.attention_backend, context_BCF.device, grad)
        if flex:  # static shapes for the compiled kernel: the context padded to whole tiles (masked: past every anchor)
            context_BCF = F.pad(context_BCF, (0, 0, 0, -context_BCF.shape[1] % FLEX_TILE))
        context_BCE = self.fuse(context_BCF)
        C = context_BCE.shape[1]
        ctx_pos = torch.arange(C, device=context_BCE.device).expand(context_BCE.shape[0], C)
        ctx_rope = self._rope(ctx_pos)

        def context_kv(i: int, layer: nn.Module) -> PrefixKV:
            return PrefixKV(*self.context_kv(layer, context_BCE, ctx_rope))

        hidden = self._blocks(
            tokens.ids_BN, positions_BN, tokens.context_len_BA, tokens.context_start_BA, C, context_kv, flex
        )
        return ModelOutput(hidden, self.head)

    def fuse(self, features_BLF: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs -> E (projection, then norm)."""
        return self.hidden_norm(self.fc(features_BLF.to(self.fc.weight.dtype)))

    def context_kv(self, layer: nn.Module, context_BLE: torch.Tensor, rope: tuple | None):
        """A block's keys/values [B, K, L, D] of fused context states: its input norm (architecture dllm), k/v
        projections, k norm and RoPE, as `Attention` computes them for its own tokens."""
        attn = layer.self_attn
        x = layer.input_layernorm(context_BLE) if self.context_norm else context_BLE
        B, L, _ = x.shape
        k = attn.k_proj(x).view(B, L, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, L, -1, attn.head_dim).transpose(1, 2)
        if attn.k_norm is not None:
            k = attn.k_norm(k)
        if rope is not None:
            k = apply_rope(k, *rope)
        return k, v

    def _rope(self, positions_BL: torch.Tensor) -> tuple | None:
        return rope_cos_sin(positions_BL, self.inv_freq) if self.cfg.position == "rope" else None

    def _blocks(
        self,
        ids_BN: torch.Tensor,
        positions_BN: torch.Tensor,
        context_len_BA: torch.Tensor,
        context_start_BA: torch.Tensor | None,
        num_context: int,
        context_kv: Callable[[int, nn.Module], PrefixKV],
        flex: bool,
    ) -> torch.Tensor:
        """The training pass (decoding: `propose`, tested equal to it): embed the blocks with the target's
        embedding, run the blocks over [context ; blocks] under the draft mask (a BlockMask if `flex`), final norm."""
        B, N = ids_BN.shape
        x = self.embed(ids_BN, positions_BN)
        one_block = (  # one block that sees the whole context: a full-attention block needs no mask
            context_len_BA.shape[1] == 1
            and bool((context_len_BA == num_context).all())
            and (context_start_BA is None or not bool(context_start_BA.any()))
        )
        masks: dict[LayerKind, torch.Tensor | BlockMask | None] = {}
        for kind in set(self.layer_kinds):
            if kind == FULL and one_block:
                masks[kind] = None
                continue
            mod = draft_mask_mod(context_len_BA, self.block_size, num_context, context_start_BA, kind)
            if flex:
                masks[kind] = create_block_mask(mod, B, None, N, num_context + N, device=ids_BN.device)
            else:
                masks[kind] = dense_mask(mod, B, N, num_context + N, ids_BN.device)
        rope = self._rope(positions_BN)
        for i, layer in enumerate(self.layers):
            x = self._train_layer(layer, x, rope, masks[self.layer_kinds[i]], context_kv(i, layer))
        return self.norm(x)

    def _train_layer(self, layer: nn.Module, x_BNE: torch.Tensor, rope, mask, kv: PrefixKV) -> torch.Tensor:
        """One block of the training pass over the draft rows, the context's keys/values before theirs."""
        return layer(x_BNE, rope, mask, None, kv)[0]

    # -- the Drafter protocol (decoding) -----------------------------------------------------------
    def start(self, batch_size: int, max_length: int) -> DraftState:
        """Fresh per-call state: zeroed key/value buffers of `max_length` context positions per layer."""
        w = self.fc.weight
        shape = (batch_size, self.cfg.kv_heads, max_length, self.cfg.dim_per_head)
        rope = self._rope(torch.arange(max_length, device=w.device)[None])
        return DraftState(
            [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.layers],
            [torch.zeros(shape, dtype=w.dtype, device=w.device) for _ in self.layers],
            rope_TD=None if rope is None else (rope[0][0, 0], rope[1][0, 0]),
            arange_b=torch.arange(self.block_size, device=w.device),
        )

    def extend(self, state: DraftState, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        """Context features of N new positions per row, to be written (as each layer's keys/values) at those
        positions; a later write to a position overwrites an earlier one (rejected drafts are rewritten by
        the next verification). Deferred to the next `propose`, which runs them with its block in one pass."""
        if state.pending is not None:
            self._write_context(state, *state.pending)
        state.pending = (features_BNF, positions_BN)

    @torch.no_grad()
    def _write_context(self, state: DraftState, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        """Write the projected context keys/values of N positions per row (without a block)."""
        context_BNE = self.fuse(features_BNF)
        rope = state.rope(positions_BN)
        index_BN = positions_BN[:, None, :, None]
        for i, layer in enumerate(self.layers):
            k, v = self.context_kv(layer, context_BNE, rope)
            state.k[i].scatter_(2, index_BN.expand_as(k), k)
            state.v[i].scatter_(2, index_BN.expand_as(v), v)
        state.pending = None

    @torch.no_grad()
    def propose(self, state: DraftState, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, b-1, V] for positions anchor_pos+1 .. anchor_pos+b-1; row r reads the context
        of positions [0, anchor_pos_B[r]).

        One forward per round: each layer runs its block rows [anchor, MASK x (b-1)] as queries and, as keys
        and values only, the rows of the context features `extend` deferred (num_queries = b), so the new
        context's projections and the block's share the layer's matmuls; both land in the state's buffers
        (BufferKV), where the block sits at its own positions: row r attends to [0, anchor_pos_B[r] + b)."""
        b, B, device = self.block_size, anchor_B.shape[0], anchor_B.device
        host_pos = anchor_pos_B.tolist()
        lo, hi = min(host_pos), max(host_pos)
        end = hi + b
        ids_Bb = torch.full((B, b), self.mask_id, dtype=anchor_B.dtype, device=device)
        ids_Bb[:, 0] = anchor_B
        positions_BL = anchor_pos_B[:, None] + state.arange_b
        x = self.embed(ids_Bb, positions_BL)
        context_BNE = None
        if state.pending is not None:
            features_BNF, context_pos_BN = state.pending
            state.pending = None
            context_BNE = self.fuse(features_BNF)
            positions_BL = torch.cat([positions_BL, context_pos_BN], dim=1)
        masks = {kind: self._propose_mask(kind, anchor_pos_B, end, lo != hi) for kind in set(self.layer_kinds)}
        rope = state.rope(positions_BL)
        for i, layer in enumerate(self.layers):
            kv = BufferKV(state.k[i], state.v[i], positions_BL, b, end)
            x = self._draft_layer(layer, x, context_BNE, rope, masks[self.layer_kinds[i]], kv)
        state.hidden_BdE = self.norm(x[:, 1:])
        return self.draft_logits(state.hidden_BdE)

    def _propose_mask(self, kind: LayerKind, anchor_pos_B: torch.Tensor, end: int, ragged: bool):
        """propose's mask [B, 1, b, end] over the buffer: row r's keys before anchor_pos_B[r] + b, seen as `kind`
        sees them; None when every key is seen (full attention, rows at one length)."""
        if kind == FULL and not ragged:
            return None
        k_T = torch.arange(end, device=anchor_pos_B.device)
        sees_BbT = (k_T < (anchor_pos_B + self.block_size)[:, None])[:, None, :]
        if kind != FULL:
            q_Bb = anchor_pos_B[:, None] + torch.arange(self.block_size, device=k_T.device)
            sees_BbT = sees_BbT & layer_sees(q_Bb[:, :, None], k_T[None, None, :], kind)
        return sees_BbT[:, None]

    def _draft_layer(self, layer: nn.Module, x_BbE: torch.Tensor, context_BNE: torch.Tensor | None, rope, mask,
                     kv: BufferKV) -> torch.Tensor:  # fmt: skip
        """One block over the draft rows (queries) and the new context rows (keys/values only), as the
        block's pre-norm forward: the context rows through its input norm (dllm) or as they are (dflash)."""
        b = x_BbE.shape[1]
        if context_BNE is None or self.context_norm:
            rows = x_BbE if context_BNE is None else torch.cat([x_BbE, context_BNE], dim=1)
            return layer(rows, rope, mask, b, kv)[0]
        rows = torch.cat([layer.input_layernorm(x_BbE), context_BNE], dim=1)
        x_BbE = x_BbE + layer.self_attn(rows, rope, mask, b, kv)
        return x_BbE + layer.mlp(layer.post_attention_layernorm(x_BbE))  # dflash blocks are dense (Qwen3)
