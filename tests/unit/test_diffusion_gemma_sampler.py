"""DiffusionGemma's canvas decoding (generation canvas_denoise, sampling/canvas_denoiser.py) through
`sampling.generate` against transformers' generation mixin: the same keyed random draws (initial canvases,
re-noising and, when sampling, the proposals) give the same sequences, greedily and sampled, over two
canvases after left-padded prompts; the counters and step events of a call; how a SamplerConfig maps onto
the sampler (resolve_sampler); the entropy-bound acceptance and the stopping rule on their own."""

from __future__ import annotations

import pytest
import torch

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.errors import ConfigError
from dllm.inference.engine import generate
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.canvas_denoiser import StableAndConfident, entropy_bound_accept
from tests.unit.test_diffusion_gemma import C, P, V, _inputs, pair  # noqa: F401 (the pair fixture)

PAD, EOS, MASK, SEED = 0, 27, V - 1, 11  # EOS: an id these canvases produce, so rows end (and are padded) mid-way
PROFILE = DecodeProfile(attention="prefix_canvas", block_size=C, corruption="uniform", mask_id=MASK, pad_id=PAD,
                        eos_id=EOS, num_tokens=V, max_length=64)  # fmt: skip
SPECIAL = SpecialIds.of(PROFILE)
WIDE_V = 384  # a model vocabulary larger than the byte tokenizer's 260 ids


def _sampler(**values) -> SamplerConfig:
    return resolve_sampler(SamplerConfig(**values), PROFILE)


def _reference_generate(
    hf, clean: torch.Tensor, valid: torch.Tensor, cfg: SamplerConfig, special: SpecialIds = SPECIAL
) -> torch.Tensor:
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    torch.manual_seed(SEED)
    out = hf.generate(
        input_ids=clean, attention_mask=valid, max_new_tokens=cfg.gen_length,
        max_denoising_steps=cfg.total_steps // cfg.num_blocks, t_min=cfg.denoise_t_min, t_max=cfg.denoise_t_max,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=cfg.denoise_entropy_bound),
        stability_threshold=cfg.denoise_stability_threshold, confidence_threshold=cfg.denoise_confidence_threshold,
        pad_token_id=special.pad_id, eos_token_id=special.eos_id,
    )  # fmt: skip
    return out.sequences


def _greedy_reference(monkeypatch) -> None:
    """The reference always samples its proposals: greedy is its argmax (no random draw)."""
    monkeypatch.setattr(torch, "multinomial", lambda probs, num_samples, **kw: probs.argmax(-1, keepdim=True))


def _ours(model, prompts: list[list[int]], cfg: SamplerConfig, callback=None, special: SpecialIds = SPECIAL):
    return generate(model, prompts, cfg, special, generator=torch.Generator().manual_seed(SEED), callback=callback)


SETTINGS = pytest.mark.parametrize(
    "greedy,entropy_bound,stability,confidence,cache",
    [  # entropy bound: one token a step (entropies ~4), or about three; stopping: never early, or rows
        # stopping at different steps (mean entropies fall below 4.05 at steps 4 and 5); the cache: the clean
        # rows' keys and values kept, or recomputed each step
        (greedy, bound, stability, confidence, cache)
        for greedy in (True, False) for bound in (0.1, 10.0) for stability, confidence in ((1, 2.0), (0, 4.05))
        for cache in (True, False)
    ],
)  # fmt: skip


def _check_sequences(hf, ours, special: SpecialIds, monkeypatch, greedy, entropy_bound, stability, confidence, cache):
    """Two canvases after left-padded prompts: our sequences are the generation mixin's."""
    cfg = _sampler(gen_length=2 * C, steps=12, temperature=0 if greedy else 1, denoise_entropy_bound=entropy_bound,
                   denoise_stability_threshold=stability, denoise_confidence_threshold=confidence,
                   denoise_cache=cache)  # fmt: skip
    x = _inputs(padded=True)
    if greedy:
        _greedy_reference(monkeypatch)
    clean = x["clean"].masked_fill(~x["valid"], special.pad_id)  # left padding with the pad id, as ours
    want = _reference_generate(hf, clean, x["valid"], cfg, special)
    prompts = [row[valid].tolist() for row, valid in zip(x["clean"], x["valid"], strict=True)]
    got = _ours(ours, prompts, cfg, special=special)
    assert got.canvas_BL.shape == want.shape == (2, P + 2 * C)
    assert torch.equal(got.canvas_BL, want), (got.canvas_BL, want)


@SETTINGS
def test_sequences_match_the_generation_mixin(pair, monkeypatch, greedy, entropy_bound, stability, confidence, cache):  # noqa: F811
    hf, ours, _ = pair
    _check_sequences(hf, ours, SPECIAL, monkeypatch, greedy, entropy_bound, stability, confidence, cache)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A reference whose vocabulary (384) is larger than the byte tokenizer's (260), imported, with the decode
    profile dllm derives for it with that tokenizer (`dllm convert`, `dllm generate --model`)."""
    from dllm.checkpoint.loading import derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.tokenization import build_tokenizer
    from tests.unit.test_diffusion_gemma import _import, _reference

    folder = tmp_path_factory.mktemp("dgemma_wide") / "hf"
    hf = _reference(vocab_size=WIDE_V)
    hf.save_pretrained(folder)
    ours = _import(folder)
    tok = build_tokenizer(TokenizerConfig())
    assert tok.vocab_size < WIDE_V == ours.cfg.vocab_size
    return hf, ours, derive_profile(None, ours.cfg, tok)


@SETTINGS
def test_canvases_draw_from_the_model_vocabulary(wide, monkeypatch, greedy, entropy_bound, stability, confidence,
                                                 cache):  # fmt: skip
    """A tokenizer smaller than the model's vocabulary: random canvases still draw from the whole vocabulary, as
    the reference's (its config's vocab_size), so the sequences are the generation mixin's."""
    hf, ours, profile = wide
    assert profile.attention == "prefix_canvas" and profile.num_tokens == WIDE_V
    _check_sequences(hf, ours, SpecialIds.of(profile), monkeypatch, greedy, entropy_bound, stability, confidence, cache)


def test_generate_counts_and_shows_each_step(pair, monkeypatch):  # noqa: F811
    """Three prompts of different lengths, greedy, a gen_length that is not whole canvases (rounded up, as the
    reference rounds max_new_tokens), rows that stop denoising at different steps: the reference's sequences;
    one forward and one event per step actually taken; the events show the decided tokens, the draft and
    the accepted positions; the cache reads the clean keys."""
    hf, ours, _ = pair
    cfg = _sampler(gen_length=2 * C - 3, steps=12, denoise_stability_threshold=0, denoise_confidence_threshold=4.05)
    assert (cfg.gen_length, cfg.block_length, cfg.total_steps // cfg.num_blocks) == (2 * C, C, 6)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, V - 1, (n,), generator=g).tolist() for n in (7, 4, 2)]
    clean = torch.tensor([[PAD] * (7 - len(p)) + p for p in prompts])
    _greedy_reference(monkeypatch)
    want = _reference_generate(hf, clean, clean != PAD, cfg)
    forwards, events = [], []
    hook = ours.register_forward_hook(lambda *_: forwards.append(1))
    try:
        got = _ours(ours, prompts, cfg, callback=lambda e: events.append((e, e.canvas_BT.clone(), e.draft_BT.clone())))
    finally:
        hook.remove()
    assert torch.equal(got.canvas_BL, want)
    c = got.counters
    assert c.loop == "canvas_denoise" and c.nfe == c.steps == len(forwards) == len(events)
    per_canvas = [sum(e.block == k for e, _, _ in events) for k in range(2)]
    assert all(1 <= n <= 6 for n in per_canvas) and sum(per_canvas) < 12  # rows stopped before their budget
    assert [e.step for e, _, _ in events] == [*range(per_canvas[0]), *range(per_canvas[1])]
    for e, decided, draft in events:
        start = 7 + e.block * C
        assert e.gen_start_B == [7, 7, 7] and decided.shape == draft.shape == (3, 7 + 2 * C)
        assert bool((decided[:, start:] == MASK).all()) and torch.equal(decided[:, :start], want[:, :start])
        assert torch.equal(draft[:, :start], decided[:, :start])
        assert not bool((draft[:, start : start + C] == MASK).all())  # the draft: the proposals
        assert not bool(e.committed_BT[:, :start].any()) and not bool(e.committed_BT[:, start + C :].any())
    last = [next(d for e, _, d in reversed(events) if e.block == k) for k in range(2)]
    for k, draft in enumerate(last):  # the last draft of a canvas is what it decoded (padding after an EOS)
        span = slice(7 + k * C, 7 + (k + 1) * C)
        kept = want[:, span] != PAD
        assert torch.equal(want[:, span][kept], draft[:, span][kept])
    for row, seq in zip(want[:, 7:].tolist(), got.sequences, strict=True):
        assert seq == (row[: row.index(EOS)] if EOS in row else row)
    ends = [EOS in row for row in want[:, 7:].tolist()]  # a row's output up to its end, EOS included
    assert c.tokens_committed == sum(len(s) + e for s, e in zip(got.sequences, ends, strict=True))
    # cache: a canvas's first step also runs the clean rows not yet cached, later steps only the canvas
    first = [3 * (7 + C), 3 * (C + C)]
    assert c.query_tokens == sum(first) + 3 * C * (sum(per_canvas) - 2)
    assert c.cached_tokens == 3 * (7 * per_canvas[0] + (7 + C) * (per_canvas[1] - 1))


def test_stop_strings_and_eos_end_the_call(pair):  # noqa: F811
    """A stop function that ends every row after the first canvas: one canvas decoded; without stop_at_eos no
    row is padded after its EOS and sequences are not cut."""
    _, ours, _ = pair
    cfg = _sampler(gen_length=3 * C, steps=6)
    prompts = [[5, 6, 7], [8, 9]]
    seen = []
    got = generate(ours, prompts, cfg, SPECIAL, generator=torch.Generator().manual_seed(1),
                   stop=lambda ids: seen.append(list(ids)) or len(ids) >= C)  # fmt: skip
    assert got.canvas_BL.shape == (2, 3 + C) and seen and all(len(s) == C for s in seen)
    plain = generate(ours, prompts, cfg.model_copy(update={"stop_at_eos": False}), SPECIAL,
                     generator=torch.Generator().manual_seed(1))  # fmt: skip
    assert plain.canvas_BL.shape == (2, 3 + 3 * C) and [len(s) for s in plain.sequences] == [3 * C, 3 * C]


@pytest.mark.slow  # ~2 min on 2 CPU cores: inductor compiles the Gemma blocks (cached and uncached forwards)
def test_compiled_blocks_decode_as_eager(pair):  # noqa: F811
    import copy

    _, ours, _ = pair
    cfg = _sampler(gen_length=2 * C, steps=8)
    prompts = [[5, 6, 7, 8], [9, 10]]
    eager = _ours(ours, prompts, cfg)
    compiled = _ours(copy.deepcopy(ours), prompts, cfg.model_copy(update={"compile": True}))
    assert torch.equal(compiled.canvas_BL, eager.canvas_BL) and compiled.nfe == eager.nfe


def test_sampler_config_maps_onto_the_denoiser():
    """gen_length rounds up to whole canvases, steps default to 48 a canvas (the reference's) and split evenly,
    block_length is the model's, temperature picks argmax (0) or sampled (1) proposals, the reference's
    defaults; what has no effect is refused in one line naming the field; re-resolving changes nothing."""
    cfg = _sampler()
    assert (cfg.generation, cfg.gen_length, cfg.block_length, cfg.total_steps) == ("canvas_denoise", 32, C, 4 * 48)
    assert (cfg.denoise_entropy_bound, cfg.denoise_t_min, cfg.denoise_t_max) == (0.1, 0.4, 0.8)
    assert (cfg.denoise_stability_threshold, cfg.denoise_confidence_threshold, cfg.denoise_cache) == (1, 0.005, True)
    assert resolve_sampler(cfg, PROFILE) == cfg
    assert resolve_sampler(cfg.model_copy(update={"gen_length": 3}), PROFILE).gen_length == C  # eval's task lengths
    assert _sampler(gen_length=2 * C, block_length=C, steps=10, temperature=1).total_steps == 10
    refused = [
        ({"steps": 7, "gen_length": 2 * C}, "^sampler: steps 7 must be a multiple of the number of blocks"),
        ({"block_length": 4, "gen_length": 8}, "^sampler.block_length: this model decodes canvases of 8 tokens"),
        ({"policy": "threshold"}, "^sampler.policy: no effect on canvas_denoise"),
        ({"cache": "prefix"}, "^sampler.cache: no effect on canvas_denoise"),
        ({"cfg_scale": 1.0}, "^sampler.cfg_scale: no effect"),
        ({"top_p": 0.5, "temperature": 1}, "^sampler.top_p: no effect"),
        ({"sub_block_length": 4}, "^sampler.sub_block_length: no effect"),
        ({"temperature": 0.7}, "^sampler.temperature: 0.7: canvas_denoise proposes each position's argmax"),
        ({"generation": "canvas"}, "^sampler.generation: canvas cannot decode this model"),
        ({"gen_length": 65}, "^sampler.gen_length: 72 exceeds the 64 positions"),
    ]
    for values, message in refused:
        with pytest.raises(ConfigError, match=message) as e:
            _sampler(**values)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="denoise_t_max 0.4 must be above denoise_t_min 0.4"):
        SamplerConfig(denoise_t_max=0.4)
    mask = PROFILE.model_copy(update={"attention": "bidirectional", "block_size": None, "corruption": "mask"})
    assert resolve_sampler(SamplerConfig(), mask).generation == "canvas"
    elsewhere = [
        ({"denoise_entropy_bound": 0.3}, "^sampler.denoise_entropy_bound: no effect on canvas decoding"),
        ({"generation": "canvas_denoise"}, "^sampler.generation: canvas_denoise decodes DiffusionGemma"),
    ]
    for values, message in elsewhere:
        with pytest.raises(ConfigError, match=message):
            resolve_sampler(SamplerConfig(**values), mask)


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
