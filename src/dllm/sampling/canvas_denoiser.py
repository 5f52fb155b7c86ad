"""DiffusionGemma's canvas decoding (generation canvas_denoise): the loop of transformers'
DiffusionGemmaGenerationMixin on the native model (`Denoiser`, a request the inference engine steps).

Canvases of `block_length` tokens (the model's canvas length, from its decode profile) are decoded one
after another after the prompt, gen_length / block_length of them. A canvas starts as uniformly random
ids. Each denoising step (n = N, ..., 1 steps left, N = steps / number of canvases) runs the model once
over [clean ; canvas] under the prefix_canvas mask (the clean rows: the prompt and the canvases decoded
so far; with `denoise_cache`, like the reference's encoder cache, clean rows run once, with the first
step after them, and later steps run only the canvas rows against their cached keys and values), divides
the canvas logits by the temperature t_min + (t_max - t_min) * n / N, proposes a token per position (a
sample at temperature 1, the argmax at temperature 0), accepts the proposals at the lowest-entropy
positions while their entropies less the largest sum to at most `denoise_entropy_bound` (entropy-bounded
sampling, Ben-Hamu et al. 2025, arXiv:2505.24857), re-noises the rest with fresh uniform ids, and hands
the tempered logits to the next step as self-conditioning. A row stops denoising once its argmax canvas
is stable and confident (`StableAndConfident`); then every row's argmax canvas joins the clean stream.
After a canvas holding EOS the row's later tokens are padding (with stop_at_eos), and decoding ends when
every row has ended (EOS, or a stop string).

The loop counts with the `Counters` of every loop (one forward per step for the batch; cached_tokens:
clean keys read from the cache) and shows each step as a `StepEvent`: the decided sequence (prompt and
finished canvases, masks after them) and, as the draft, the current canvas's argmax (results.py).

Shapes: B batch, P clean length, C canvas, V vocabulary, T prompt and every canvas.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.sampler import SamplerConfig
from dllm.models.output import CanvasConditioned
from dllm.sampling.cache import KVCache
from dllm.sampling.canvas import SpecialIds, left_pad
from dllm.sampling.compiled import compile_blocks
from dllm.sampling.results import OWN_STEP, Counters, GenerationResult, OwnStep, StepEvent


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


def canvas_logits(
    model: torch.nn.Module, clean_BP: torch.Tensor, valid_BP: torch.Tensor, canvas_BC: torch.Tensor,
    previous_BCV: torch.Tensor | None, cache: KVCache | None, counters: Counters,
) -> torch.Tensor:  # fmt: skip
    """The model's (soft-capped) logits for the canvas rows after the clean stream: the loop's one model
    call. With `cache`, the clean rows from `cache.query_start` on run (their keys and values are
    written) and earlier ones are read."""
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
    counters.nfe += 1
    counters.query_tokens += tokens.numel()
    counters.cached_tokens += B * start
    return out.token_logits(out.hidden_BLE[:, P - start :])  # the head on the canvas rows only


def denoise_step(
    model: torch.nn.Module, clean_BP: torch.Tensor, valid_BP: torch.Tensor, canvas_BC: torch.Tensor,
    previous_BCV: torch.Tensor | None, steps_left: int, num_steps: int, cfg: SamplerConfig, num_tokens: int,
    generator: torch.Generator | None, cache: KVCache | None, counters: Counters,
) -> Step:  # fmt: skip
    """One step of the reference's `_denoising_step`: propose, accept by the entropy bound, re-noise."""
    temperature = cfg.denoise_t_min + (cfg.denoise_t_max - cfg.denoise_t_min) * steps_left / num_steps
    logits = canvas_logits(model, clean_BP, valid_BP, canvas_BC, previous_BCV, cache, counters) / temperature
    argmax = logits.argmax(-1)
    if cfg.temperature == 0:  # greedy proposals (resolve_sampler allows 0 or 1)
        proposal = argmax
    else:
        probs = torch.softmax(logits, dim=-1).view(-1, logits.shape[-1])
        proposal = torch.multinomial(probs, 1, generator=generator).view_as(argmax)
    accepted = entropy_bound_accept(logits, cfg.denoise_entropy_bound)
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


class Denoiser:
    """One request: the clean stream (prompts and decoded canvases), the cache, the counters, and the loop
    (`decode`: its steps, each running its own forward). It decodes gen_length / block_length canvases after
    the left-padded prompts (`cfg` resolved: generation canvas_denoise). The result's canvas is [B, P + k * C]
    (k canvases, fewer when every row ended early), as the reference's sequences; each sequence is a row's
    tokens after its prompt, cut at its first EOS with stop_at_eos. Random canvases draw from the model's
    vocabulary (`special.num_tokens`: the decode profile's, which is the model's)."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds,
                 generator, callback, stop) -> None:  # fmt: skip
        assert cfg.generation == "canvas_denoise", "resolve the sampler first (config.sampler.resolve_sampler)"
        if cfg.compile:
            compile_blocks(model)
        self.model, self.cfg, self.special = model, cfg, special
        self.generator, self.callback, self.stop = generator, callback, stop
        self.num_tokens = special.num_tokens or model.cfg.vocab_size
        self.eos_id = special.eos_id if cfg.stop_at_eos else None
        self.counters = Counters(loop="canvas_denoise")
        device = next(model.parameters()).device
        self.clean_BP, self.valid_BP = left_pad(prompts, special.pad_id, device)
        self.prompt_len = self.clean_BP.shape[1]
        self.num_steps = cfg.total_steps // cfg.num_blocks  # N: per canvas
        total = self.prompt_len + cfg.gen_length
        self.cache = KVCache(total) if cfg.denoise_cache else None

    @property
    def rows(self) -> int:
        return self.clean_BP.shape[0]

    def decode(self) -> Generator[OwnStep, None, GenerationResult]:
        ended_B = torch.zeros(self.clean_BP.shape[0], dtype=torch.bool, device=self.clean_BP.device)
        for k in range(self.cfg.num_blocks):
            argmax_BC = yield from self.decode_canvas(k)
            new_BC, ended_B = end_rows(argmax_BC, ended_B, self.eos_id, self.special.pad_id)
            self.clean_BP = torch.cat([self.clean_BP, new_BC], dim=1)
            self.valid_BP = F.pad(self.valid_BP, (0, new_BC.shape[1]), value=True)
            if self.all_rows_ended(ended_B):
                break
        return self.result()

    def decode_canvas(self, k: int) -> Generator[OwnStep, None, torch.Tensor]:
        """The argmax canvas [B, C] of canvas k's denoising loop after the clean stream (OWN_STEP before a step)."""
        cfg, clean, valid = self.cfg, self.clean_BP, self.valid_BP
        shape = (clean.shape[0], cfg.block)
        canvas = torch.randint(0, self.num_tokens, shape, generator=self.generator, device=clean.device)
        argmax, previous = canvas, None
        done = torch.zeros(shape[0], dtype=torch.bool, device=clean.device)
        stop = StableAndConfident(cfg.denoise_stability_threshold, cfg.denoise_confidence_threshold)
        for n in range(self.num_steps, 0, -1):
            yield OWN_STEP
            step = denoise_step(self.model, clean, valid, canvas, previous, n, self.num_steps, cfg, self.num_tokens,
                                self.generator, self.cache, self.counters)  # fmt: skip
            keep = done[:, None]  # rows already done keep their canvas, argmax and logits
            canvas = torch.where(keep, canvas, step.canvas_BC)
            argmax = torch.where(keep, argmax, step.argmax_BC)
            previous = step.logits_BCV if previous is None else torch.where(keep[..., None], previous, step.logits_BCV)
            self.show(k, self.num_steps - n, argmax, step.accepted_BC & ~keep)
            done |= stop(argmax, previous)
            if bool(done.all()):
                break
        return argmax

    def show(self, k: int, step: int, argmax_BC: torch.Tensor, accepted_BC: torch.Tensor) -> None:
        """Count a step and show it: the decided sequence (masks from canvas k on) and, as the draft, canvas
        k's argmax; the committed positions are the proposals accepted at this step."""
        self.counters.steps += 1
        if self.callback is None:
            return
        B, P = self.clean_BP.shape
        decided = torch.full((B, self.prompt_len + self.cfg.gen_length), self.special.mask_id, device=argmax_BC.device)
        decided[:, :P] = self.clean_BP
        draft = decided.clone()
        draft[:, P : P + argmax_BC.shape[1]] = argmax_BC
        committed = torch.zeros_like(decided, dtype=torch.bool)
        committed[:, P : P + argmax_BC.shape[1]] = accepted_BC
        gen_start = [self.prompt_len] * B
        self.callback(StepEvent(decided, committed, k, step, gen_start, self.special.mask_id, draft_BT=draft))

    def all_rows_ended(self, ended_B: torch.Tensor) -> bool:
        """Every row has its EOS (with stop_at_eos) or a stop string in its tokens so far."""
        if self.stop is not None and not bool(ended_B.all()):
            rows = self.clean_BP[:, self.prompt_len :].tolist()
            ended_B = ended_B | torch.tensor([self.stop(r) for r in rows], device=ended_B.device)
        return bool(ended_B.all())

    def result(self) -> GenerationResult:
        """Each row's tokens after its prompt (at most gen_length, cut at its first EOS with stop_at_eos); the
        tokens decoded count each row's output up to its end, EOS included."""
        sequences, committed = [], 0
        for row in self.clean_BP[:, self.prompt_len :].tolist():
            out = row[: self.cfg.gen_length]
            if self.eos_id is not None and self.eos_id in out:
                out = out[: out.index(self.eos_id)]
                committed += 1
            sequences.append(out)
            committed += len(out)
        self.counters.tokens_committed = committed
        gen_start = [self.prompt_len] * len(sequences)
        return GenerationResult(sequences, self.clean_BP, self.counters, gen_start)


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
