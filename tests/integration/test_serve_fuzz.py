"""Seeded random request bodies against `dllm serve` (in-process): fields of the wrong type or range,
missing fields, unknown and unserved fields, null everywhere, empty and very long strings, unicode and
lone surrogates, huge numbers (1e309, 10**40), NaN, deep nesting, broken and non-object JSON, bodies
that are not UTF-8. Every answer is a result or an OpenAI error object with a message, never a 500
(nor a 200 stream that carries a server error), and the server answers afterwards."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from dllm.serving.app import build_app  # noqa: E402
from dllm.serving.protocol import DIFFUSION_FIELDS  # noqa: E402
from dllm.serving.unserved import REQUEST_FIELDS  # noqa: E402
from tests.integration.serve_support import make_server  # noqa: E402

SEED = 21
# Raw JSON the encoder will not write (json.dumps gives Infinity for inf, and recurses on deep nests):
# a marker string in the body is replaced by its text.
RAW = {"@inf": "1e309", "@-inf": "-1e309", "@nan": "NaN", "@infinity": "Infinity", "@big": "1" + "0" * 400,
       "@tiny": "1e-400", "@deep": "[" * 3000 + "]" * 3000, "@deep-dict": '{"a":' * 50 + "1" + "}" * 50}  # fmt: skip
OPENAI_FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "stop", "seed", "n", "stream", "stream_options", "user", "denoise"]  # fmt: skip
FIELDS = OPENAI_FIELDS + list(DIFFUSION_FIELDS) + list(REQUEST_FIELDS) + ["bogus", "", "\ud800", "Prompt"]


# Values each field honours (or accepts as asking nothing): half the values drawn for a field are these, so
# that valid requests of every shape are decoded too.
PLAUSIBLE = {
    "model": ["tiny"],
    "prompt": ["", "h\u00e9llo", "\u65e5\u672c\u8a9e \U0001f600", ["a", "b"], [104, 105], [[1], [2, 3]]],
    "messages": [[{"role": "user", "content": "\u00e9\U0001f600"}], [{"role": "system", "content": ""},
                 {"role": "user", "content": [{"type": "text", "text": "x"}]}]],
    "max_tokens": [1, 4, 8], "max_completion_tokens": [4], "temperature": [0, 0.7, 2], "top_p": [0.5, 1],
    "stop": ["a", ["x", "y"], []], "seed": [0, 7, 2**63 - 1], "n": [1, 2, 3], "stream": [True, False],
    "stream_options": [{"include_usage": True}], "user": ["u", ""], "denoise": [False],
    "policy": ["low_confidence", "threshold", "random", "margin", "entropy", "factor", "ancestral", "llada2_edit"],
    "steps": [4, 8], "block_length": [2, 4], "sub_block_length": [2], "threshold": [0.5], "factor": [1.0, 3.0],
    "cache": ["none", "prefix", "dual"], "refresh_every": [2], "cfg_scale": [0.0, 0.5], "top_k": [1, 5, 10**6],
    "edit_threshold": [0.5], "max_post_steps": [0, 2], "min_commit": [1, 2],
    "stop_at_eos": [False], "reuse_unchanged": [False], "logprobs": [False], "echo": [False], "suffix": [""],
    "best_of": [1], "presence_penalty": [0], "frequency_penalty": [0.0], "logit_bias": [{}], "tools": [[]],
    "tool_choice": ["none"], "response_format": [{"type": "text"}], "store": [False], "service_tier": ["auto"],
}  # fmt: skip


def draw(rng: random.Random, name: str):
    return rng.choice(PLAUSIBLE[name]) if name in PLAUSIBLE and rng.random() < 0.5 else value(rng)


def scalars(rng: random.Random) -> list:
    return [
        None, True, False, 0, 1, -1, 2, 4, 16, 127, 128, 2.5, -0.0, 0.5, 1e-300, 10**40, -(10**40), 2**63, 2**64,
        rng.randint(-5, 300), rng.random() * 3, "@inf", "@-inf", "@nan", "@infinity", "@big", "@tiny",
        "", "x", "8", "0.5", "true", "null", "none", "low_confidence", "threshold", "block", "text", "auto",
        "h\u00e9llo", "\u65e5\u672c\u8a9e", "\U0001f600", "\u202e\u0301", "\x00", "\ud800", "a\udfffb", "\ude00\ud83d",
        "y" * rng.choice([100, 1000, 50_000]), "z" * rng.randint(0, 300),
    ]  # fmt: skip


def value(rng: random.Random, depth: int = 0):
    """A random JSON value: mostly scalars, some lists and objects (of values), chat-like shapes, deep nests."""
    roll = rng.random()
    if depth > 2 or roll < 0.55:
        return rng.choice(scalars(rng))
    if roll < 0.65:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if roll < 0.72:
        return [rng.randint(-3, 300) for _ in range(rng.randint(0, 40))]
    if roll < 0.8:
        return {rng.choice(["type", "text", "a", "include_usage", "\ud800"]): value(rng, depth + 1)}
    if roll < 0.92:
        return [message(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice(["@deep", "@deep-dict"])


def message(rng: random.Random, depth: int) -> dict:
    part = {"type": "text", "text": value(rng, depth + 1)}
    msg = {"role": rng.choice(["user", "user", "system", "assistant", "developer", "tool", "robot", None, 3]),
           "content": rng.choice(["hi", value(rng, depth + 1), [part]])}  # fmt: skip
    if rng.random() < 0.2:
        msg[rng.choice(["name", "tool_calls", "refusal", "extra"])] = value(rng, depth + 1)
    if rng.random() < 0.1:
        del msg[rng.choice(["role", "content"])]
    return msg


def encode(body) -> bytes:
    raw = json.dumps(body)  # ASCII: a lone surrogate is written as its \\u escape, which the server then reads
    for marker, text in RAW.items():
        raw = raw.replace(json.dumps(marker), text)
    return raw.encode()


def bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """(path, raw body): every field with each odd value on a valid request, random mixes with fields left out,
    null everywhere, and raw corruptions of the text."""
    base = {"/v1/completions": {"prompt": "fuzz", "max_tokens": 4},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 4}}  # fmt: skip
    out = []
    for name in FIELDS:  # each field, a few odd values, on both endpoints
        for path, ok in base.items():
            out += [(path, encode({**ok, name: draw(rng, name)})) for _ in range(4)]
    for _ in range(120):  # mixes of 1-5 fields, the required one sometimes missing or odd
        path, ok = rng.choice(list(base.items()))
        body = {k: v for k, v in ok.items() if rng.random() < 0.7}
        body.update({(name := rng.choice(FIELDS)): draw(rng, name) for _ in range(rng.randint(1, 5))})
        out.append((path, encode(body)))
    for path in base:
        out.append((path, encode({name: None for name in FIELDS})))  # null everywhere
        out.append((path, encode({**base[path], **{name: None for name in FIELDS}})))
    for _ in range(60):  # text corruptions of valid bodies
        path, ok = rng.choice(list(base.items()))
        raw = encode({**ok, rng.choice(FIELDS): value(rng)})
        cut = rng.randint(0, len(raw) - 1)
        raw = rng.choice([
            raw[:cut], raw[:cut] + b"\xff\xfe" + raw[cut:], b"\xef\xbb\xbf" + raw,
            raw.replace(b"}", b', "n": 1, "n": 2}', 1),
            raw.replace(b":", b":" + b"[" * 100, 1), b"[" * rng.randint(1, 100_000), b"{" * 40 + b"}" * 40,
            json.dumps(value(rng)).encode(), b"", b"null", b"  ", b'{"prompt": "\\ud800"}', b'{"prompt": "\\u"}',
        ])  # fmt: skip
        out.append((path, raw))
    return out


def test_fuzzed_bodies_never_crash_the_server():
    rng = random.Random(SEED)
    cases = bodies(rng)
    assert len(cases) >= 500
    srv = make_server()
    statuses = []
    with TestClient(build_app(srv.state)) as http:
        for path, raw in cases:
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code < 500, (path, raw[:300], r.text[:300])
            if r.status_code != 200:
                err = r.json()["error"]
                assert isinstance(err["message"], str) and err["message"] and err["type"], (raw[:300], err)
            else:
                assert "server_error" not in r.text, (path, raw[:300], r.text[:300])  # no 500 inside a stream
        assert http.get("/health").json()["status"] == "ok" and srv.state.engine.thread.is_alive()
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 4}).status_code == 200
    counts = {code: statuses.count(code) for code in set(statuses)}
    assert counts[200] >= 100 and counts[400] >= 300, counts  # both kinds of case were exercised
