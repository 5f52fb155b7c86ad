"""The Runner: THE model call of sampling, with its attention masks, KV-cache slices and guidance.

Model calls: the whole canvas (no cache); the active block and everything after it against a cached
prefix (prefix cache), only the active block against cached prefix and suffix (dual cache), both
refreshed by a full forward at each block start or every `refresh_every` steps; for block models the
canvas up to the active block under the block-causal mask (no cache), or with the exact block cache
only the active block (plus the previous block's clean tokens once, whose keys are then final).
Shifted models (position i predicted from hidden i-1) run one extra query row before the slice.

Shapes: B batch, T canvas, V vocabulary, Q query rows.
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.registries import CACHES
from dllm.config.sampler import SamplerConfig
from dllm.errors import ConfigError
from dllm.sampling.cache import CacheMode, KVCache
from dllm.sampling.canvas import Canvas, SpecialIds
from dllm.sampling.causal import keeps_recurrent_state
from dllm.sampling.results import Counters


class Runner:
    """Runs the model for the predictions of a canvas region, with the configured cache.

    `shift` is the sampler's resolved shift (from the decode profile): the model returns unshifted
    states, and the runner reads row i-1 for position i across cache slices itself."""

    def __init__(self, model: torch.nn.Module, canvas: Canvas, cfg: SamplerConfig, special: SpecialIds,
                 shift: bool, counters: Counters) -> None:  # fmt: skip
        if keeps_recurrent_state(model) and not canvas.block_attention:
            raise ConfigError("sampler.attention: a model with linear-attention layers decodes a canvas block by "
                              "block (the prompt read causally); set attention: block")  # fmt: skip
        self.model, self.canvas, self.cfg, self.special = model, canvas, cfg, special
        self.shift, self.counters = int(shift), counters
        T = canvas.x_BT.shape[1]
        self.mode: CacheMode = CACHES.resolve(cfg.cache)()
        self.cache = KVCache(T) if self.mode.buffers else None
        if self.cache is not None:
            self._allocate(canvas.x_BT.shape[0] * (2 if cfg.cfg_scale > 0 else 1))
        self._masks: dict[tuple[int, int], AttentionMask] = {}
        self.mask_col = torch.tensor([special.mask_id], device=canvas.x_BT.device)

    def _allocate(self, rows: int) -> None:
        """The KV buffers of a native Transformer, before its compiled blocks run (others: on first write)."""
        layers, mcfg = getattr(self.model, "layers", None), getattr(self.model, "cfg", None)
        attn = getattr(layers[0], "self_attn", None) if layers else None
        if attn is None or mcfg is None:
            return
        assert self.cache is not None
        like = attn.k_proj.weight  # the keys' dtype and device
        self.cache.allocate(len(layers), (rows, mcfg.kv_heads, mcfg.dim_per_head), like)

    def mask(self, qs: int, ke: int) -> AttentionMask:
        """Queries from canvas index qs, keys [0, ke)."""
        if (qs, ke) not in self._masks:
            c = self.canvas
            valid = c.valid_BT[:, :ke]
            padded = not bool(valid.all())
            bl = c.block_length
            if c.block_attention and not padded and qs // bl == (ke - 1) // bl:
                # every query is in the last key block: block-causal allows all keys (no mask to build)
                m = AttentionMask("bidirectional", query_offset=qs)
            elif c.block_attention:
                docs = valid.long() if padded else None  # padding is its own document
                causal = self.cfg.causal_context == "on"  # committed blocks read causally (Nemotron-Labs-Diffusion)
                m = AttentionMask(
                    "block_causal", doc_ids_BL=docs, block_size=bl, query_offset=qs, causal_context=causal
                )
            else:
                m = AttentionMask("bidirectional", key_valid_BL=valid if padded else None, query_offset=qs)
            self._masks[(qs, ke)] = m
        return self._masks[(qs, ke)]

    def forward(self, x_BT: torch.Tensor, qs: int, qe: int, ke: int, rows: slice = slice(None)) -> torch.Tensor:
        """Raw (unshifted) logits [B, R, V] of the query rows `rows` (indices into [qs, qe)) of canvas rows
        [qs, qe) attending to keys [0, ke); the head runs on those rows only.

        The one place sampling calls the model. Classifier-free guidance (Ho & Salimans 2022; the
        prompt masked as in LLaDA, Nie et al. 2025) runs as one batched call: conditional rows, then
        the same rows with the prompt masked; logits = uncond + (1 + w) * (cond - uncond)."""
        kwargs: dict = {}
        if self.cache is not None:
            kwargs["cache"] = self.cache.at(qs, ke)
            self.counters.cached_tokens += x_BT.shape[0] * (ke - (qe - qs))
        tokens, positions, mask = x_BT[:, qs:qe], self.canvas.positions_BT[:, qs:qe], self.mask(qs, ke)
        w = self.cfg.cfg_scale
        if w > 0:
            uncond = torch.where(self.canvas.prompt_BT[:, qs:qe], self.special.mask_id, tokens)
            tokens, positions, mask = torch.cat([tokens, uncond]), positions.repeat(2, 1), _twice(mask)
        out = self.model(tokens, positions, mask, **kwargs)
        self.counters.nfe += 1
        self.counters.query_tokens += tokens.numel()
        if w <= 0:  # the mask token is never a prediction
            return out.token_logits(out.hidden_BLE[:, rows], self.mask_col)
        cond, unc = out.token_logits(out.hidden_BLE[:, rows]).chunk(2)
        return (unc + (1 + w) * (cond - unc)).index_fill(-1, self.mask_col, float("-inf"))

    def predict(self, x_BT: torch.Tensor, lo: int, hi: int, refresh: bool) -> torch.Tensor:
        """Logits [B, hi - lo, V] predicting canvas positions [lo, hi) (the active block).

        `refresh`: the first step of a block, or a scheduled refresh of an approximate cache."""
        T, s = x_BT.shape[1], self.shift
        qs, qe, ke = self.mode.window(lo, hi, T, s, refresh, self.canvas.block_attention)
        return self.forward(x_BT, qs, qe, ke, slice(lo - s - qs, hi - s - qs))


def _twice(mask: AttentionMask) -> AttentionMask:
    """The same description for a batch stacked twice (classifier-free guidance)."""

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat(2, 1)

    return AttentionMask(mask.kind, key_valid_BL=rep(mask.key_valid_BL), doc_ids_BL=rep(mask.doc_ids_BL),
                         block_size=mask.block_size, window=mask.window, query_offset=mask.query_offset,
                         causal_context=mask.causal_context)  # fmt: skip
