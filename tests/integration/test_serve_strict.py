"""`dllm serve` is strict about what it reads: JSON types and ranges as OpenAI's reference gives them, no
field accepted and then ignored, bodies and prompts within limits, and a long prompt tokenized off the
event loop. Every refusal is an OpenAI error object naming the field, never a 500."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from dllm.serving.app import build_app  # noqa: E402
from dllm.serving.unserved import REQUEST_FIELDS  # noqa: E402
from tests.integration.serve_support import MAX_LEN, SlowTokenizer, make_server, tiny_loaded  # noqa: E402

JSON = {"Content-Type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def http():
    with TestClient(build_app(make_server().state)) as client:
        yield client


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"], err
    return err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 8.0}, "max_tokens"),
        ({"n": True}, "n"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "1"}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"user": 5}, "user"),
        ({"model": 1}, "model"),
        ({"steps": "4"}, "steps"),
        ({"steps": True}, "steps"),
        ({"threshold": "0.5"}, "threshold"),
        ({"stop_at_eos": "no"}, "stop_at_eos"),
        ({"stop_at_eos": 0}, "stop_at_eos"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"colour": 1}}, "stream_options.colour"),
        ({"denoise": True}, "denoise"),  # frames ride a stream
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
    ],
)
def test_types_and_ranges_are_strict(http, body, param):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
    err = _error(r)
    assert err["param"] == param and param.split(".")[0] in err["message"], err


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages.0.content",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x", "name": "ann"}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": "x", "colour": 1}]}, "messages.0.colour"),
        ({"messages": "hi"}, "messages"),
        ({"max_completion_tokens": 4, "max_tokens": 8}, "max_tokens"),
        ({"max_completion_tokens": "4"}, "max_completion_tokens"),
        ({"prompt": "x"}, "prompt"),  # a completion field is unknown to chat
        ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": None}]}, "messages.1.content"),
    ],
)
def test_chat_fields_are_strict(http, body, param):
    err = _error(http.post("/v1/chat/completions", json={**CHAT, **body}))
    assert err["param"] == param, err
    if param.endswith("content") and body["messages"][int(param.split(".")[1])].get("content") is None:
        assert "needs its content" in err["message"] and err["code"] == "invalid_value", err


def test_an_assistant_message_may_have_null_content(http):
    """As OpenAI's API: content is optional in an assistant message (an answer that was a tool call has none)."""
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}]
    assert http.post("/v1/chat/completions", json={**CHAT, "messages": turns}).status_code == 200
    err = _error(http.post("/tokenize", json={"messages": [{"role": "user", "content": None}]}))
    assert err["param"] == "messages.0.content"


def test_null_means_the_default_and_text_parts_are_read(http):
    nulls = {"prompt": "x", "max_tokens": 4, "temperature": None, "n": None, "stream": None, "stop": None,
             "seed": None, "steps": None, "user": None, "logprobs": None, "tools": None}  # fmt: skip
    r = http.post("/v1/completions", json=nulls)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    split = http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert split.json()["choices"] == http.post("/v1/chat/completions", json=CHAT).json()["choices"]


def test_content_type_must_be_json(http):
    raw = json.dumps({"prompt": "x", "max_tokens": 4})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        err = _error(http.post("/v1/completions", content=raw, headers={"Content-Type": ctype}), 415)
        assert "application/json" in err["message"] and err["code"] == "unsupported_media_type"
    for ctype in ("application/json; charset=utf-8", "application/json;charset=UTF-8", "application/vnd.x+json"):
        assert http.post("/v1/completions", content=raw, headers={"Content-Type": ctype}).is_success, ctype


def test_a_body_names_its_type_and_is_utf8(http):
    """A body with no Content-Type and a UTF-16 one were read as JSON (json.loads guesses UTF-16 and -32)."""
    raw = json.dumps({"prompt": "x", "max_tokens": 4})
    err = _error(http.post("/v1/completions", content=raw), 415)  # httpx sends content= without a type
    assert "no Content-Type" in err["message"] and err["code"] == "unsupported_media_type"
    for path in ("/v1/chat/completions", "/tokenize"):
        assert _error(http.post(path, content=raw), 415)["code"] == "unsupported_media_type"
    for encoding in ("utf-16", "utf-16-le", "utf-32"):
        err = _error(http.post("/v1/completions", content=raw.encode(encoding), headers=JSON))
        assert "not UTF-8" in err["message"] and err["code"] == "invalid_json", err
    err = _error(http.post("/v1/completions", content=raw.encode("utf-16"),
                           headers={"Content-Type": "application/json; charset=utf-16"}), 415)  # fmt: skip
    assert "UTF-8" in err["message"] and err["param"] is None
    assert http.post("/v1/completions", content=b"\xef\xbb\xbf" + raw.encode(), headers=JSON).is_success  # a BOM


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b"[" * 100_000 + b"]" * 100_000, None, "deeper"),
        (b'{"prompt": "x", "stop": ' + b"[" * 40 + b"]" * 40 + b"}", "stop" + ".0" * 31, "deeper"),
        (b'{"prompt": "\\ud800"}', "prompt", "surrogate"),
        (b'{"prompt": ["ok", "a\\udfffb"]}', "prompt.1", "surrogate"),
        (b'{"prompt": "x", "\\ud800": 1}', "\ud800", "surrogate"),
        (b'{"prompt": "x", "max_tokens": NaN}', None, "NaN"),
        (b'{"prompt": "x", "temperature": Infinity}', None, "Infinity"),
        (b'{"prompt": "x", "max_tokens": 1e309}', "max_tokens", "integer"),
        (b'{"prompt": "x", "temperature": 1e309}', "temperature", "finite"),
        (b'{"prompt": "x", "max_tokens": 1' + b"0" * 40 + b"}", "max_tokens", "positions"),
        (b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}", None, "JSON"),
        (b'{"prompt": "x", "stream": true, "stream": false}', None, "twice"),
        (b'"just a string"', None, "object"),
        (b"", None, "object"),
        (b"\xff\xfe{}", None, "JSON"),
    ],
)
def test_bodies_that_are_not_requests(http, raw, param, words):
    err = _error(http.post("/v1/completions", content=raw, headers=JSON))
    assert err["param"] == param and words in err["message"], err


def test_lone_surrogates_in_chat_and_error_bodies_stay_json(http):
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'
    err = _error(http.post("/v1/chat/completions", content=body, headers=JSON))
    assert err["param"] == "messages.0.content.0.text"
    r = http.post("/v1/completions", content=b'{"prompt": "x", "\\ud83d": 1}', headers=JSON)
    assert r.headers["content-type"] == "application/json" and r.content.isascii()  # escaped, not a 500


def test_a_long_prompt_is_blamed_on_the_prompt(http):
    err = _error(http.post("/v1/completions", json={"prompt": "y" * 200}))
    assert err["param"] == "prompt" and "200 tokens" in err["message"] and str(MAX_LEN - 1) in err["message"]
    assert err["code"] == "context_length_exceeded"
    # it fits alone but not with the server's default length (16): still the prompt, with both counts
    err = _error(http.post("/v1/completions", json={"prompt": "y" * 120}))
    assert err["param"] == "prompt" and "120 tokens plus 16" in err["message"] and str(MAX_LEN) in err["message"]
    # the client asked for the length that does not fit: max_tokens
    err = _error(http.post("/v1/completions", json={"prompt": "y" * 120, "max_tokens": 16}))
    assert err["param"] == "max_tokens" and "120 tokens" in err["message"]
    err = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * 200}]}))
    assert err["param"] == "messages" and "tokens" in err["message"]
    err = _error(http.post("/v1/completions", json={"prompt": ["short", "y" * 200]}))
    assert err["param"] == "prompt" and "prompt 1" in err["message"]


ASKING = {
    "logprobs": 1, "top_logprobs": 2, "echo": True, "suffix": "end", "best_of": 2, "presence_penalty": 0.5,
    "frequency_penalty": -1, "logit_bias": {"50": 10}, "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto", "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "auto",
    "response_format": {"type": "json_object"}, "modalities": ["text", "audio"], "audio": {"voice": "x"},
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "web_search_options": {},
    "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "draft_model": "d", "speculative": True,
    "edits": True,
}  # fmt: skip
NO_OPS = {
    "logprobs": False, "echo": False, "suffix": "", "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0,
    "logit_bias": {}, "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "response_format": {"type": "text"}, "modalities": ["text"], "store": False, "metadata": {},
    "service_tier": "auto", "user": "someone",
}  # fmt: skip


def test_every_unserved_field_is_refused_by_name(http):
    assert set(ASKING) == set(REQUEST_FIELDS)  # the table and this test cover the same fields
    for name, value in ASKING.items():
        for path, base in (("/v1/completions", {"prompt": "x", "max_tokens": 4}), ("/v1/chat/completions", CHAT)):
            err = _error(http.post(path, json={**base, name: value}))
            assert err["param"] == name and err["code"] == "unsupported_field" and name in err["message"], err
    # logprobs: 0 asks for the sampled token's log-probability (an int, not false)
    assert _error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 0}))["param"] == "logprobs"
    for name, value in NO_OPS.items():
        r = http.post("/v1/chat/completions", json={**CHAT, name: value})
        assert r.status_code == 200, (name, r.text)


def test_unserved_message_fields_are_refused(http):
    turns = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": [{"id": "1"}]}]
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "messages": turns}))
    assert err["param"] == "messages.1.tool_calls" and "not served" in err["message"]
    answer = {"role": "assistant", "content": "y", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None}  # fmt: skip
    replayed = [{"role": "user", "content": "x"}, answer]
    assert http.post("/v1/chat/completions", json={**CHAT, "messages": replayed}).status_code == 200


def test_the_openai_client_sees_the_refusals(http):
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], tools=tools)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], logprobs=True)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens="8")  # type: ignore[arg-type]
    r = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_completion_tokens=4, user="u",
                                       presence_penalty=0, tool_choice="none")  # fmt: skip
    assert len(r.choices[0].message.content) == 4


def test_denoise_refuses_what_it_would_ignore(http):
    body = {"prompt": "x", "max_tokens": 4}
    for extra, param in (({"stream": False}, "stream"), ({"denoise": False}, "denoise"),
                         ({"stream_options": {"include_usage": True}}, "stream_options")):  # fmt: skip
        assert _error(http.post("/v1/denoise", json={**body, **extra}))["param"] == param
    assert http.post("/v1/denoise", json={**body, "stream": True}).status_code == 200


def test_body_size_prompt_and_step_limits():
    srv = make_server(max_body_bytes=1000, max_prompt_tokens=10, max_steps=32)
    with TestClient(build_app(srv.state)) as http:
        big = json.dumps({"prompt": "x" * 2000}).encode()
        err = _error(http.post("/v1/completions", content=big, headers=JSON), 413)  # by its Content-Length
        assert f"body is {len(big)} bytes, more than the server's limit of 1000 bytes" in err["message"], err
        assert "--max-body-bytes" in err["message"] and err["code"] == "request_too_large"

        def chunks():  # no Content-Length: refused while it is read
            yield b'{"prompt": "'
            yield b"x" * 2000
            yield b'"}'

        err = _error(http.post("/v1/completions", content=chunks(), headers=JSON), 413)
        assert "body is more than the server's limit of 1000 bytes" in err["message"], err
        err = _error(http.post("/v1/completions", json={"prompt": "y" * 11}))
        assert err["param"] == "prompt" and "11 tokens" in err["message"] and "limit of 10" in err["message"]
        assert http.post("/v1/completions", json={"prompt": "y" * 10, "max_tokens": 4}).status_code == 200
        err = _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "steps": 64}))
        assert err["param"] == "steps" and "--max-steps" in err["message"]
        err = _error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 64}))  # 64 steps by default
        assert err["param"] == "max_tokens" and "limit of 32" in err["message"]
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 64, "steps": 32}).status_code == 200


def test_prompt_token_ids_are_the_tokenizers_but_the_mask(http):
    """An id past the vocabulary was a 400 with code null whose range included the mask id; the mask id itself
    (the sampler's placeholder of a position still to decide) was taken as a prompt token."""
    tok = tiny_loaded().tokenizer  # bytes 0..255, pad, bos, eos, then the mask: 259 of 260 ids
    assert tok.mask_id == tok.vocab_size - 1 == 259
    for prompt, bad in (([104, 105, 260], "token 2 is 260"), ([104, tok.mask_id], "token 1 is 259"),
                        ([[104], [105, -1]], "prompt 1: token 1 is -1")):  # fmt: skip
        err = _error(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
        assert err["param"] == "prompt" and err["code"] == "invalid_value", err
        assert bad in err["message"] and "[0, 259)" in err["message"] and "mask" in err["message"], err
    ok = [104, 105, tok.pad_id, tok.bos_id, tok.eos_id]
    assert http.post("/v1/completions", json={"prompt": ok, "max_tokens": 4}).status_code == 200


def test_limits_are_checked_when_the_server_is_made():
    from dllm.errors import ConfigError

    for kw, words in (({"max_prompt_tokens": MAX_LEN}, "--max-prompt-tokens"), ({"max_prompt_tokens": 0}, r"in \[1"),
                      ({"max_steps": 8}, "--max-steps"), ({"max_body_bytes": 0}, "--max-body-bytes")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            make_server(**kw)
    limits = make_server().state.limits
    assert (limits.max_body_bytes, limits.max_prompt_tokens, limits.max_steps) == (
        4 * 1024 * 1024,
        MAX_LEN - 1,
        MAX_LEN,
    )


def test_health_answers_while_a_long_prompt_is_tokenized():
    """Tokenizing runs in a worker thread: with a tokenizer that takes 3 s over a long prompt, /health
    answers at once meanwhile, and the prompt is then refused for its length. (Text that cannot fit is
    refused before it is tokenized: 2,000 bytes may still be 127 tokens of some tokenizer, 200,000 not.)"""
    loaded = tiny_loaded()
    slow = SlowTokenizer(loaded.tokenizer, delay_s=3.0, long_chars=1000)
    loaded.tokenizer = slow
    with make_server(loaded) as srv:
        result = {}
        err = _error(httpx.post(srv.url + "/v1/completions", json={"prompt": "y" * 200_000}, timeout=60))
        assert err["code"] == "context_length_exceeded" and "200000 characters" in err["message"], err
        assert not slow.started.is_set()  # never tokenized

        def send() -> None:
            result["r"] = httpx.post(srv.url + "/v1/completions", json={"prompt": "y" * 2000}, timeout=60)

        post = threading.Thread(target=send)
        post.start()
        assert slow.started.wait(30)
        for _ in range(3):
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=5).json()["status"] == "ok"
            assert time.monotonic() - t0 < 1.0
        assert post.is_alive()  # still tokenizing
        post.join()
        err = _error(result["r"])
        assert err["param"] == "prompt" and "2000 tokens" in err["message"]


def test_the_mask_id_inside_the_vocabulary_is_named():
    from dllm.serving.prompts import prompt_ids

    profile = tiny_loaded().profile.model_copy(update={"mask_id": 100})
    assert prompt_ids(profile) == "ids lie in [0, 260) except 100, the mask token, which only the sampler writes"


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_refusing_huge_prompts_keeps_memory_flat(tmp_path):
    """Fifteen refused 3 MB prompts grew a server's RSS from 1.4 to 2.9 GB, never returned: each was tokenized
    whole (seconds, and ~30 MB the tokenizer kept) to be refused for its token count. Text that cannot fit
    the prompt limit is now refused before it is tokenized: 50 of them, completions and chats, cost the
    server (in this process) at most 200 MB and a fraction of a second each."""
    import torch

    from dllm.checkpoint.loading import LoadedModel, derive_profile
    from dllm.config.data import TokenizerConfig
    from dllm.config.model import ModelConfig
    from dllm.models.transformer import Transformer
    from dllm.tokenization import build_tokenizer
    from tests.helpers import save_bpe

    tok = build_tokenizer(TokenizerConfig(kind="hf", path=save_bpe(tmp_path / "bpe")))  # a real BPE, as served
    cfg = ModelConfig(preset="tiny", vocab_size=tok.vocab_size, max_seq_len=MAX_LEN)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    loaded = LoadedModel(model.eval(), tok, cfg, tmp_path, derive_profile(None, cfg, tok))
    text = "the cat sees a map by the sea. " * 100_000  # 3.1 MB, under the 4 MiB body limit
    chat = {"messages": [{"role": "user", "content": text}]}
    bodies = [("/v1/completions", json.dumps({"prompt": text}).encode()),
              ("/v1/chat/completions", json.dumps(chat).encode())]  # fmt: skip
    with make_server(loaded) as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        for path, body in bodies:  # the server's first requests allocate what every request reuses
            client.post(path, content=body, headers=JSON)
        before, t0 = _rss_mb(), time.monotonic()
        for i in range(50):
            path, body = bodies[i % 2]
            err = _error(client.post(path, content=body, headers=JSON))
            assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
        grown, took_s = _rss_mb() - before, time.monotonic() - t0
    assert grown <= 200, f"RSS grew {grown:.0f} MB over 50 refused prompts"
    assert took_s < 60, took_s
