"""`dllm serve`: the OpenAI-compatible server driven by the official `openai` client over loopback and
in-process (FastAPI's TestClient as the client's transport): completions, chat, streaming, n > 1, stop
strings, seeds, batching that does not change a deterministic result, every error, cancellation, the
tokenizer endpoints and the latency histograms (tests/integration/test_serve_strict.py: what a request
may send and the limits; test_serve_fuzz.py: random bodies)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.integration.serve_support import (  # noqa: E402
    MAX_LEN,
    make_server,
    slow_loaded,
    tiny_loaded,
    tiny_model,
    wait_until,
)

KEY = "sk-test"


@pytest.fixture(scope="module")
def server():
    """A loopback server that batches up to 8 rows within 150 ms."""
    with make_server(max_batch=8, max_wait_ms=150) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or
               line.startswith(name + "{"))  # fmt: skip


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("dllm_requests_total", "dllm_nfe_total", "dllm_queue_length", "dllm_batch_size_bucket",
                 "dllm_request_latency_seconds_count", "dllm_generated_tokens_total"):  # fmt: skip
        assert name in text, name


def _histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(le, cumulative count) per bucket, the sum and the count of one histogram in Prometheus text."""
    assert f"# TYPE {name} histogram" in text and f"# HELP {name} " in text, name
    buckets, total, count = [], None, None
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(line.split()[-1])))
        elif line.startswith(name + "_sum "):
            total = float(line.split()[-1])
        elif line.startswith(name + "_count "):
            count = float(line.split()[-1])
    return buckets, total, count


def test_latency_histograms_after_requests():
    """Queue time, time to first token and end-to-end latency, scraped after plain, streamed and denoising
    requests (a refused request is not timed); every line of the page is a comment or `name{labels} value`."""
    import math
    import re

    from fastapi.testclient import TestClient

    from dllm.serving.app import build_app

    srv = make_server()
    with TestClient(build_app(srv.state)) as http:
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 8}).status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "b"}]}).is_success
        streamed = http.post("/v1/completions", json={"prompt": "c", "max_tokens": 16, "stream": True})
        assert streamed.text.rstrip().endswith("[DONE]")
        assert http.post("/v1/denoise", json={"prompt": "d", "max_tokens": 8}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "e", "max_tokens": "8"}).status_code == 400
        text = http.get("/metrics").text
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [0-9.e+-]+$')
    assert all(line.startswith("# ") or sample.match(line) for line in text.splitlines()), text
    sums = {}
    for name in ("dllm_request_queue_time_seconds", "dllm_time_to_first_token_seconds", "dllm_request_latency_seconds"):
        buckets, total, count = _histogram(text, name)
        assert count == 4, (name, count)  # the four answered requests, not the refused one
        assert buckets[-1] == (math.inf, count) and len(buckets) >= 10
        assert all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(buckets, buckets[1:], strict=False))  # cumulative
        assert total > 0
        sums[name] = total
    assert sums["dllm_time_to_first_token_seconds"] <= sums["dllm_request_latency_seconds"]
    assert sums["dllm_request_queue_time_seconds"] < sums["dllm_request_latency_seconds"]


def test_completion_and_chat(client):
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=12)
    c = r.choices[0]
    assert len(c.text) == 12 and c.text.isprintable() and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)
    again = client.completions.create(model="tiny", prompt="hello", max_tokens=12)
    assert again.choices[0].text == c.text  # greedy is deterministic
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    msg = chat.choices[0].message
    assert msg.role == "assistant" and len(msg.content) == 8 and chat.object == "chat.completion"
    # the chat template renders the conversation: the same as a completion of the rendered prompt
    rendered = tiny_loaded().tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], True).ids
    assert chat.usage.prompt_tokens == len(rendered)
    same = client.completions.create(model="tiny", prompt=rendered, max_tokens=8)
    assert same.choices[0].text == msg.content


def test_diffusion_fields_change_the_decode(client):
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=16)
    assert base.model_extra["dllm"]["nfe"] == 16
    fast = client.completions.create(
        model="tiny", prompt="abc", max_tokens=16, extra_body={"steps": 4, "block_length": 4}
    )
    assert fast.model_extra["dllm"]["nfe"] == 4 and fast.model_extra["dllm"]["tokens_per_forward"] == 4.0
    thr = client.completions.create(model="tiny", prompt="abc", max_tokens=16,
                                    extra_body={"policy": "threshold", "threshold": 0.01})  # fmt: skip
    assert thr.model_extra["dllm"]["nfe"] < 16


def test_streaming_sends_text_as_positions_commit(client):
    whole = client.completions.create(model="tiny", prompt="stream me", max_tokens=32,
                                      extra_body={"block_length": 8})  # fmt: skip
    chunks = list(client.completions.create(model="tiny", prompt="stream me", max_tokens=32, stream=True,
                                            extra_body={"block_length": 8}))  # fmt: skip
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(pieces) == whole.choices[0].text
    assert len(pieces) >= 4  # four blocks decoded left to right: text arrives block by block at least
    assert chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}], max_tokens=16,
                                          stream=True, stream_options={"include_usage": True})  # fmt: skip
    chat = list(chat)
    assert chat[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert len(text) == 16 and chat[-1].usage.completion_tokens == 16


def test_n_choices_and_seeds(client):
    greedy = client.completions.create(model="tiny", prompt="n", max_tokens=8, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1  # greedy rows of one prompt agree
    assert greedy.usage.completion_tokens == 24

    def sample(seed: int) -> list[str]:
        r = client.completions.create(model="tiny", prompt="n", max_tokens=16, n=2, temperature=1.0, seed=seed)
        return [c.text for c in r.choices]

    first = sample(7)
    assert first == sample(7) and first != sample(8)
    assert first[0] != first[1]  # two draws, not one copied
    # two prompts x n: choices in prompt order
    two = client.completions.create(model="tiny", prompt=["n", "hello"], max_tokens=8, n=2)
    alone = client.completions.create(model="tiny", prompt="hello", max_tokens=8)
    assert [c.text for c in two.choices][2:] == [alone.choices[0].text] * 2


def test_seeded_request_is_reproducible_under_concurrent_load(server, client):
    args = {"model": "tiny", "prompt": "seeded", "max_tokens": 16, "temperature": 1.0, "seed": 3}
    quiet = client.completions.create(**args).choices[0].text
    with ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(client.completions.create, model="tiny", prompt=f"p{i}", max_tokens=16, temperature=1.0)
                 for i in range(5)]  # fmt: skip
        busy = pool.submit(client.completions.create, **args)
        assert busy.result().choices[0].text == quiet
        [f.result() for f in noise]


def test_stop_strings(client):
    full = client.completions.create(model="tiny", prompt="stop", max_tokens=32).choices[0].text
    stop = full[6:8]
    expected = full[: full.find(stop)]
    r = client.completions.create(model="tiny", prompt="stop", max_tokens=32, stop=[stop, "never-there"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(expected) + len(stop)  # bytes: the tokens up to the end of the stop
    streamed = client.completions.create(model="tiny", prompt="stop", max_tokens=32, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_batched_results_equal_each_request_alone(server, client):
    prompts = ["a", "bb", "ccc 1", "dddd + 12", "e", "the quick brown", "7 + 8 =", "x"]
    alone = {p: client.completions.create(model="tiny", prompt=p, max_tokens=16).choices[0].text for p in prompts}
    batches = _metric(server, "dllm_batches_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=16), prompts))
    assert {p: r.choices[0].text for p, r in zip(prompts, together, strict=True)} == alone
    assert _metric(server, "dllm_batches_total") - batches <= len(prompts)  # a group per arrival of equal settings
    assert max(r.model_extra["dllm"]["batch_rows"] for r in together) > 1  # some shared forwards


def test_denoise_stream_shows_masks_turning_into_tokens(server):
    with httpx.stream("POST", server.url + "/v1/denoise", json={"prompt": "abc", "max_tokens": 8}) as resp:
        assert resp.status_code == 200
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    frames = [json.loads(e) for e in events[:-1]]
    steps = [f for f in frames if f["object"] == "denoise.frame" and not f["final"]]
    masked = [sum(t is None for t in f["choices"][0]["tokens"]) for f in steps]
    assert masked == list(range(7, -1, -1))  # one position per step, never re-masked
    assert [f["nfe"] for f in steps] == list(range(1, 9))  # the NFE of the call so far, one forward per step
    last = [f for f in frames if f["object"] == "denoise.frame" and f["final"]]
    assert len(last) == 1 and last[0]["choices"] == steps[-1]["choices"]
    done = frames[-1]
    assert done["object"] == "denoise.done" and "".join(steps[-1]["choices"][0]["tokens"]) == done["choices"][0]["text"]
    assert done["dllm"]["nfe"] == 8
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with httpx.stream("POST", server.url + "/v1/denoise", json=chat) as resp:
        chat_done = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")][-1]
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat).json()
    assert chat_done["choices"][0]["text"] == answer["choices"][0]["message"]["content"]
    # the same frames ride a streamed completion that asks for them, beside its text chunks
    body = {"prompt": "abc", "max_tokens": 8, "stream": True, "denoise": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as resp:
        mixed = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert sum(e["object"] == "denoise.frame" for e in mixed) == 8 + 1  # the steps, then the final canvas
    assert (
        "".join(e["choices"][0]["text"] for e in mixed if e["object"] == "text_completion" and e["choices"])
        == (done["choices"][0]["text"])
    )


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b'{"prompt": 3}', 400, "prompt"),
        (b'{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "x", "policy": "nope"}', 400, "policy"),
        (b'{"prompt": "x", "max_tokens": 8, "block_length": 4, "steps": 3}', 400, "steps"),
        (b'{"prompt": "x", "block_length": 0}', 400, "block_length"),
        (b'{"prompt": "x", "block_length": "four"}', 400, "block_length"),
        (b'{"prompt": "x", "block_length": -2}', 400, "block_length"),
        (b'{"prompt": "x", "steps": [4]}', 400, "steps"),
        (b'{"prompt": "x", "cache": "block"}', 400, "cache"),
        (b'{"prompt": "x", "denoise_entropy_bound": 0.5}', 400, "denoise_entropy_bound"),  # DiffusionGemma's only
        (b'{"prompt": "x", "colour": 1}', 400, "colour"),
        (b'{"prompt": "x", "draft_model": "d"}', 400, "draft_model"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "model"),
        (b'{"prompt": "x", "max_tokens": 200}', 400, "max_tokens"),
        (b'{"prompt": "' + b"y" * 120 + b'", "max_tokens": 16}', 400, "max_tokens"),
        (b'{"prompt": [1, 99999]}', 400, "prompt"),
        (b'{"prompt": ' + json.dumps([str(i) for i in range(17)]).encode() + b', "n": 16}', 400, "n"),
    ],
)
def test_bad_requests_are_openai_errors(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["param"] == param, err


def test_tokenize_and_detokenize(server, client):
    """vLLM's /tokenize and /detokenize: the ids a completion or a chat completion would decode from."""
    post = lambda path, **body: httpx.post(server.url + path, json=body)  # noqa: E731
    r = post("/tokenize", model="tiny", prompt="h\u00e9llo")
    assert r.json() == {"tokens": list("h\u00e9llo".encode()), "count": 6, "max_model_len": MAX_LEN}
    turns = [{"role": "user", "content": "hi"}]
    chat = post("/tokenize", messages=turns).json()
    answer = client.chat.completions.create(model="tiny", messages=turns, max_tokens=4)
    assert chat["count"] == len(chat["tokens"]) == answer.usage.prompt_tokens
    bare = post("/tokenize", messages=turns, add_generation_prompt=False).json()
    assert bare["count"] < chat["count"] and chat["tokens"][: bare["count"]] == bare["tokens"]
    assert post("/detokenize", tokens=r.json()["tokens"]).json() == {"prompt": "h\u00e9llo"}
    assert post("/detokenize", tokens=[104, 258]).json() == {"prompt": "h<|eos|>"}  # special tokens by name
    assert post("/detokenize", tokens=[]).json() == {"prompt": ""}
    for path, body, status, param in (
        ("/detokenize", {"tokens": [1, 260]}, 400, "tokens.1"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": 5}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": turns}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x", "name": "a"}]}, 400, "messages.0.name"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ):
        r = post(path, **body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (path, body, r.text)
    odd = httpx.post(
        server.url + "/tokenize", content=b'{"prompt": "\\ud800"}', headers={"Content-Type": "application/json"}
    )
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "prompt"
    plain = httpx.post(server.url + "/detokenize", content=b'{"tokens": []}', headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415


def test_openai_client_raises_the_matching_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x" * 100, max_tokens=64)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    assert client.completions.create(model="tiny", prompt="still up", max_tokens=4).choices[0].text


def test_queue_full_is_429_and_disconnect_cancels():
    # a model that takes 10 ms a forward: a request of 120 steps takes 1.2 s or more on any machine; one request
    # at a time (max_calls 1), so that a second request waits in the queue
    with make_server(slow_loaded(0.01), max_batch=1, max_wait_ms=0, max_queue=1, max_calls=1) as srv:
        long = {"prompt": "long", "max_tokens": 120, "steps": 120}
        hold = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                kwargs={"json": {**long, "max_tokens": 96, "steps": 96}, "timeout": 60})  # fmt: skip
        hold.start()
        wait_until(lambda: httpx.get(srv.url + "/health").json()["running_rows"] == 1)
        queued = threading.Thread(target=httpx.post, args=(srv.url + "/v1/completions",),
                                  kwargs={"json": {"prompt": "q", "max_tokens": 4}, "timeout": 60})  # fmt: skip
        queued.start()
        wait_until(lambda: httpx.get(srv.url + "/health").json()["queue_length"] == 1)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "over", "max_tokens": 4})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        hold.join()
        queued.join()
        # a streaming client that goes away: its sampler call stops at the next step
        batches = _metric(srv, "dllm_batches_total")
        t0 = time.monotonic()
        with httpx.stream("POST", srv.url + "/v1/completions", json={**long, "stream": True}) as resp:
            next(resp.iter_lines())
        wait_until(lambda: _metric(srv, "dllm_cancelled_total") == 1)
        wait_until(lambda: httpx.get(srv.url + "/health").json()["running_rows"] == 0)
        assert _metric(srv, "dllm_batches_total") == batches  # aborted, not finished
        assert time.monotonic() - t0 < 30
        # a plain (not streamed) request whose client gives up: cancelled as well
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=long, timeout=0.2)
        wait_until(lambda: _metric(srv, "dllm_cancelled_total") == 2)
        wait_until(lambda: httpx.get(srv.url + "/health").json()["running_rows"] == 0)
        assert _metric(srv, "dllm_batches_total") == batches
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "next", "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize("mode", ["one call", "turns", "running batch"])
def test_a_short_request_behind_a_long_one(mode):
    """One request at a time, a short request waits for the long one to end. A cached request (prefix cache: a
    forward of its own) starts at once, each step of the engine running a forward of each, and ends after about
    twice its own steps; an uncached one joins the running canvas batch at its next step (in a forward of its
    own: its canvas is under half the long one's). Either way it ends while the long one still runs."""
    max_calls, max_batch = (1, 1) if mode == "one call" else (None, 8)
    extra = {"cache": "prefix"} if mode == "turns" else {}
    with make_server(slow_loaded(0.01), max_batch=max_batch, max_wait_ms=0, max_calls=max_calls) as srv:
        ends: dict[str, float] = {}
        shared: dict[str, float] = {}

        def post(name: str, body: dict) -> None:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": name, **body, **extra}, timeout=60)
            assert r.status_code == 200, r.text
            ends[name], shared[name] = time.monotonic(), r.json()["dllm"]["batch_rows"]

        long = threading.Thread(target=post, args=("long", {"max_tokens": 96, "steps": 96}))
        started = time.monotonic()
        long.start()
        wait_until(lambda: httpx.get(srv.url + "/health").json()["running_rows"] == 1)
        t0 = time.monotonic()
        post("short", {"max_tokens": 8, "steps": 8})
        long.join()
        if mode == "one call":
            assert ends["short"] > ends["long"]  # it waited for the whole long call
        else:
            # ~8-16 forwards of the slow model's 10 ms, against the long call's ~96: well under half of it, on any load
            assert ends["short"] < ends["long"] and ends["short"] - t0 < 0.5 * (ends["long"] - started)
        # in the running batch too: a canvas under half the longest of a forward gets a forward of its own
        assert shared["short"] == 1


def test_api_key_in_process():
    """The app in-process (TestClient as the openai client's transport): a key is required when set."""
    from fastapi.testclient import TestClient

    from dllm.serving.app import build_app

    srv = make_server(api_key=KEY)
    with TestClient(build_app(srv.state)) as http:
        assert http.get("/health").status_code == 200 and http.get("/").status_code == 200
        assert http.get("/v1/models").status_code == 401
        assert http.get("/metrics").status_code == 401
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [120]})):
            assert http.post(path, json=body).status_code == 401
            assert http.post(path, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="tiny", prompt="x")
        right = openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)
        assert len(right.completions.create(model="tiny", prompt="x", max_tokens=5).choices[0].text) == 5


def test_cli_serve_over_loopback(tmp_path: Path):
    """`dllm serve --model DIR --api-key KEY` in its own process, then the openai client."""
    from dllm.models.hf_io import export_hf
    from tests.distributed.harness import free_port

    model, cfg = tiny_model()
    export_hf(model.state_dict(), cfg, tmp_path / "tiny-model")
    port = free_port()
    cmd = [sys.executable, "-m", "dllm.cli.main", "serve", "--model", str(tmp_path / "tiny-model"), "--port",
           str(port), "--api-key", KEY, "--set", "gen_length=8"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: proc.poll() is not None or _up(url), timeout=120)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        cli = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert [m.id for m in cli.models.list().data] == ["tiny-model"]
        r = cli.completions.create(model="tiny-model", prompt="hello")
        assert len(r.choices[0].text) == 8  # the server's default gen_length from --set
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_cli_serve_user_errors(tmp_path: Path):
    import socket

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dllm.cli.main", "serve", *args], capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        for res, expected in (
            (serve("--model", str(tmp_path / "nowhere")), "nowhere"),
            (serve("--model", str(tmp_path), "--port", str(busy.getsockname()[1])), "choose another port"),
            (serve("--model", str(tmp_path / "nowhere"), "--api-key", ""), "--api-key is empty"),  # before loading
        ):
            assert res.returncode == 2 and res.stderr.startswith("dllm: error:"), res.stderr
            assert len(res.stderr.splitlines()) == 1 and expected in res.stderr


def test_cli_serve_refuses_an_api_key_no_client_can_send(tmp_path: Path, monkeypatch, capsys):
    """An empty key (an unset variable) would serve without one: refused at start, like a key that cannot
    travel in a header; the limits' flags are checked against the model."""
    from dllm.cli.main import main
    from dllm.models.hf_io import export_hf

    nowhere = str(tmp_path / "nowhere")
    for env, args, expected in (
        ("", [], "$DLLM_API_KEY is empty"),
        (None, ["--api-key", "two words"], "--api-key: an API key travels in an HTTP header"),
        (None, ["--api-key", "k\u00e9y"], "printable ASCII"),
    ):
        if env is None:
            monkeypatch.delenv("DLLM_API_KEY", raising=False)
        else:
            monkeypatch.setenv("DLLM_API_KEY", env)
        assert main(["serve", "--model", nowhere, *args]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and expected in err, err
    monkeypatch.delenv("DLLM_API_KEY", raising=False)
    model, cfg = tiny_model()
    export_hf(model.state_dict(), cfg, tmp_path / "tiny-model")
    assert main(["serve", "--model", str(tmp_path / "tiny-model"), "--max-prompt-tokens", "500"]) == 2
    err = capsys.readouterr().err
    assert "--max-prompt-tokens must be a finite number in [1, 127]" in err and len(err.splitlines()) == 1, err


def test_a_failing_sampler_is_a_500_and_the_server_goes_on():
    """Nothing a request does stops the worker: a model that raises answers 500 twice, then health is ok."""
    import torch
    from fastapi.testclient import TestClient

    from dllm.serving.app import build_app

    class Exploding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, *args, **kwargs):
            raise RuntimeError("boom")

    loaded = tiny_loaded()
    loaded.model = Exploding()
    srv = make_server(loaded)
    with TestClient(build_app(srv.state)) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4})
            assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        streamed = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
        assert '"server_error"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
        assert http.get("/health").json()["status"] == "ok" and srv.state.engine.thread.is_alive()
        assert srv.state.engine.metrics.value("dllm_cancelled_total") == 0  # failed, not cancelled


def test_block_model_rounds_max_tokens_to_whole_blocks():
    """A block-diffusion profile: the canvas is whole blocks of the trained size, the text is cut back to
    max_tokens, and its exact block cache gives the uncached text."""
    from fastapi.testclient import TestClient

    from dllm.serving.app import build_app
    from dllm.serving.protocol import CompletionRequest, sampler_settings

    loaded = tiny_loaded()
    loaded.profile = loaded.profile.model_copy(update={"attention": "block", "block_size": 4, "objective": "bd3lm"})
    srv = make_server(loaded)
    settings = sampler_settings(CompletionRequest(prompt="x", max_tokens=10), srv.state.base, loaded.profile, 128)
    assert (settings.cfg.gen_length, settings.cfg.block_length, settings.max_tokens) == (12, 4, 10)
    with TestClient(build_app(srv.state)) as http:
        plain = http.post("/v1/completions", json={"prompt": "blocks", "max_tokens": 10}).json()
        cached = http.post("/v1/completions", json={"prompt": "blocks", "max_tokens": 10, "cache": "block"}).json()
        assert len(plain["choices"][0]["text"]) == 10 and plain["usage"]["completion_tokens"] == 10
        assert cached["choices"][0]["text"] == plain["choices"][0]["text"]
        bad = http.post("/v1/completions", json={"prompt": "x", "block_length": 8})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "block_length"


def test_models_not_served_yet_are_refused():
    from dllm.errors import ConfigError

    loaded = tiny_loaded()
    loaded.profile = loaded.profile.model_copy(update={"objective": "dflash_distillation"})
    with pytest.raises(ConfigError, match="not served on its own; export the run"):
        make_server(loaded)
