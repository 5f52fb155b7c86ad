"""The canvas: [prompt ; gen_length masks] per row, and the blocks decoded left to right.

Layouts:
- bidirectional models: prompts left-padded to a common length P; blocks of `block_length` start at P.
- block models (attention: block): blocks are aligned to positions counted from each prompt's start,
  as in training, so a prompt that ends inside a block shares it with the first generated tokens.
  Rows are left-padded by whole blocks; a row's own tail past its gen_length is padding.
  Padding is a separate "document" for the mask (it sees only padding; real tokens never see it).

Shapes: B batch, T canvas, P prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig


@dataclass(frozen=True)
class SpecialIds:
    mask_id: int
    pad_id: int
    eos_id: int
    num_tokens: int | None = None
    """Ids the tokenizer can produce (uniform-state decoding draws random tokens from them)."""

    @classmethod
    def of(cls, profile: DecodeProfile) -> SpecialIds:
        """The ids a model's decode profile records."""
        return cls(profile.mask_id, profile.pad_id, profile.eos_id, profile.num_tokens)


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts right-aligned in one [B, P] tensor, and which positions are real."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long, device=device)
            valid[i, P - len(p) :] = True
    return ids, valid


@dataclass
class Canvas:
    x_BT: torch.Tensor
    valid_BT: torch.Tensor
    """Real tokens (prompt and generated positions); False at padding."""
    prompt_BT: torch.Tensor
    gen_BT: torch.Tensor
    """Positions to generate."""
    positions_BT: torch.Tensor
    blocks: list[tuple[int, int]]
    gen_start_B: list[int]
    block_attention: bool
    block_length: int

    @staticmethod
    def build(
        prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds, block_attention: bool, device,
        shift: bool = False,
    ) -> Canvas:  # fmt: skip
        """`shift`: a shifted block model reads the row before the first active block, so that block
        never starts at canvas index 0 (one more block of padding when it would)."""
        B, G, bl = len(prompts), cfg.gen_length, cfg.block
        lens = [len(p) for p in prompts]
        if block_attention:  # whole blocks of left padding: blocks stay aligned to each prompt's start
            A = max(-(-n // bl) * bl for n in lens)
            if shift and min(lens) < bl:  # some row's first active block would start at index 0
                A += bl
            starts = [A - (-(-n // bl) * bl) for n in lens]
            T = -(-max(s + n + G for s, n in zip(starts, lens, strict=True)) // bl) * bl
        else:
            P = max(lens)
            starts, T = [P - n for n in lens], P + G
        x = torch.full((B, T), special.pad_id, dtype=torch.long, device=device)
        prompt = torch.zeros((B, T), dtype=torch.bool, device=device)
        gen = torch.zeros_like(prompt)
        for i, (s, p) in enumerate(zip(starts, prompts, strict=True)):
            if p:
                x[i, s : s + len(p)] = torch.tensor(p, dtype=torch.long, device=device)
            prompt[i, s : s + len(p)] = True
            gen[i, s + len(p) : s + len(p) + G] = True
        x = torch.where(gen, special.mask_id, x)
        valid = prompt | gen
        positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
        gen_start = [s + n for s, n in zip(starts, lens, strict=True)]
        if block_attention:
            first = min(gen_start) // bl * bl
            blocks = [(lo, lo + bl) for lo in range(first, T, bl)]
        else:
            blocks = [(T - G + k * bl, T - G + (k + 1) * bl) for k in range(G // bl)]
        return Canvas(x, valid, prompt, gen, positions, blocks, gen_start, block_attention, bl)
