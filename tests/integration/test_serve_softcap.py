"""One logits function through the server: a model with Gemma's final logit soft-capping (cap 0.5, so that at
temperature 1 a path that skipped the cap would draw other tokens) answers a seeded request at temperature 1
with the tokens `generate` draws from the same seed: canvases uncached and block-cached, AR and speculative
decoding, each alone and while another request shares its forwards (the sampling-level paths:
tests/unit/test_softcap_parity.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from dllm.checkpoint.loading import LoadedModel, derive_profile
from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.inference.engine import generate
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds
from dllm.tokenization import ByteTokenizer
from tests.integration.serve_support import MAX_LEN
from tests.integration.test_serve_causal import random_drafter

SEED, PROMPT = 17, "soft caps"


def _loaded(cap: float | None = 0.5) -> LoadedModel:
    tok = ByteTokenizer()
    cfg = ModelConfig(preset="tiny", vocab_size=tok.vocab_size, max_seq_len=MAX_LEN, init_std=0.5,
                      final_logit_softcap=cap)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(1))
    return LoadedModel(model.eval(), tok, cfg, Path("capped"), derive_profile(None, cfg, tok))


CASES = {
    "canvas": {"gen_length": 8, "block_length": 8, "steps": 8, "policy": "random", "temperature": 1.0},
    "canvas_block_cached": {
        "gen_length": 8,
        "block_length": 4,
        "steps": 8,
        "policy": "random",
        "temperature": 1.0,
        "attention": "block",
        "cache": "block",
    },  # fmt: skip
    "ar": {"generation": "causal", "gen_length": 8, "temperature": 1.0},
    "speculative": {"generation": "causal", "gen_length": 8, "temperature": 1.0},
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_soft_capped_model_draws_the_same_tokens_served_as_generate(case: str):
    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    loaded = _loaded()
    base = resolve_sampler(SamplerConfig(stop_at_eos=False, **CASES[case]), loaded.profile)
    drafter = random_drafter(loaded) if case == "speculative" else None
    special, tok = SpecialIds.of(loaded.profile), loaded.tokenizer
    ids = tok.encode(PROMPT)
    want = generate(loaded.model, [ids], base, special, generator=torch.Generator().manual_seed(SEED), drafter=drafter)
    uncapped = generate(_loaded(None).model, [ids], base, special, generator=torch.Generator().manual_seed(SEED))
    assert uncapped.sequences != want.sequences  # the cap decides the draws
    body = {"prompt": ids, "max_tokens": 8, "seed": SEED, "temperature": 1.0}
    state = make_state(loaded, base, model_id="capped", drafter=drafter, max_wait_ms=0)
    with BackgroundServer(state, port=free_port()) as srv:
        alone = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        another = {"json": {"prompt": "another one", "max_tokens": 8}, "timeout": 60}
        other = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",), kwargs=another)
        other.start()
        beside = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        other.join()
    text = tok.decode(want.sequences[0])
    assert alone["choices"][0]["text"] == text and beside["choices"][0]["text"] == text
