"""DiffusionGemma's canvas decoding: the loop of transformers' DiffusionGemmaGenerationMixin, on the native model.

Canvases of `canvas_length` tokens are decoded one after another after the prompt. A canvas starts as
uniformly random ids. Each denoising step (n = N, ..., 1 steps left) runs the model once over
[clean ; canvas] under the prefix_canvas mask (the clean rows: the prompt and the canvases decoded so
far; with `cache`, like the reference's encoder cache, clean rows run once, with the first step after
them, and later steps run only the canvas rows against their cached keys and values), divides the
canvas logits by the temperature t_min + (t_max - t_min) * n / N, proposes a token per position (a
sample, or the argmax when greedy), accepts the proposals at the lowest-entropy positions while their
entropies less the largest sum to at most `entropy_bound` (entropy-bounded sampling, Ben-Hamu et al.
2025, arXiv:2505.24857), re-noises the rest with fresh uniform ids, and hands the tempered logits to
the next step as self-conditioning. A row stops denoising once its argmax canvas is stable and
confident (`StableAndConfident`); then every row's argmax canvas joins the clean stream. After a canvas
holding EOS the row's later tokens are padding, and decoding ends when every row has ended.

Shapes: B batch, P clean length, C canvas, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.sampler import CanvasDenoiserConfig
from dllm.models.output import CanvasConditioned
from dllm.sampling.cache import KVCache
from dllm.sampling.canvas import left_pad


@dataclass(frozen=True)
class Step:
    """One denoising step's result: the next canvas, the argmax canvas, the tempered logits (the next
    step's self-conditioning) and the accepted positions."""

    canvas_BC: torch.Tensor
    argmax_BC: torch.Tensor
    logits_BCV: torch.Tensor
    accepted_BC: torch.Tensor


def entropies(logits_BCV: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution [B, C]."""
    logp = F.log_softmax(logits_BCV.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def entropy_bound_accept(logits_BCV: torch.Tensor, bound: float) -> torch.Tensor:
    """Bool [B, C]: the k lowest-entropy positions with sum(entropy_1..k) - max(entropy_1..k) <= bound
    (at least one: a single position's sum less its maximum is 0)."""
    h_sorted, order = entropies(logits_BCV).sort(dim=-1)
    keep_sorted = h_sorted.cumsum(-1) - h_sorted <= bound  # sorted ascending: the running maximum is the last
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def canvas_logits(model: torch.nn.Module, clean_BP: torch.Tensor, valid_BP: torch.Tensor, canvas_BC: torch.Tensor,
                  previous_BCV: torch.Tensor | None, cache: KVCache | None = None) -> torch.Tensor:  # fmt: skip
    """The model's (soft-capped) logits for the canvas rows after the clean stream. With `cache`, the clean
    rows from `cache.query_start` on run (their keys and values are written) and earlier ones are read."""
    B, P = clean_BP.shape
    C = canvas_BC.shape[1]
    start = 0 if cache is None else cache.query_start
    tokens = torch.cat([clean_BP[:, start:], canvas_BC], dim=1)
    key_valid = torch.cat([valid_BP, torch.ones_like(canvas_BC, dtype=torch.bool)], dim=1)
    mask = AttentionMask("prefix_canvas", key_valid_BL=None if bool(key_valid.all()) else key_valid,
                         block_size=C, num_clean=P, canvas_start=P, query_offset=start)  # fmt: skip
    inputs = tokens if previous_BCV is None else CanvasConditioned(tokens, previous_BCV)
    positions = torch.arange(start, P + C, device=tokens.device).expand(B, -1)
    out = model(inputs, positions, mask, cache=None if cache is None else cache.at(start, P + C))
    if cache is not None:
        cache.query_start = P  # the clean rows' keys and values are final
    return out.logits()[:, P - start :].float()


def denoise_step(
    model: torch.nn.Module, clean_BP: torch.Tensor, valid_BP: torch.Tensor, canvas_BC: torch.Tensor,
    previous_BCV: torch.Tensor | None, steps_left: int, cfg: CanvasDenoiserConfig, num_tokens: int,
    generator: torch.Generator | None = None, cache: KVCache | None = None,
) -> Step:  # fmt: skip
    """One step of the reference's `_denoising_step`: propose, accept by the entropy bound, re-noise."""
    temperature = cfg.t_min + (cfg.t_max - cfg.t_min) * steps_left / cfg.max_denoising_steps
    logits = canvas_logits(model, clean_BP, valid_BP, canvas_BC, previous_BCV, cache) / temperature
    argmax = logits.argmax(-1)
    if cfg.greedy:
        proposal = argmax
    else:
        probs = torch.softmax(logits, dim=-1).view(-1, logits.shape[-1])
        proposal = torch.multinomial(probs, 1, generator=generator).view_as(argmax)
    accepted = entropy_bound_accept(logits, cfg.entropy_bound)
    noise = torch.randint(0, num_tokens, canvas_BC.shape, generator=generator, device=canvas_BC.device)
    return Step(torch.where(accepted, proposal, noise), argmax, logits, accepted)


class StableAndConfident:
    """A row is done when its argmax canvas equals each of the last `stability` ones and the mean entropy
    of its tempered logits is below `confidence`."""

    def __init__(self, stability: int, confidence: float) -> None:
        self.stability, self.confidence = stability, confidence
        self.history: torch.Tensor | None = None

    def __call__(self, argmax_BC: torch.Tensor, logits_BCV: torch.Tensor) -> torch.Tensor:
        stable = torch.ones(argmax_BC.shape[0], dtype=torch.bool, device=argmax_BC.device)
        if self.stability:
            if self.history is None:
                self.history = torch.full((self.stability, *argmax_BC.shape), -1, device=argmax_BC.device)
            stable = (self.history == argmax_BC).all(-1).all(0)
            self.history = torch.cat([self.history[1:], argmax_BC[None]])
        return stable & (entropies(logits_BCV).mean(-1) < self.confidence)


def decode_canvas(
    model: torch.nn.Module, clean_BP: torch.Tensor, valid_BP: torch.Tensor, cfg: CanvasDenoiserConfig,
    num_tokens: int, generator: torch.Generator | None, cache: KVCache | None,
) -> torch.Tensor:  # fmt: skip
    """The argmax canvas [B, C] of one canvas's denoising loop after the clean stream."""
    shape = (clean_BP.shape[0], cfg.canvas_length)
    canvas = torch.randint(0, num_tokens, shape, generator=generator, device=clean_BP.device)
    argmax, previous = canvas, None
    done = torch.zeros(shape[0], dtype=torch.bool, device=clean_BP.device)
    stop = StableAndConfident(cfg.stability_threshold, cfg.confidence_threshold)
    for n in range(cfg.max_denoising_steps, 0, -1):
        step = denoise_step(model, clean_BP, valid_BP, canvas, previous, n, cfg, num_tokens, generator, cache)
        keep = done[:, None]  # rows already done keep their canvas, argmax and logits
        canvas = torch.where(keep, canvas, step.canvas_BC)
        argmax = torch.where(keep, argmax, step.argmax_BC)
        previous = step.logits_BCV if previous is None else torch.where(keep[..., None], previous, step.logits_BCV)
        done |= stop(argmax, previous)
        if bool(done.all()):
            break
    return argmax


@torch.inference_mode()
def denoise_canvases(
    model: torch.nn.Module, prompts: list[list[int]], cfg: CanvasDenoiserConfig, *, pad_id: int, eos_id: int | None,
    num_tokens: int, generator: torch.Generator | None = None,
) -> torch.Tensor:  # fmt: skip
    """Left-padded prompts followed by their decoded canvases [B, P + k * C]; after a row's first EOS its
    tokens are `pad_id`. `num_tokens`: the ids random canvases draw from (the reference: the vocabulary)."""
    device = next(model.parameters()).device
    clean, valid = left_pad(prompts, pad_id, device)
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    num_canvases = math.ceil(cfg.max_new_tokens / cfg.canvas_length)
    cache = KVCache(clean.shape[1] + num_canvases * cfg.canvas_length) if cfg.cache else None
    for _ in range(num_canvases):
        new = decode_canvas(model, clean, valid, cfg, num_tokens, generator, cache)
        new, ended = end_rows(new, ended, eos_id, pad_id)
        clean = torch.cat([clean, new], dim=1)
        valid = F.pad(valid, (0, new.shape[1]), value=True)
        if bool(ended.all()):
            break
    return clean


def end_rows(
    new_BC: torch.Tensor, ended_B: torch.Tensor, eos_id: int | None, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A canvas of a row that had ended is padding; in a canvas with EOS the tokens after the first are."""
    if eos_id is None:
        return new_BC, ended_B
    is_eos = new_BC == eos_id
    seen = is_eos.cumsum(-1)
    after_first = (seen > 0) & ~((seen == 1) & is_eos)
    new_BC = torch.where(ended_B[:, None] | after_first, pad_id, new_BC)
    return new_BC, ended_B | is_eos.any(-1)
