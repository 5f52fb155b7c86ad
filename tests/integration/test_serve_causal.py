"""Serving a causal model: AR decoding with a KV cache, and speculative decoding with a DFlash drafter, through
the official openai client. The served text equals `generate` with generation causal on the same prompts
(greedy), the speculative server's equals the AR server's token for token, streams carry the same text,
and a diffusion-only field is a 400 naming it. (The DFlash drafter has random weights: it is accepted
rarely, which the lossless check does not need.)"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dllm.config.drafter import DFlashConfig  # noqa: E402
from dllm.config.sampler import SamplerConfig, resolve_sampler  # noqa: E402
from dllm.errors import ConfigError  # noqa: E402
from dllm.inference.engine import generate  # noqa: E402
from dllm.models.dflash import DFlashDrafter  # noqa: E402
from dllm.sampling.canvas import SpecialIds  # noqa: E402
from tests.integration.serve_support import slow_loaded, tiny_loaded, wait_until  # noqa: E402

PROMPTS = ["hello", "a longer prompt than the first", "x"]


def causal_base(loaded, gen_length: int = 16) -> SamplerConfig:
    return resolve_sampler(SamplerConfig(generation="causal", gen_length=gen_length, stop_at_eos=False), loaded.profile)


def random_drafter(loaded, block: int = 4) -> DFlashDrafter:
    cfg = DFlashConfig(num_layers=1, block_size=block, target_layer_ids=(0, 1), mask_id=loaded.profile.mask_id,
                       target=loaded.model_cfg)  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(3))
    return drafter.attach(loaded.model).eval()


def serve(loaded, drafter=None):
    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    state = make_state(loaded, causal_base(loaded), model_id="tiny", drafter=drafter, max_wait_ms=50)
    return BackgroundServer(state, port=free_port())


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_ar_and_speculative_serving_equal_generate():
    loaded = tiny_loaded()
    tok = loaded.tokenizer
    cfg = causal_base(loaded, 12)
    expected = [tok.decode(s) for s in generate(loaded.model, [tok.encode(p) for p in PROMPTS], cfg,
                                                SpecialIds.of(loaded.profile)).sequences]  # fmt: skip
    served = {}
    for name, drafter in (("ar", None), ("speculative", random_drafter(loaded))):
        with serve(loaded, drafter) as srv:
            client = client_of(srv)
            r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
            served[name] = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
            stats = r.model_extra["dllm"]
            if drafter is None:
                assert stats["tau"] == 1.0 and stats["drafted"] == 0
            else:
                assert stats["drafted"] == 3 * stats["rounds"] > 0
            streamed = "".join(
                chunk.choices[0].text
                for chunk in client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, stream=True)
            )
            assert streamed == served[name][1]
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6)  # fmt: skip
            assert len(tok.encode(chat.choices[0].message.content)) <= 6
            with pytest.raises(openai.BadRequestError, match="steps: no effect on this server.s causal decoding"):
                client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"steps": 4})
            top_k = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"top_k": 1})
            assert top_k.choices[0].text
    assert served["ar"] == expected and served["speculative"] == expected


def test_a_drafter_needs_a_causal_sampler():
    from dllm.serving.server import make_state

    loaded = tiny_loaded()
    diffusion = resolve_sampler(SamplerConfig(gen_length=16), loaded.profile)
    with pytest.raises(ConfigError, match="--draft: a drafter proposes tokens for a causal model"):
        make_state(loaded, diffusion, drafter=random_drafter(loaded))


def test_serve_cli_refuses_a_block_size_without_a_drafter(capsys):
    from dllm.cli.main import main

    assert main(["serve", "--model", "nowhere", "--ar", "--draft-block-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--draft-block-size applies to speculative decoding" in err and err.strip().count("\n") == 0


def test_a_public_layout_drafter_serves_what_ar_serves(tmp_path):
    """serve --draft with a drafter folder in the public DFlash layout (what SGLang and vLLM load), loaded as the
    command loads it (setup_sampling): the served text equals the AR server's."""
    from dllm.inference.assembly import setup_sampling
    from dllm.models.dflash_io import save_drafter
    from tests.unit.test_dflash import write_causal_target

    write_causal_target(tmp_path / "target")  # 3 layers
    sampler = SamplerConfig(generation="causal", gen_length=12, stop_at_eos=False)
    ar = setup_sampling(sampler, torch.device("cpu"), model_dir=tmp_path / "target")
    cfg = DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(0, 1), mask_id=ar.loaded.profile.mask_id,
                       target=ar.loaded.model_cfg, architecture="dflash")  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(3))
    save_drafter(tmp_path / "drafter", drafter.attach(ar.loaded.model))
    spec = setup_sampling(sampler, torch.device("cpu"), model_dir=tmp_path / "target", drafter_dir=tmp_path / "drafter")
    assert spec.drafter is not None and spec.drafter.block_size == 4
    served = []
    for s in (ar, spec):
        with serve(s.loaded, s.drafter) as srv:
            r = client_of(srv).completions.create(model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0)
            served.append([c.text for c in sorted(r.choices, key=lambda c: c.index)])
            assert (r.model_extra["dllm"]["drafted"] > 0) == (s.drafter is not None)
    assert served[0] == served[1]


def _post(url: str, ends: dict, name: str, body: dict) -> None:
    import httpx

    r = httpx.post(
        url + "/v1/completions", json={"model": "tiny", "prompt": name, "temperature": 0, **body}, timeout=60
    )
    assert r.status_code == 200, r.text
    ends[name] = (time.monotonic(), r.json())


def _health(url: str) -> dict:
    import httpx

    return httpx.get(url + "/health").json()


def test_requests_join_the_running_batch_between_forwards():
    """A causal model's running batch: short requests that arrive while a long one decodes join it at the next
    forward (they share its forwards: batch_rows > 1), end long before it, and decode what they decode alone."""
    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    loaded = slow_loaded(0.02)
    tok, special = loaded.tokenizer, SpecialIds.of(loaded.profile)
    state = make_state(loaded, causal_base(loaded, 96), model_id="tiny", max_batch=8, max_wait_ms=0)
    ends: dict[str, tuple[float, dict]] = {}
    with BackgroundServer(state, port=free_port()) as srv:
        long = threading.Thread(target=_post, args=(srv.url, ends, "the long one", {"max_tokens": 96}))
        started = time.monotonic()
        long.start()
        wait_until(lambda: _health(srv.url)["running_rows"] == 1)
        t0 = time.monotonic()
        shorts = [threading.Thread(target=_post, args=(srv.url, ends, p, {"max_tokens": 8})) for p in ("a", "bc", "d")]
        for t in shorts:
            t.start()
        for t in shorts:
            t.join()
        long.join()
        wait_until(lambda: _health(srv.url)["running_rows"] == 0)
    end_long = ends["the long one"][0]
    for p in ("a", "bc", "d"):
        end, body = ends[p]
        # ~9 forwards of 20 ms beside the long one's ~96: well under half of it, on any load
        assert end < end_long and end - t0 < 0.5 * (end_long - started)
        assert body["dllm"]["batch_rows"] > 1  # it shared forwards with the long one (and its peers)
    for name, (_, body) in ends.items():  # each decodes what it decodes alone
        cfg = causal_base(loaded, 96 if name == "the long one" else 8)
        alone = generate(loaded.model, [tok.encode(name)], cfg, special).sequences[0]
        assert body["choices"][0]["text"] == tok.decode(alone)


def test_a_client_that_goes_away_frees_its_rows():
    """A streamed request whose client disconnects leaves the running batch at the next forward."""
    import httpx

    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    loaded = slow_loaded(0.02)
    state = make_state(loaded, causal_base(loaded, 96), model_id="tiny", max_batch=8, max_wait_ms=0)
    with BackgroundServer(state, port=free_port()) as srv:
        body = {"model": "tiny", "prompt": "go", "max_tokens": 96, "stream": True, "n": 2}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (kept: a dropped iterator closes the response)
            next(lines)  # the stream is open
            wait_until(lambda: _health(srv.url)["running_rows"] == 2)  # its two rows run
        wait_until(lambda: _health(srv.url)["running_rows"] == 0, timeout=10)  # long before its 96 forwards of 20 ms


def test_speculative_and_ar_requests_share_the_running_batch():
    """A server with a drafter: requests that send `speculative: false` decode without it (AR), the others with it,
    all in one running batch (their forwards shared), each equal to `generate` of it alone, greedy token for
    token and sampled from its seed; `speculative` is refused where there is no drafter."""
    loaded = tiny_loaded()
    tok, special = loaded.tokenizer, SpecialIds.of(loaded.profile)
    drafter = random_drafter(loaded)
    bodies = [{"prompt": f"request {i} " * (1 + i % 3), "max_tokens": 8 + 4 * (i % 3), "speculative": i % 2 == 0,
               **({"temperature": 1.0, "seed": 50 + i} if i % 4 == 1 else {})} for i in range(8)]  # fmt: skip
    got: dict[int, dict] = {}
    with serve(loaded, drafter) as srv:

        def post(i: int) -> None:
            got[i] = httpx.post(srv.url + "/v1/completions", json=bodies[i], timeout=60).json()

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, body in enumerate(bodies):
        cfg = causal_base(loaded, body["max_tokens"]).model_copy(update={"temperature": body.get("temperature", 0.0)})
        gen = torch.Generator().manual_seed(body["seed"]) if "seed" in body else None
        alone = generate(loaded.model, [tok.encode(body["prompt"])], cfg, special, generator=gen,
                         drafter=drafter if body["speculative"] else None)  # fmt: skip
        assert got[i]["choices"][0]["text"] == tok.decode(alone.sequences[0]), i
        stats = got[i]["dllm"]
        assert (stats["drafted"] > 0) == body["speculative"], i
    assert max(got[i]["dllm"]["batch_rows"] for i in got) > 1  # forwards were shared
    with serve(loaded) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "speculative": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "speculative"
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "speculative": False})
        assert ok.status_code == 200
