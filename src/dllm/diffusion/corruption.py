"""Per-sample keyed noise and the masking corruption.

Noise is keyed by (seed, purpose, sample id) rather than drawn from one stateful generator: a sample
gets the same noise whatever the number of ranks, the micro-batch split or a resume in between, so
a 2-process run reproduces the 1-process loss and a resumed run reproduces the uninterrupted one.

A sample's row is `torch.rand(shape)` from a CPU generator seeded with its key (torch's MT19937
keeps the key's low 32 bits). The keys of a batch are mixed in one vectorised call; the rows are
then drawn one by one by torch's own generator into one tensor. Drawing them batched as well
(torch's MT19937 over [B, 624] states in NumPy) is bit-identical but slower: its seeding alone is
623 dependent steps of four vector ops, more than torch's C++ takes to seed and draw a whole batch
(bench/noise_keys.py measures the three ways).

Shapes: B samples, L positions, K blocks, X the `shape` asked of `uniform` per sample.
"""

from __future__ import annotations

import zlib

import torch

from dllm.seeding import mix_keys


class NoiseKeys:
    """Random streams keyed by sample: `uniform` per position, `stratified_time` per sequence."""

    def __init__(self, seed: int, group_size: int) -> None:
        self.seed = seed
        self.group_size = group_size  # samples that share one stratification (the global batch)

    def keys(self, sample_ids_B: torch.Tensor, purpose: str) -> list[int]:
        """The generator seed of each sample for `purpose`: mix_key(seed, crc32(purpose), sample id)."""
        ids_B = sample_ids_B.detach().cpu().numpy()
        return mix_keys(self.seed, zlib.crc32(purpose.encode()), ids=ids_B).tolist()

    def uniform(self, sample_ids_B: torch.Tensor, shape: tuple[int, ...], purpose: str) -> torch.Tensor:
        """U[0, 1) of shape [B, *shape], float32, on the device of `sample_ids_B`."""
        u_BX = torch.empty((len(sample_ids_B), *shape))
        g = torch.Generator(device="cpu")
        for key, row_X in zip(self.keys(sample_ids_B, purpose), u_BX.unbind(0), strict=True):
            g.manual_seed(key)
            row_X.uniform_(generator=g)  # the draws of torch.rand(shape, generator=g), in place
        return u_BX.to(sample_ids_B.device)

    def stratified_time(self, sample_ids_B: torch.Tensor, purpose: str, antithetic: bool) -> torch.Tensor:
        """U[0, 1) per sample; with `antithetic`, the samples of one group are evenly spaced
        (t_i = frac(u_g + i / G)), the low-discrepancy sampler of Kingma et al. 2021 (VDM)."""
        if not antithetic:
            return self.uniform(sample_ids_B, (), purpose)
        G = self.group_size
        groups = torch.div(sample_ids_B, G, rounding_mode="floor")
        u_g = self.uniform(groups, (), purpose)
        return torch.remainder(u_g + (sample_ids_B % G).float() / G, 1.0)

    def stratified_blocks(
        self, sample_ids_B: torch.Tensor, num_blocks: int, purpose: str, antithetic: bool
    ) -> torch.Tensor:
        """U[0, 1) per (sample, block) [B, K]; with `antithetic` the G*K values of a group are evenly
        spaced (BD3LM draws t per block and stratifies over batch x blocks)."""
        if not antithetic:
            return self.uniform(sample_ids_B, (num_blocks,), purpose)
        G, K = self.group_size, num_blocks
        groups = torch.div(sample_ids_B, G, rounding_mode="floor")
        u_g = self.uniform(groups, (), purpose)
        stratum_BK = (sample_ids_B % G)[:, None] * K + torch.arange(K, device=sample_ids_B.device)[None, :]
        return torch.remainder(u_g[:, None] + stratum_BK.float() / (G * K), 1.0)


def uniform_token_ids(u_BL: torch.Tensor, num_tokens: int, exclude_id: int) -> torch.Tensor:
    """Ids uniform over [0, num_tokens) without `exclude_id` (the mask token), from U[0, 1) noise."""
    ids = (u_BL * (num_tokens - 1)).long().clamp_max(num_tokens - 2)
    return ids + (ids >= exclude_id).long()


def corrupt_tokens(
    tokens_BL: torch.Tensor,
    eligible_BL: torch.Tensor,
    p_BL: torch.Tensor,
    u_BL: torch.Tensor,
    replacement_BL: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each eligible token with its replacement with probability p (per position).

    Returns (noised tokens, corrupted positions). The replacement is the mask id (absorbing state,
    MDLM) or a random token (uniform state)."""
    hit_BL = (u_BL < p_BL) & eligible_BL
    return torch.where(hit_BL, replacement_BL, tokens_BL), hit_BL


def mask_tokens(
    tokens_BL: torch.Tensor,
    eligible_BL: torch.Tensor,
    p_mask_B: torch.Tensor,
    u_BL: torch.Tensor,
    mask_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace each eligible token by `mask_id` with probability p_mask of its row.

    Returns (noised tokens, masked positions)."""
    masked_BL = (u_BL < p_mask_B[:, None]) & eligible_BL
    return torch.where(masked_BL, torch.full_like(tokens_BL, mask_id), tokens_BL), masked_BL
