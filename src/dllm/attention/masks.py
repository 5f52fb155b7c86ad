"""Attention masks as small frozen descriptions plus pure mask functions.

A mask function has the FlexAttention `mask_mod` signature `(b, h, q_idx, kv_idx) -> bool` and works
on broadcast index tensors, so the same function builds a dense boolean mask for SDPA (the reference)
and, later, a BlockMask. True means "query may attend to key".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) pairs may interact. Backends turn this into what they need."""

    kind: Literal["bidirectional", "causal"] = "bidirectional"
    """Base pattern."""
    key_valid_BL: torch.Tensor | None = None
    """False at padding keys (batched prompts of different lengths); None means all valid."""
    doc_ids_BL: torch.Tensor | None = None
    """Document id per position; attention stays inside a document. None means one document."""

    @property
    def is_plain(self) -> bool:
        """No restriction beyond the base pattern (backends can skip building a mask)."""
        return self.key_valid_BL is None and self.doc_ids_BL is None


def causal() -> MaskMod:
    def mod(b, h, q, kv):
        return q >= kv

    return mod


def bidirectional() -> MaskMod:
    def mod(b, h, q, kv):
        return torch.ones_like(q >= kv)

    return mod


def key_padding(key_valid_BL: torch.Tensor) -> MaskMod:
    def mod(b, h, q, kv):
        return key_valid_BL[b, kv]

    return mod


def same_document(doc_ids_BL: torch.Tensor) -> MaskMod:
    def mod(b, h, q, kv):
        return doc_ids_BL[b, q] == doc_ids_BL[b, kv]

    return mod


def and_masks(*mods: MaskMod) -> MaskMod:
    def mod(b, h, q, kv):
        out = mods[0](b, h, q, kv)
        for m in mods[1:]:
            out = out & m(b, h, q, kv)
        return out

    return mod


def mask_mod(mask: AttentionMask) -> MaskMod:
    """The mask function of a description (base pattern AND document AND padding)."""
    mods = [causal() if mask.kind == "causal" else bidirectional()]
    if mask.doc_ids_BL is not None:
        mods.append(same_document(mask.doc_ids_BL))
    if mask.key_valid_BL is not None:
        mods.append(key_padding(mask.key_valid_BL))
    return mods[0] if len(mods) == 1 else and_masks(*mods)


def dense_mask(mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Evaluate a mask function on every (b, q, kv): bool [B, 1, Lq, Lk] (broadcast over heads)."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device)[None, None, :, None]
    kv = torch.arange(kv_len, device=device)[None, None, None, :]
    return mod(b, h, q, kv).expand(batch, 1, q_len, kv_len)
