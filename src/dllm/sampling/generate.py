"""THE sampling loop: semi-autoregressive masked-diffusion decoding (LLaDA, Nie et al. 2025, Alg. 5).

The canvas is [prompt ; gen_length masks]. Blocks of `block_length` are decoded left to right; each
block gets steps / num_blocks model calls, and each call commits a fixed number of its masked
positions chosen by the policy. The loop counts forward passes (NFE) and never returns a mask.

Shapes: B batch, L canvas length, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.spec import SamplerConfig
from dllm.sampling.policies import POLICIES, select_topk


@dataclass(frozen=True)
class SpecialIds:
    mask_id: int
    pad_id: int
    eos_id: int


@dataclass
class GenerationResult:
    sequences: list[list[int]]
    """Generated ids per prompt (after EOS truncation when stop_at_eos)."""
    canvas_BL: torch.Tensor
    """The whole final canvas, prompts included (left-padded)."""
    nfe: int
    """Model forward passes."""
    tokens_committed: int
    """Positions unmasked over the whole call (all rows)."""

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens_committed / max(self.nfe, 1)


def commit_schedule(num_masked_B: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] tokens to commit per step: an even split, the remainder to the first steps."""
    base = torch.div(num_masked_B, steps, rounding_mode="floor")
    rem = num_masked_B % steps
    sched = base[:, None].expand(-1, steps).clone()
    sched += (torch.arange(steps, device=num_masked_B.device)[None, :] < rem[:, None]).long()
    return sched


def propose(
    logits_BLV: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposed token per position and its probability under the model.

    With temperature > 0 the token is argmax(logits / T + Gumbel) in float64: low-precision Gumbel
    noise measurably biases sampling (LLaDA, appendix B.4)."""
    logits = logits_BLV.double()
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        x0_BL = (logits / temperature + gumbel).argmax(-1)
    else:
        x0_BL = logits.argmax(-1)
    probs = torch.softmax(logits, dim=-1)
    return x0_BL, probs.gather(-1, x0_BL[..., None]).squeeze(-1)


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


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    cfg: SamplerConfig,
    special: SpecialIds,
    *,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    device = next(model.parameters()).device
    policy = POLICIES.get(cfg.policy)()
    prompt_ids, prompt_valid = left_pad(prompts, special.pad_id, device)
    B, P = prompt_ids.shape
    G = cfg.gen_length
    x = torch.cat([prompt_ids, torch.full((B, G), special.mask_id, dtype=torch.long, device=device)], dim=1)
    valid = torch.cat([prompt_valid, torch.ones((B, G), dtype=torch.bool, device=device)], dim=1)
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    mask = AttentionMask("bidirectional", key_valid_BL=None if bool(valid.all()) else valid)
    num_blocks = G // cfg.block_length
    steps_per_block = cfg.steps // num_blocks
    mask_col = torch.tensor([special.mask_id], device=device)
    nfe = committed = 0
    finished = False
    for blk in range(num_blocks):
        lo, hi = P + blk * cfg.block_length, P + (blk + 1) * cfg.block_length
        in_block = torch.zeros_like(valid)
        in_block[:, lo:hi] = True
        sched = commit_schedule(((x == special.mask_id) & in_block).sum(-1), steps_per_block)
        for step in range(steps_per_block):
            logits = model(x, positions, mask).float()
            nfe += 1
            # the mask token is never a prediction (out of place: the model's output stays intact)
            logits = logits.index_fill(-1, mask_col, float("-inf"))
            x0, p_x0 = propose(logits, cfg.temperature, generator)
            eligible = (x == special.mask_id) & in_block
            commit = select_topk(policy.scores(p_x0, generator), eligible, sched[:, step])
            x = torch.where(commit, x0, x)
            committed += int(commit.sum())
            finished = cfg.stop_at_eos and _all_rows_ended(x[:, P:], special)
            if finished:
                break
        if finished:
            # everything after each row's first EOS is cut from the output anyway
            x = torch.where(x == special.mask_id, special.eos_id, x)
            break
    assert not bool((x == special.mask_id).any()), "the schedule commits every masked position"
    return GenerationResult(_outputs(x[:, P:], cfg.stop_at_eos, special.eos_id), x, nfe, committed)


def _all_rows_ended(gen_BL: torch.Tensor, special: SpecialIds) -> bool:
    """Every row has an EOS with no mask left before it (its output can no longer change)."""
    is_eos = gen_BL == special.eos_id
    first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), gen_BL.shape[1])
    before = torch.arange(gen_BL.shape[1], device=gen_BL.device)[None, :] < first_eos[:, None]
    undecided = ((gen_BL == special.mask_id) & before).any(-1)
    return bool((is_eos.any(-1) & ~undecided).all())


def _outputs(gen_BL: torch.Tensor, stop_at_eos: bool, eos_id: int) -> list[list[int]]:
    out = []
    for row in gen_BL.tolist():
        if stop_at_eos and eos_id in row:
            row = row[: row.index(eos_id)]
        out.append(row)
    return out
