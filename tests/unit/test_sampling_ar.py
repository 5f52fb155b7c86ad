"""AR decoding of causal models (the causal loop of sampling/speculative.py without a drafter, over the
ragged KV cache of sampling/causal.py): the ragged cache against the no-cache reference, batched rows
against single rows, EOS / stop handling, seeded sampling, and which models are causal.

Shapes: B batch, N new tokens, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models import Transformer
from dllm.models.families.base import is_causal_model
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import RaggedKVCache
from dllm.sampling.proposals import draw
from dllm.sampling.results import GenerationResult
from dllm.sampling.speculative import Drafter

V = 48
MASK_ID = V - 1


def causal_model(seed: int = 0, layers: int = 2, width: int = 64, dtype: torch.dtype = torch.float32) -> Transformer:
    """A tiny random llama; a wide init (std 0.2) gives peaked next-token distributions (few near-ties)."""
    cfg = ModelConfig(preset="tiny", family="llama", vocab_size=V, num_layers=layers, hidden_size=width,
                      init_std=0.2)  # fmt: skip
    model = Transformer(cfg).eval()
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype)


def decode(
    model: torch.nn.Module, prompts: list[list[int]], n: int, *, drafter: Drafter | None = None,
    eos_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
    generator: torch.Generator | None = None, stop=None, use_cache: bool = True, return_logits: bool = False,
) -> GenerationResult:  # fmt: skip
    """The causal loop on `n` new tokens per prompt (EOS only when `eos_id` is given; the mask id never a token)."""
    cfg = SamplerConfig(generation="causal", gen_length=n, temperature=temperature, top_k=top_k,
                        stop_at_eos=eos_id is not None)  # fmt: skip
    special = SpecialIds(MASK_ID, 0, eos_id if eos_id is not None else 0, V)
    return generate(model, prompts, cfg, special, drafter=drafter, generator=generator, stop=stop,
                    recompute=not use_cache, return_logits=return_logits)  # fmt: skip


def new_tokens(result: GenerationResult, n: int) -> torch.Tensor:
    """The n positions after each row's prompt [B, n] (after a row's end: the EOS id)."""
    return torch.stack([result.canvas_BL[b, g : g + n] for b, g in enumerate(result.gen_start_B)])


def random_prompts(n: int, seed: int, max_len: int = 9) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, MASK_ID, (L,), generator=g).tolist() for L in lengths]


def test_ragged_cache_matches_the_no_cache_reference():
    """Prompts of lengths 1..9 in one batch: the same greedy tokens and logits within 1e-5 as full
    recomputation of every row at every step."""
    model = causal_model()
    prompts = random_prompts(6, seed=1)
    cached = decode(model, prompts, 12, return_logits=True)
    plain = decode(model, prompts, 12, return_logits=True, use_cache=False)
    assert cached.sequences == plain.sequences and all(len(s) == 12 for s in cached.sequences)
    torch.testing.assert_close(cached.logits_BNV, plain.logits_BNV, atol=1e-5, rtol=0)
    assert bool((new_tokens(cached, 12) != MASK_ID).all())
    c = cached.counters.as_dict()
    assert c["nfe"] == 12 and c["tokens_committed"] == 6 * 12 and c["tau"] == 1.0  # a prefill + 11 steps


def test_a_batch_decodes_each_row_as_it_would_alone():
    model = causal_model(seed=2)
    prompts = random_prompts(5, seed=3)
    together = decode(model, prompts, 8, return_logits=True)
    for b, p in enumerate(prompts):
        alone = decode(model, [p], 8, return_logits=True)
        assert alone.sequences[0] == together.sequences[b]
        torch.testing.assert_close(alone.logits_BNV[0], together.logits_BNV[b], atol=1e-5, rtol=0)


def test_eos_ends_a_row_and_stop_functions_are_honoured():
    model = causal_model(seed=4)
    prompts = random_prompts(3, seed=5)
    free = decode(model, prompts, 10)
    eos = free.sequences[1][3]  # row 1 emits this token at step 3 (maybe earlier too)
    ended = decode(model, prompts, 10, eos_id=eos)
    for row, out in zip(free.sequences, ended.sequences, strict=True):
        expect = row[: row.index(eos)] if eos in row else row
        assert out == expect
    assert ended.counters.tokens_committed == sum(len(s) + (len(s) < 10) for s in ended.sequences)
    stopped = decode(model, prompts, 10, stop=lambda ids: len(ids) >= 4)
    assert stopped.counters.nfe == 4  # every row stops after 4 tokens: prefill + 3 steps
    assert [s[:4] for s in stopped.sequences] == [s[:4] for s in free.sequences]


def test_sampling_is_seeded_and_respects_top_k():
    model = causal_model(seed=6, dtype=torch.float64)
    prompts = random_prompts(4, seed=7)

    def run(seed: int, use_cache: bool = True):
        gen = torch.Generator().manual_seed(seed)
        return decode(model, prompts, 10, temperature=1.0, top_k=3, generator=gen, return_logits=True,
                      use_cache=use_cache)  # fmt: skip

    a, b, c = run(0), run(0), run(1)
    assert a.sequences == b.sequences != c.sequences
    assert a.sequences == run(0, use_cache=False).sequences  # float64: the reference draws the same tokens
    top3 = a.logits_BNV.topk(3, dim=-1).indices
    assert bool((top3 == new_tokens(a, 10)[..., None]).any(-1).all())


def test_sample_inverts_the_cdf_and_never_draws_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    draws = draw(probs.repeat(500, 1), torch.Generator().manual_seed(0)).view(500, 2)
    assert set(draws[:, 0].tolist()) == {1, 3} and set(draws[:, 1].tolist()) == {2}


def test_which_models_decode_causally():
    ids = {"mask_id": 3, "pad_id": 0, "eos_id": 1, "num_tokens": 8, "max_length": 16}

    def of(family: str) -> ModelConfig:
        return ModelConfig(family=family, preset="tiny")

    assert is_causal_model(DecodeProfile(attention="causal", objective="ar", shift=True, **ids), of("llama"))
    folder = DecodeProfile(**ids)  # a folder never trained here
    assert is_causal_model(folder, of("qwen3")) and is_causal_model(folder, of("gpt2"))
    assert not is_causal_model(folder, of("llada")) and not is_causal_model(folder, of("bert"))
    assert not is_causal_model(DecodeProfile(objective="mdlm", **ids), of("llama"))  # an AR-to-diffusion run


def test_bad_arguments_raise():
    model = causal_model()
    with pytest.raises(ValueError, match="at least one token"):
        decode(model, [[1], []], 4)
    with pytest.raises(ValueError, match="gen_length"):
        decode(model, [[1]], 0)


def test_rows_of_equal_length_take_the_slice_write_and_match_the_reference():
    """Equal lengths: the cache writes one slice and a single query needs no mask; the tokens and logits
    are those of recomputing every row (and of the ragged path, which a longer first row forces)."""
    model = causal_model(seed=12)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, MASK_ID, (6,), generator=g).tolist() for _ in range(4)]
    cached, plain = decode(model, prompts, 10, return_logits=True), decode(model, prompts, 10, return_logits=True,
                                                                             use_cache=False)  # fmt: skip
    assert cached.sequences == plain.sequences
    torch.testing.assert_close(cached.logits_BNV, plain.logits_BNV, atol=1e-5, rtol=0)
    ragged = decode(model, [prompts[0] + [1], *prompts[1:]], 10)
    assert ragged.sequences[1:] == cached.sequences[1:]
    cache = RaggedKVCache(16, torch.tensor([5, 5]))
    _, mask = cache.at(1)
    assert cache.write_start == 5 and mask.is_plain and mask.kind == "bidirectional"
    cache.length_B = torch.tensor([5, 3])
    _, mask = cache.at(1)
    assert cache.write_start is None and mask.query_offset_B is not None


def test_score_tokens_batched_rows_equal_each_row_alone_and_the_models_own_softmax():
    """Ragged rows scored together (right padding) equal each scored alone; each score is the model's log-softmax."""
    from dllm.sampling.causal import score_tokens

    model = causal_model(seed=21, dtype=torch.float64)
    rows = random_prompts(5, seed=22)
    together = score_tokens(model, rows, top=3, mask_id=MASK_ID, max_rows_per_forward=5)
    for ids, got in zip(rows, together, strict=True):
        alone = score_tokens(model, [ids], top=3, mask_id=MASK_ID)[0]
        assert got.logprobs[0] is None and got.top[0] == [] and len(got.logprobs) == len(ids)
        assert got.logprobs[1:] == pytest.approx(alone.logprobs[1:], abs=1e-9)
        x = torch.tensor([ids])
        logits = model(x, torch.arange(len(ids))[None], AttentionMask("causal")).logits()[0, :-1].double()
        logits[:, MASK_ID] = float("-inf")
        want = logits.log_softmax(-1)
        assert got.logprobs[1:] == pytest.approx(want.gather(1, x[0, 1:, None])[:, 0].tolist(), abs=1e-6)
        assert [t for t, _ in got.top[1]] == want[0].topk(3).indices.tolist()
