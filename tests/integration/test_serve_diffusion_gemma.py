"""Serving a DiffusionGemma model (generation canvas_denoise, from its decode profile) through the official
openai client: its requests run as sampler calls of their own (not in the running canvas batch); a seeded
request's text is `generate`'s with a generator of that seed, cut to max_tokens; a stream carries the
same text canvas by canvas; the denoising frames show each step's draft; the request fields that have no
effect on it are a 400 naming the field, and DiffusionGemma's own fields apply."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("transformers.models.diffusion_gemma")

from dllm.checkpoint.loading import load_for_inference  # noqa: E402
from dllm.config.sampler import SamplerConfig, resolve_sampler  # noqa: E402
from dllm.inference.engine import generate, shares_forwards  # noqa: E402
from dllm.sampling.canvas import SpecialIds  # noqa: E402
from tests.integration.test_diffusion_gemma_cli import CANVAS, save_printable_model  # noqa: E402


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_for_inference(model_dir=save_printable_model(tmp_path_factory.mktemp("dgemma") / "model"))


@pytest.fixture(scope="module")
def server(loaded):
    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    base = resolve_sampler(SamplerConfig(gen_length=16, steps=12), loaded.profile)  # 6 steps a canvas
    with BackgroundServer(make_state(loaded, base, model_id="dgemma", max_wait_ms=20), port=free_port()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(loaded, prompt: str, seed: int, max_tokens: int, **fields) -> str:
    """What `generate` decodes for the prompt alone with the server's sampler at this length and seed."""
    cfg = resolve_sampler(SamplerConfig(gen_length=max_tokens, steps=6 * -(-max_tokens // CANVAS), **fields),
                          loaded.profile)  # fmt: skip
    tok = loaded.tokenizer
    out = generate(loaded.model, [tok.encode(prompt)], cfg, SpecialIds.of(loaded.profile),
                   generator=torch.Generator().manual_seed(seed))  # fmt: skip
    return tok.decode(out.sequences[0][:max_tokens])


def test_requests_run_their_own_forwards_and_equal_generate(loaded, server, client):
    base = server.state.base
    assert base.generation == "canvas_denoise" and not shares_forwards(base, loaded.model)
    r = client.completions.create(model="dgemma", prompt="hello", max_tokens=12, seed=7)
    c = r.choices[0]
    assert c.text == _expected(loaded, "hello", 7, 12) and len(c.text) == 12 and c.finish_reason == "length"
    assert r.usage.completion_tokens == 12 and 1 <= r.model_extra["dllm"]["nfe"] <= 12
    assert client.completions.create(model="dgemma", prompt="hello", max_tokens=12, seed=7).choices[0].text == c.text
    knobs = {"denoise_entropy_bound": 5.0, "denoise_cache": False}
    tuned = client.completions.create(model="dgemma", prompt="hello", max_tokens=12, seed=7, temperature=1,
                                      extra_body=knobs)  # fmt: skip
    assert tuned.choices[0].text == _expected(loaded, "hello", 7, 12, temperature=1, **knobs)
    chat = client.chat.completions.create(model="dgemma", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert len(chat.choices[0].message.content) == 8
    executor = server.state.engine.inner.executor  # no rows were shared: every request ran its own forwards
    assert executor.causal.target is None and executor.cached == {}


def test_streams_and_denoising_frames(loaded, server, client):
    chunks = list(client.completions.create(model="dgemma", prompt="stream me", max_tokens=16, seed=3, stream=True))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].text]
    assert "".join(pieces) == _expected(loaded, "stream me", 3, 16) and len(pieces) >= 2  # canvas by canvas
    body = {"prompt": "abc", "max_tokens": 16, "seed": 3}
    with httpx.stream("POST", server.url + "/v1/denoise", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    steps = [e for e in events if e["object"] == "denoise.frame" and not e["final"]]
    done = events[-1]
    assert done["object"] == "denoise.done" and done["dllm"]["nfe"] == done["dllm"]["steps"] == len(steps)
    assert [f["nfe"] for f in steps] == list(range(1, len(steps) + 1))
    for f in steps:  # the draft of the canvas under way after what is decided; masks after it
        tokens = f["choices"][0]["tokens"]
        drafted = (f["block"] + 1) * CANVAS
        assert None not in tokens[:drafted] and set(tokens[drafted:]) <= {None}
    assert {f["block"] for f in steps} == {0, 1}
    final = [e for e in events if e["object"] == "denoise.frame" and e["final"]]
    assert len(final) == 1 and "".join(final[0]["choices"][0]["tokens"]) == done["choices"][0]["text"]
    assert done["choices"][0]["text"] == _expected(loaded, "abc", 3, 16)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"policy": "threshold"}, "policy"),
        ({"cache": "dual"}, "cache"),
        ({"cfg_scale": 1.0}, "cfg_scale"),
        ({"top_p": 0.5, "temperature": 1}, "top_p"),
        ({"temperature": 0.7}, "temperature"),
        ({"block_length": 4}, "block_length"),
        ({"steps": 5}, "steps"),
        ({"denoise_t_min": 0.9}, "denoise_t_max"),
        ({"denoise_entropy_bound": 0}, "denoise_entropy_bound"),
    ],
)
def test_fields_that_do_not_apply_are_a_400_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="dgemma", prompt="x", max_tokens=16, extra_body=fields)
    assert e.value.body["param"] == param, e.value.body
