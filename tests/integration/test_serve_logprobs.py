"""Log-probabilities from a served causal model: `logprobs` / `top_logprobs` on completions and chat, `echo`
with `max_tokens: 0` (the scoring convention of lm-eval's log-likelihood requests), each equal to the
model's own teacher-forced scores (sampling.causal.score_tokens) and, for greedy decoding, the chosen
token the most likely; the refusals around them; and lm-eval's `local-completions` running a
log-likelihood task and a generate_until task end to end against the server, through its remote
tokenizer (/tokenizer_info, /tokenize, /detokenize)."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dllm.config.sampler import SamplerConfig, resolve_sampler  # noqa: E402
from dllm.sampling.causal import score_tokens  # noqa: E402
from tests.distributed.harness import free_port  # noqa: E402
from tests.integration.serve_support import tiny_loaded  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def server(loaded):
    from dllm.serving.server import BackgroundServer, make_state

    base = resolve_sampler(SamplerConfig(generation="causal", gen_length=16), loaded.profile)
    with BackgroundServer(make_state(loaded, base, model_id="tiny"), port=free_port()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def direct(loaded, ids: list[int], top: int = 0):
    return score_tokens(loaded.model, [ids], top, loaded.profile.mask_id)[0]


def test_completion_logprobs_are_the_models_scores(loaded, client):
    tok = loaded.tokenizer
    r = client.completions.create(model="tiny", prompt="the cat", max_tokens=6, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    ids = tok.encode("the cat") + tok.encode(c.text)
    ref = direct(loaded, ids, 3)
    for got, want in zip(lp.token_logprobs, ref.logprobs[-6:], strict=True):
        assert math.isclose(got, want, abs_tol=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy: the argmax


def test_echo_scores_the_prompt(loaded, client):
    tok = loaded.tokenizer
    ids = tok.encode("one two three")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == "one two three" and r.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    want = direct(loaded, ids).logprobs
    assert len(c.logprobs.token_logprobs) == len(ids)
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(c.logprobs.token_logprobs[1:], want[1:], strict=True))
    both = client.completions.create(model="tiny", prompt="ab", max_tokens=3, echo=True, logprobs=0, temperature=0)
    b = both.choices[0]
    assert b.text.startswith("ab") and len(b.logprobs.tokens) == 2 + 3 and b.logprobs.top_logprobs is None
    plain = client.completions.create(model="tiny", prompt="ab", max_tokens=3, echo=True, temperature=0)
    assert plain.choices[0].text == b.text and plain.choices[0].logprobs is None


def test_chat_logprobs(loaded, client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-5)
        assert e.bytes == list(e.token.encode())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "logprobs": 1, "stream": True}, "logprobs"),
        ({"prompt": "x", "echo": True, "stream": True}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "logprobs": 6}, "logprobs"),
        ({"prompt": "x", "logprobs": "1"}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ],
)
def test_refusals(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json={"model": "tiny", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_diffusion_model_refuses_logprobs():
    from dllm.serving.server import BackgroundServer, make_state

    loaded = tiny_loaded()
    base = resolve_sampler(SamplerConfig(gen_length=16), loaded.profile)
    with BackgroundServer(make_state(loaded, base, model_id="tiny"), port=free_port()) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        assert "causal models only" in r.json()["error"]["message"]


def test_tokenizer_info(loaded, server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    tok = loaded.tokenizer
    assert info["eos_token"] == tok.decode([tok.eos_id], skip_special=False)
    assert info["model_max_length"] == loaded.profile.max_length and info["chat_template"] is None


def test_lm_eval_local_completions_against_the_server(loaded, server, tmp_path, monkeypatch):
    """A multiple-choice (log-likelihood) task and a generate_until task through lm-eval's own API client;
    every log-likelihood it records equals the model's own score of the continuation."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    for key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(key, "1")
    rng = random.Random(0)
    docs = []
    for _ in range(4):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        choices = [str(a + b), str(a + b + 1), str(a + b + 2)]
        docs.append({"prompt": f"{a} + {b} =", "choices": choices, "label": 0, "answer": str(a + b)})
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    data = {
        "dataset_path": "json",
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "sums.jsonl")}, "cache_dir": str(tmp_path / "c")},
    }
    mc = {
        "task": "served_mc",
        **data,
        "output_type": "multiple_choice",
        "doc_to_choice": "choices",
        "doc_to_target": "label",
        "metric_list": [{"metric": "acc"}],
    }
    gen = {
        "task": "served_gen",
        **data,
        "output_type": "generate_until",
        "doc_to_target": "answer",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 6},
        "metric_list": [{"metric": "exact_match"}],
    }
    for cfg in (mc, gen):
        (tmp_path / f"{cfg['task']}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))  # fmt: skip
    args = f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,max_retries=1"
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["served_mc", "served_gen"],
                                      task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
                                      log_samples=True)  # fmt: skip
    assert 0.0 <= results["results"]["served_mc"]["acc,none"] <= 1.0
    tok = loaded.tokenizer
    samples = results["samples"]["served_mc"]
    assert len(samples) == 4
    for s in samples:
        context = s["doc"]["prompt"]
        for choice, resp in zip(s["doc"]["choices"], s["resps"], strict=True):
            ids, n_ctx = tok.encode(f"{context} {choice}"), len(tok.encode(context))
            want = sum(direct(loaded, ids).logprobs[n_ctx:])  # type: ignore[arg-type]
            assert math.isclose(resp[0][0], want, abs_tol=1e-3), (resp, want)
    outputs = [s["resps"][0][0] for s in results["samples"]["served_gen"]]
    assert len(outputs) == 4 and all("\n" not in o and len(tok.encode(o)) <= 6 for o in outputs)
    assert 0.0 <= results["results"]["served_gen"]["exact_match,none"] <= 1.0
