"""DiffusionGemma's canvas decoding (sampling/canvas_denoiser.py) against transformers' generation mixin:
the same keyed random draws (initial canvases, re-noising and, when sampling, the proposals) give the
same sequences, greedily and sampled, over two canvases after left-padded prompts; the entropy-bound
acceptance and the stopping rule on their own."""

from __future__ import annotations

import pytest
import torch

from dllm.config.sampler import CanvasDenoiserConfig
from dllm.sampling.canvas_denoiser import StableAndConfident, denoise_canvases, entropy_bound_accept
from tests.unit.test_diffusion_gemma import C, P, V, _inputs, pair  # noqa: F401 (the pair fixture)

PAD, EOS, SEED = 0, 27, 11  # EOS: an id these canvases produce, so rows end (and are padded) mid-way


def _reference_generate(hf, x: dict[str, torch.Tensor], cfg: CanvasDenoiserConfig) -> torch.Tensor:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    torch.manual_seed(SEED)
    out = hf.generate(
        input_ids=x["clean"], attention_mask=x["valid"], max_new_tokens=cfg.max_new_tokens,
        max_denoising_steps=cfg.max_denoising_steps, t_min=cfg.t_min, t_max=cfg.t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=cfg.entropy_bound),
        stability_threshold=cfg.stability_threshold, confidence_threshold=cfg.confidence_threshold,
        pad_token_id=PAD, eos_token_id=EOS,
    )  # fmt: skip
    return out.sequences


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("entropy_bound", [0.1, 10.0])  # one token a step (entropies ~4), or about three
# never stopping early; or rows stopping at different steps (mean entropies fall below 4.05 at steps 4 and 5)
@pytest.mark.parametrize("stability,confidence", [(1, 2.0), (0, 4.05)])
@pytest.mark.parametrize("cache", [True, False])  # the clean rows' keys and values kept, or recomputed each step
def test_sequences_match_the_generation_mixin(pair, monkeypatch, greedy, entropy_bound, stability, confidence, cache):  # noqa: F811
    hf, ours, _ = pair
    cfg = CanvasDenoiserConfig(canvas_length=C, max_new_tokens=2 * C, max_denoising_steps=6, greedy=greedy,
                               entropy_bound=entropy_bound, stability_threshold=stability,
                               confidence_threshold=confidence, cache=cache)  # fmt: skip
    x = _inputs(padded=True)
    if greedy:  # the reference always samples its proposals: greedy is its argmax (no random draw)
        monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples, **kw: probs.argmax(-1, keepdim=True))
    want = _reference_generate(hf, x, cfg)
    prompts = [row[valid].tolist() for row, valid in zip(x["clean"], x["valid"], strict=True)]
    got = denoise_canvases(ours, prompts, cfg, pad_id=PAD, eos_id=EOS, num_tokens=V,
                           generator=torch.Generator().manual_seed(SEED))  # fmt: skip
    assert got.shape == want.shape == (2, P + 2 * C)
    assert torch.equal(got, want), (got, want)


def test_entropy_bound_and_stopping():
    logits = torch.tensor([[[9.0, 0, 0], [0, 0, 0], [5.0, 0, 0], [0.5, 0, 0]]])  # entropies low to high: 0, 2, 3, 1
    h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)[0]
    assert entropy_bound_accept(logits, 1e-9).tolist() == [[True, False, False, False]]
    bound = float(h[0] + h[2]) + 1e-6  # the three lowest: their sum less the largest
    assert entropy_bound_accept(logits, bound).tolist() == [[True, False, True, True]]
    stop = StableAndConfident(stability=1, confidence=0.5)
    argmax, sure = torch.tensor([[0, 0, 0, 0]]), torch.tensor([[[20.0, 0, 0]] * 4])
    assert stop(argmax, sure).tolist() == [False]  # nothing seen before: not yet stable
    assert stop(argmax, logits).tolist() == [False]  # stable, but unsure on average
    assert stop(argmax, sure).tolist() == [True]  # stable and sure
    assert stop(argmax + 1, sure).tolist() == [False]  # changed
