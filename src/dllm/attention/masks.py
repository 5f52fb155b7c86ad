"""Attention masks as small frozen descriptions plus pure mask functions.

A mask function has the FlexAttention `mask_mod` signature `(b, h, q_idx, kv_idx) -> bool` and works
on broadcast index tensors, so the same function builds the dense boolean mask of SDPA (the
reference) and the BlockMask of FlexAttention. True means "query may attend to key".

Mask functions never compare two bool tensors (`create_block_mask(..., _compile=True)` fails on
that): flags are combined with `&`, `|`, `~` and only integers are compared.

Shapes: B batch, L sequence length (of the per-position tensors), 2L the block-diffusion layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskKind = Literal["bidirectional", "causal", "block_causal", "block_diffusion", "prefix_canvas"]
BLOCK_KINDS = ("block_causal", "block_diffusion")


class MaskCache:
    """What backends derive from one mask description (dense mask, BlockMask, chunk plan), built once per key.

    Its lifetime is its description's: one training step or one sampling step. Every layer of a model
    gets the same description, so a backend derives its mask once per forward instead of once per
    layer; dropping the description frees what was built. Nothing is kept across descriptions: equal
    patterns of two steps build twice (~5 ms for BD3LM's split plan at L = 512), a cost paid for having
    no hidden store shared between steps.
    """

    def __init__(self) -> None:
        self._built: dict[Any, Any] = {}

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()` once per key; inside a compiled region the build is traced into the graph instead
        (no side effects for dynamo)."""
        if torch.compiler.is_compiling():
            return build()
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def built(self, key: Any) -> Any:
        """What `memo` built for `key` so far (None if nothing, or inside a compiled region)."""
        return None if torch.compiler.is_compiling() else self._built.get(key)

    def __iter__(self) -> Iterator[Any]:
        """The keys built so far, in build order."""
        return iter(list(self._built))

    def __len__(self) -> int:
        return len(self._built)


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs may interact. Backends turn this into what they need.

    The base pattern (`kind`) is intersected with the optional sliding window, documents and key
    padding. For `block_diffusion` the sequence is the 2L layout [x_t ; x_0] (or (V + 1) * L rows with
    `views` V) and the per-position tensors (`key_valid_BL`, `doc_ids_BL`) have length L: position i of
    either half reads entry i mod L, because x_t and x_0 are the same L tokens (noisy and clean). The
    tensors must not be mutated after the mask is built: backends cache what they derive from them (see
    `cache`).
    """

    kind: MaskKind = "bidirectional"
    """Base pattern: bidirectional, causal, block_causal (needs block_size), block_diffusion (2L layout) or
    prefix_canvas ([clean ; canvas], DiffusionGemma's encoder and decoder in one pass; see `prefix_canvas`)."""
    key_valid_BL: torch.Tensor | None = None
    """False at padding keys (batched prompts of different lengths); None means all valid."""
    doc_ids_BL: torch.Tensor | None = None
    """Document id per position; attention stays inside a document. None means one document."""
    block_size: int | None = None
    """Tokens per block for block_causal and block_diffusion (required there, rejected elsewhere)."""
    window: int | None = None
    """Sliding window: q attends kv only if |pos(q) - pos(kv)| < window (pos = i mod L in 2L); None = off."""
    query_offset: int = 0
    """Query row r is index r + query_offset of the key sequence (cached decoding runs a slice of the
    canvas against cached keys); per-position tensors are indexed by key index."""
    query_offset_B: torch.Tensor | None = None
    """Per-row query offsets [B] (int64), added to `query_offset`: query row r of batch row b is key index
    r + query_offset + query_offset_B[b] (a ragged KV cache, whose rows hold different lengths)."""
    num_clean: int | None = None
    """prefix_canvas: rows [0, num_clean) are the clean stream, the rest the canvas (required there only)."""
    canvas_start: int = 0
    """prefix_canvas: the clean row the canvas's first block stands at (num_clean: one canvas after the clean
    stream, as in sampling; 0: canvas blocks over the whole clean stream, as in training)."""
    canvas_origin_B: torch.Tensor | None = None
    """prefix_canvas, per row [B] (int64): canvas blocks are aligned to this many rows after canvas_start (each
    response's start in training); None: 0."""
    held_clean_rows: int | None = None
    """prefix_canvas, when the model input holds only some of the rows (a rank of a context-parallel group,
    parallel/context.py): how many of its first rows are clean rows, the rest canvas rows; None: the input
    is rows query_offset.. of the whole layout (see `input_clean_rows`)."""
    causal_context: bool = False
    """Block kinds: the clean context attends token-causally (Nemotron-Labs-Diffusion, whose clean half also
    trains next-token prediction): block_diffusion's x_0 half, and every block_causal block but the last
    key block (the one being denoised). False: block-causal context (BD3LM)."""
    views: int = 1
    """block_diffusion: noisy copies of the sequence sharing one clean stream, the layout [x_t^1 ; ... ; x_t^V ;
    x_0] of (V + 1) * L rows. Each noisy copy sees its own blocks and x_0 as the single x_t of the 2L layout
    does and never another copy, so its states equal those of V separate 2L rows while x_0 is computed once
    (Fast-dLLM v2's two complementary views: 3L rows instead of 2 x 2L). 1: the 2L layout."""
    num_outputs: int | None = None
    """Only the first N query rows' outputs are used (BD3LM's loss reads x_t only): a model may compute
    just those queries in its last layer. None: every row's output is used."""
    # not an init field: `dataclasses.replace` must give a changed description a fresh cache, since
    # cache keys name shapes, not the pattern
    cache: MaskCache = field(default_factory=MaskCache, init=False, repr=False, compare=False)
    """What backends derived from this description, shared by all layers of one forward."""

    def __post_init__(self) -> None:
        needs_block = self.kind in BLOCK_KINDS or self.kind == "prefix_canvas"
        if needs_block and (self.block_size is None or self.block_size < 1):
            raise ValueError(f"attention mask kind {self.kind!r} needs block_size >= 1, got {self.block_size}")
        if not needs_block and self.block_size is not None:
            raise ValueError(f"block_size has no effect with attention mask kind {self.kind!r}; leave it None")
        if self.query_offset < 0 or (self.query_offset and self.kind == "block_diffusion"):
            raise ValueError(f"query_offset must be >= 0 and is not used with block_diffusion, got {self.query_offset}")
        if self.causal_context and not needs_block:
            raise ValueError(f"causal_context applies to the block kinds, not {self.kind!r}")
        if self.views < 1 or (self.views > 1 and self.kind != "block_diffusion"):
            raise ValueError(
                f"views must be >= 1 and above 1 only with block_diffusion, got {self.views} ({self.kind})"
            )
        if self.num_outputs is not None and self.num_outputs < 1:
            raise ValueError(f"num_outputs must be >= 1 (or None for all rows), got {self.num_outputs}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"attention window must be >= 1 (or None for no window), got {self.window}")
        _check_per_position(self.key_valid_BL, self.doc_ids_BL)
        self._check_canvas()
        off = self.query_offset_B
        if off is not None and (off.dim() != 1 or off.dtype != torch.int64 or self.kind == "block_diffusion"):
            raise ValueError(f"query_offset_B must be int64 [batch] and not block_diffusion, got {off.dtype} "
                             f"{tuple(off.shape)} with {self.kind}")  # fmt: skip

    def _check_canvas(self) -> None:
        if self.kind != "prefix_canvas":
            held = self.held_clean_rows is not None
            if self.num_clean is not None or self.canvas_start or self.canvas_origin_B is not None or held:
                raise ValueError(f"num_clean and canvas_* are for prefix_canvas masks, not {self.kind!r}")
            return
        origin = self.canvas_origin_B
        if origin is not None and (origin.dim() != 1 or origin.dtype != torch.int64):
            raise ValueError(f"canvas_origin_B must be int64 [batch], got {origin.dtype} {tuple(origin.shape)}")
        if self.num_clean is None or not 0 <= self.canvas_start <= self.num_clean:
            raise ValueError(f"prefix_canvas needs num_clean >= canvas_start >= 0, got {self.num_clean}, "
                             f"{self.canvas_start}")  # fmt: skip
        if self.query_offset_B is not None or self.doc_ids_BL is not None:
            raise ValueError("prefix_canvas takes no per-row query offsets or documents")
        if self.held_clean_rows is not None and self.held_clean_rows < 0:
            raise ValueError(f"held_clean_rows must be >= 0, got {self.held_clean_rows}")

    @property
    def input_clean_rows(self) -> int | None:
        """prefix_canvas: how many of the model input's first rows are clean rows (the rows after them are
        the canvas, which the model embeds through its self-conditioning block); None for other kinds."""
        if self.num_clean is None:
            return None
        return self.held_clean_rows if self.held_clean_rows is not None else self.num_clean - self.query_offset

    @property
    def is_plain(self) -> bool:
        """Plain bidirectional or causal: no mask tensor needed (backends can skip building one)."""
        restricted = self.key_valid_BL is not None or self.doc_ids_BL is not None or self.window is not None
        restricted = restricted or self.query_offset_B is not None
        shifted_causal = self.kind == "causal" and self.query_offset != 0  # SDPA's is_causal is top-left aligned
        return self.kind in ("bidirectional", "causal") and not restricted and not shifted_causal


def _check_per_position(key_valid_BL: torch.Tensor | None, doc_ids_BL: torch.Tensor | None) -> None:
    for name, t in (("key_valid_BL", key_valid_BL), ("doc_ids_BL", doc_ids_BL)):
        if t is not None and t.dim() != 2:
            raise ValueError(f"AttentionMask.{name} must be [batch, length], got shape {tuple(t.shape)}")
    if key_valid_BL is not None and key_valid_BL.dtype != torch.bool:
        raise ValueError(f"AttentionMask.key_valid_BL must be bool, got {key_valid_BL.dtype}")
    if key_valid_BL is not None and doc_ids_BL is not None and key_valid_BL.shape != doc_ids_BL.shape:
        raise ValueError(f"key_valid_BL {tuple(key_valid_BL.shape)} and doc_ids_BL {tuple(doc_ids_BL.shape)} differ")


# --------------------------------------------------------------------------------------------------
# base patterns


def causal() -> MaskMod:
    def mod(b, h, q, kv):
        return q >= kv

    return mod


def bidirectional() -> MaskMod:
    def mod(b, h, q, kv):
        return torch.ones_like(q >= kv)

    return mod


def block_causal(block_size: int) -> MaskMod:
    """Bidirectional inside a block, causal across blocks: kv // B <= q // B."""

    def mod(b, h, q, kv):
        return kv // block_size <= q // block_size

    return mod


def causal_before_last_block(block_size: int, kv_len: int) -> MaskMod:
    """Decoding a causal-context block model: the canvas up to the active block attends token-causally
    except inside its last key block, which is the active (noisy) one: kv <= q, or both in that block."""
    last = (kv_len - 1) // block_size

    def mod(b, h, q, kv):
        return (kv <= q) | (q // block_size == last)

    return mod


def block_diffusion(seq_len: int, block_size: int, causal_context: bool = False, views: int = 1) -> MaskMod:
    """BD3LM's vectorised training mask over [x_t ; x_0] of length 2L (Arriola et al. 2025, Sec. 3.2).

    Blocks are indexed by (i mod L) // B in both halves. A noisy query (i < L) sees the noisy keys of
    its own block (block-diagonal) and the clean keys of strictly earlier blocks (offset
    block-causal: the context it would have at sampling time); a clean query sees clean keys of the
    same or earlier blocks (block-causal), or with `causal_context` the clean keys up to its own
    position (Nemotron-Labs-Diffusion: x_0 is a causal pass that trains next-token prediction). Clean
    never sees noisy, so x_0's states equal those of a block-causal (causal) pass over x_0. Allowed
    pairs: L*L + L*B of 4*L*L (BD3LM).

    With `views` V > 1 the layout is [x_t^1 ; ... ; x_t^V ; x_0] ((V + 1) * L rows): a noisy query sees the
    noisy keys of its own block of its own copy only, and the clean rows are the last L.
    """
    clean_from = views * seq_len

    def mod(b, h, q, kv):
        q_clean, kv_clean = q >= clean_from, kv >= clean_from
        q_block, kv_block = (q % seq_len) // block_size, (kv % seq_len) // block_size
        # noisy rows: the block of the whole layout, so one copy's block never meets another's
        noisy_noisy = ~q_clean & ~kv_clean & (q // block_size == kv // block_size)
        noisy_clean = ~q_clean & kv_clean & (kv_block < q_block)
        clean_clean = q_clean & kv_clean & ((kv <= q) if causal_context else (kv_block <= q_block))
        return noisy_noisy | noisy_clean | clean_clean

    return mod


def prefix_canvas(
    num_clean: int, block_size: int, canvas_start: int, window: int | None, origin_B: torch.Tensor | None = None
) -> MaskMod:
    """DiffusionGemma's encoder and decoder as one pass over [clean ; canvas].

    Clean rows attend causally (the encoder over the clean stream; with a window, to keys fewer than
    `window` rows back). Canvas row j stands at clean row canvas_start + j and is in canvas block
    k = (j - o) // B (o: its row's origin, 0 by default), which starts at clean row
    s = canvas_start + o + k * B: it attends the clean keys before s (the encoder's cache when that
    block is decoded; with a window only the last window - 1 of them, what a sliding cache layer keeps)
    and every canvas key of its own block, bidirectionally. Clean rows never see the canvas, so their
    states are the encoder's.
    """

    def mod(b, h, q, kv):
        o = 0 if origin_B is None else origin_B[b]
        q_canvas, kv_canvas = q >= num_clean, kv >= num_clean
        q_block, kv_block = (q - num_clean - o) // block_size, (kv - num_clean - o) // block_size
        start = canvas_start + o + q_block * block_size
        clean_clean = ~q_canvas & ~kv_canvas & (kv <= q)
        canvas_clean = q_canvas & ~kv_canvas & (kv < start)
        if window is not None:
            clean_clean = clean_clean & (q - kv < window)
            canvas_clean = canvas_clean & (start - kv < window)
        canvas_canvas = q_canvas & kv_canvas & (q_block == kv_block)
        return clean_clean | canvas_clean | canvas_canvas

    return mod


# --------------------------------------------------------------------------------------------------
# restrictions intersected with a base pattern


def sliding_window(window: int) -> MaskMod:
    """Local attention: |q - kv| < window."""

    def mod(b, h, q, kv):
        return (q - kv).abs() < window

    return mod


def key_padding(key_valid_BL: torch.Tensor) -> MaskMod:
    def mod(b, h, q, kv):
        return key_valid_BL[b, kv]

    return mod


def same_document(doc_ids_BL: torch.Tensor) -> MaskMod:
    def mod(b, h, q, kv):
        return doc_ids_BL[b, q] == doc_ids_BL[b, kv]

    return mod


def in_both_halves(inner: MaskMod, seq_len: int) -> MaskMod:
    """Apply a per-position mask function to the 2L layout: index i reads position i mod L."""

    def mod(b, h, q, kv):
        return inner(b, h, q % seq_len, kv % seq_len)

    return mod


def and_masks(*mods: MaskMod) -> MaskMod:
    def mod(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out & m(b, h, q, kv)
        return out

    return mod


# --------------------------------------------------------------------------------------------------
# description -> mask function


def mask_mod(mask: AttentionMask, kv_len: int | None = None) -> MaskMod:
    """The mask function of a description: base pattern AND window AND document AND padding.

    `kv_len` is the key length the function will be evaluated on; block_diffusion needs it (the 2L
    layout is halved to find L), the other kinds use it only to check the per-position tensors.
    """
    seq_len = layout_length(mask, kv_len)
    restrictions = []
    if mask.window is not None and mask.kind != "prefix_canvas":  # prefix_canvas windows its clean keys itself
        restrictions.append(sliding_window(mask.window))
    if mask.doc_ids_BL is not None:
        restrictions.append(same_document(mask.doc_ids_BL))
    if mask.key_valid_BL is not None:
        restrictions.append(key_padding(mask.key_valid_BL))
    if mask.kind == "block_diffusion":
        restrictions = [in_both_halves(m, seq_len) for m in restrictions]
    mods = [base_mod(mask, seq_len), *restrictions]
    mod = mods[0] if len(mods) == 1 else and_masks(*mods)
    if mask.query_offset_B is not None:
        return offset_queries_per_row(mod, mask.query_offset_B + mask.query_offset)
    return mod if not mask.query_offset else offset_queries(mod, mask.query_offset)


def offset_queries(inner: MaskMod, offset: int) -> MaskMod:
    """Query row r is index r + offset (a slice of the canvas against keys from its start)."""

    def mod(b, h, q, kv):
        return inner(b, h, q + offset, kv)

    return mod


def offset_queries_per_row(inner: MaskMod, offset_B: torch.Tensor) -> MaskMod:
    """Query row r of batch row b is index r + offset_B[b] (rows of a ragged cache sit at different lengths)."""

    def mod(b, h, q, kv):
        return inner(b, h, q + offset_B[b], kv)

    return mod


def index_mapped(inner: MaskMod, q_rows: torch.Tensor, kv_rows: torch.Tensor) -> MaskMod:
    """A mask function over a subset of rows: local query q is global row q_rows[q], local key kv is
    global row kv_rows[kv] (context parallelism evaluates the global mask on a rank's rows and the keys
    it gathered; the global description, documents and padding included, stays untouched)."""

    def mod(b, h, q, kv):
        return inner(b, h, q_rows[q], kv_rows[kv])

    return mod


def base_mod(mask: AttentionMask, seq_len: int | None) -> MaskMod:
    if mask.kind == "bidirectional":
        return bidirectional()
    if mask.kind == "causal":
        return causal()
    assert mask.block_size is not None  # checked in AttentionMask.__post_init__
    if mask.kind == "block_causal" and not mask.causal_context:
        return block_causal(mask.block_size)
    if mask.kind == "prefix_canvas":
        assert mask.num_clean is not None  # checked in AttentionMask.__post_init__
        return prefix_canvas(mask.num_clean, mask.block_size, mask.canvas_start, mask.window, mask.canvas_origin_B)
    assert seq_len is not None  # layout_length raises for block_diffusion without kv_len
    if mask.kind == "block_causal":
        return and_masks(block_causal(mask.block_size), causal_before_last_block(mask.block_size, seq_len))
    return block_diffusion(seq_len, mask.block_size, mask.causal_context, mask.views)


def layout_length(mask: AttentionMask, kv_len: int | None) -> int | None:
    """L of the per-position tensors (kv_len // (views + 1) for block_diffusion); raises on a mismatch."""
    seq_len = kv_len
    if mask.kind == "block_diffusion":
        parts = mask.views + 1
        if kv_len is None or kv_len % parts:
            need = "an even length" if parts == 2 else f"a multiple of {parts} ({mask.views} noisy copies and x_0)"
            raise ValueError(
                f"block_diffusion attends over the {parts}L layout [x_t ; x_0]: needs {need}, got {kv_len}"
            )
        seq_len = kv_len // parts
        assert mask.block_size is not None  # checked in AttentionMask.__post_init__
        if seq_len % mask.block_size:
            raise ValueError(f"block_diffusion: L={seq_len} is not a multiple of block_size={mask.block_size}")
    for name, t in (("key_valid_BL", mask.key_valid_BL), ("doc_ids_BL", mask.doc_ids_BL)):
        if t is not None and seq_len is not None and t.shape[1] != seq_len:
            raise ValueError(f"AttentionMask.{name} has length {t.shape[1]}, expected {seq_len} (kind {mask.kind})")
    return seq_len


def dense_mask(mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate a mask function on every (b, q, kv): bool [B, 1, Lq, Lk] (broadcast over heads)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)


def depends_on_batch(mask: AttentionMask) -> bool:
    """Whether the pattern differs between batch rows (per-position tensors), else it broadcasts."""
    per_row = mask.query_offset_B is not None or mask.canvas_origin_B is not None
    return mask.key_valid_BL is not None or mask.doc_ids_BL is not None or per_row
