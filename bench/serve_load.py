"""Load on `dllm serve` over loopback: mixed lengths through the step-level scheduler vs the one-call-at-a-time
engine (default, `--mode mixed`), or batching across requests vs --max-batch 1 (`--mode batching`); then an
RSS soak.

--mode mixed (the serving engine's comparison): random models (the `tiny` preset over bytes, no training
needed: a request's cost does not depend on what the weights say), served twice each as subprocesses on
loopback: the default engine (every request joins the inference engine's running batch, sharing forwards
where its settings allow) and --max-calls 1 (one request at a time, each to its end, the engine before).
For a causal model (`serve --ar`, a random llama) and a diffusion model (MDLM), --rounds rounds
of --clients concurrent requests whose max_tokens cycle through 8..512 (EOS off, so every request makes
its length), alternating the two servers round by round. Reported per model and engine: generated
tokens/s (median over rounds) and the ratio (target >= 1.5), p50/p99 latency, errors (target 0); and
the latency of an 8-token request sent while a 512-token one runs, over its latency alone (target <=
3x). Kind `speculative`: the random llama served with --draft (a random DFlash drafter of it), half of the
requests sending `speculative: false` (AR), all in one running batch: tokens/s, the speculative counters, and
how many requests' text equals `generate` of each alone (in-process, with or without the drafter as asked).
Then the default causal server runs the same mixed load for --soak-s seconds (default 300) and its
resident memory (VmRSS) is read after a first round at full load and at the end (target: growth < 10%).

--mode batching (one length for every request): --rounds rounds of --clients concurrent requests of
--max-tokens tokens against `--max-batch 64` and `--max-batch 1`: tokens/s of each and their ratio
(target >= 2.5), p50/p99 latency, errors, and the ceiling: the same decode as one generate call of all
the rows vs one call per row, without a server (on a small CPU the model's compute, not the loop's
overhead, bounds what batching can win); then the soak of the batched server.

Everything is bounded: a round has --clients requests and a timeout, the soak stops by itself.

    PYTHONPATH=src python bench/serve_load.py [--mode mixed|batching] [--soak-s 300] [--clients 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def write_model(folder: Path, preset: str, max_len: int, family: str | None = None) -> Path:
    """A random model folder (`family` llama: an AR model, served with --ar; None: the preset's, MDLM)."""
    import torch

    from dllm.config.model import ModelConfig
    from dllm.models.hf_io import export_hf
    from dllm.models.transformer import Transformer

    extra = {"family": family} if family is not None else {}
    cfg = ModelConfig(preset=preset, vocab_size=260, max_seq_len=max_len, **extra)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return export_hf(model.state_dict(), cfg, folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`dllm serve` in a subprocess on a free loopback port."""

    def __init__(self, model: Path, max_batch: int, max_wait_ms: float, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dllm.cli.main", "serve", "--model", str(model), "--port", str(self.port),
               "--max-batch", str(max_batch), "--max-wait-ms", str(max_wait_ms), "--max-queue", "1024",
               *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server did not start: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 120:
                raise SystemExit("the server did not answer within 120 s")
            time.sleep(0.2)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def one_round(url: str, clients: int, max_tokens: int, round_idx: int, timeout_s: float) -> dict:
    """`clients` concurrent requests of `max_tokens` each (the server's temperature)."""
    return await mixed_round(url, [max_tokens] * clients, round_idx, timeout_s, greedy=False)


def mean_batch_rows(srv: Server) -> float:
    """Rows per sampler call so far, from the server's /metrics."""
    values = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith(("dllm_batch_size_sum", "dllm_batch_size_count")):
            values[line.split()[0]] = float(line.split()[1])
    return round(values["dllm_batch_size_sum"] / max(values["dllm_batch_size_count"], 1), 2)


def percentile(xs: list[float], q: float) -> float:
    return xs[min(int(q * len(xs)), len(xs) - 1)] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("mixed", "batching"), default="mixed")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="Rounds per server (default: mixed 2, batching 4).")
    ap.add_argument(
        "--kinds",
        default="ar,diffusion,speculative",
        help="mixed: the models compared (ar, diffusion; speculative: the mixed AR + drafter load).",
    )
    ap.add_argument("--lengths", default="8,16,32,64,128,256,512", help="mixed: the max_tokens the clients cycle.")
    ap.add_argument("--max-tokens", type=int, default=32, help="batching: every request's max_tokens.")
    ap.add_argument("--max-batch", type=int, default=64, help="The batched server's --max-batch.")
    ap.add_argument(
        "--max-wait-ms",
        type=float,
        default=200.0,
        help="The batched server's --max-wait-ms (a round of 64 arrives over ~100 ms).",
    )
    ap.add_argument("--preset", default="tiny", help="Model size preset (random weights): tiny, demo, ...")
    ap.add_argument("--soak-s", type=float, default=300.0, help="Seconds of load on the batched server (0: none).")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each server.")
    ap.add_argument("--round-timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` or kill still stops the servers
    # one intra-op thread per server: on a shared 2-core box a busy-waiting second thread costs more than it gives
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.mode == "mixed":
        args.rounds = args.rounds or 2
        return mixed(args)
    args.rounds = args.rounds or 4
    work = Path(tempfile.mkdtemp(prefix="dllm-serve-load-"))
    model = write_model(work / "model", args.preset, max_len=args.max_tokens + 64)
    servers = {"batched": Server(model, args.max_batch, args.max_wait_ms), "max_batch_1": Server(model, 1, 0.0)}
    results: dict[str, list[dict]] = {k: [] for k in servers}
    try:
        for srv in servers.values():  # warm-up: first calls pay for lazy init
            asyncio.run(one_round(srv.url, 4, args.max_tokens, -1, args.round_timeout_s))
        for r in range(args.rounds):
            for name, srv in servers.items():
                res = asyncio.run(one_round(srv.url, args.clients, args.max_tokens, r, args.round_timeout_s))
                results[name].append(res)
                print(json.dumps({"bench": "serve_load_round", "server": name, "round": r, "tokens": res["tokens"],
                                  "wall_s": round(res["wall_s"], 3), "tokens_per_s": round(res["tokens_per_s"], 1),
                                  "errors": res["errors"]}), flush=True)  # fmt: skip
        summary_rows = {name: mean_batch_rows(srv) for name, srv in servers.items()}
        servers.pop("max_batch_1").stop()
        summary = {"bench": "serve_load", "clients": args.clients, "rounds": args.rounds, "max_tokens": args.max_tokens,
                   "preset": args.preset, "max_batch": args.max_batch}  # fmt: skip
        for name, rounds in results.items():
            lat = sorted(x for res in rounds for x in res["latencies"])
            summary[f"{name}_tokens_per_s"] = round(statistics.median(res["tokens_per_s"] for res in rounds), 1)
            summary[f"{name}_p50_s"] = round(percentile(lat, 0.5), 3)
            summary[f"{name}_p99_s"] = round(percentile(lat, 0.99), 3)
            summary[f"{name}_errors"] = sum(res["errors"] for res in rounds)
        summary["batched_mean_batch_rows"] = summary_rows["batched"]
        summary["batching_speedup"] = round(summary["batched_tokens_per_s"] / summary["max_batch_1_tokens_per_s"], 2)
        summary["errors"] = summary["batched_errors"] + summary["max_batch_1_errors"]
        summary["sampler_ceiling_speedup"] = sampler_ceiling(model, args)
        if args.soak_s > 0:
            summary.update(soak(servers["batched"], args))
        print(json.dumps(summary), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    return 0


# ---------------------------------------------------------------------------------------------------
# --mode mixed: the step-level scheduler against the one-call-at-a-time engine


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def mixed_round(url: str, lengths: list[int], round_idx: int, timeout_s: float, greedy: bool = True) -> dict:
    """One request per entry of `lengths` (its max_tokens), all at once (`greedy`: temperature 0, else the
    server's); tokens/s over the round's wall time, latencies, errors."""
    latencies: list[float] = []
    tokens, errors = 0, 0

    async def client(i: int, n: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens, errors
        body = {"prompt": f"{(i * 7 + round_idx) % 50} + {(i * 3) % 50} =", "max_tokens": n}
        if greedy:
            body["temperature"] = 0
        t0 = time.perf_counter()
        try:
            r = await http.post(url + "/v1/completions", json=body)
            if r.status_code != 200:
                errors += 1
                return
            tokens += r.json()["usage"]["completion_tokens"]
            latencies.append(time.perf_counter() - t0)
        except httpx.HTTPError:
            errors += 1

    limits = httpx.Limits(max_connections=len(lengths), max_keepalive_connections=len(lengths))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, n, http) for i, n in enumerate(lengths)))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "errors": errors, "latencies": latencies}


def short_behind_long(srv: Server, short: int, long: int, repeats: int = 3) -> dict:
    """The latency of a `short`-token request alone (median of `repeats`), and sent while a `long`-token one runs."""

    def post(n: int) -> float:
        t0 = time.perf_counter()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "7 + 5 =", "max_tokens": n, "temperature": 0},
                       timeout=900)  # fmt: skip
        r.raise_for_status()
        return time.perf_counter() - t0

    alone = statistics.median(post(short) for _ in range(repeats))
    behind = []
    for _ in range(repeats):
        t = threading.Thread(target=post, args=(long,))
        t.start()
        t0 = time.monotonic()
        while t.is_alive() and httpx.get(srv.url + "/health").json()["running_rows"] < 1 and time.monotonic() - t0 < 60:
            time.sleep(0.005)
        time.sleep(0.05)  # the long one is decoding
        behind.append(post(short))
        t.join()
    med = statistics.median(behind)
    return {f"short_{short}_alone_s": round(alone, 3), f"short_{short}_behind_{long}_s": round(med, 3),
            "behind_over_alone": round(med / alone, 2)}  # fmt: skip


def mixed(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    plan = [lengths[i % len(lengths)] for i in range(args.clients)]
    random.Random(0).shuffle(plan)
    work = Path(tempfile.mkdtemp(prefix="dllm-serve-load-"))
    summary: dict = {"bench": "serve_load", "mode": "mixed", "clients": args.clients, "rounds": args.rounds,
                     "lengths": lengths, "preset": args.preset, "max_batch": args.max_batch, "threads": args.threads,
                     "load_average_before": load_avg()}  # fmt: skip
    soak_server = None
    try:
        for kind in args.kinds.split(","):
            if kind == "speculative":
                summary[kind] = speculative_mixed(work, plan, args)
                continue
            model = write_model(work / kind, args.preset, max(lengths) + 64, "llama" if kind == "ar" else None)
            extra = ("--set", "stop_at_eos=false") + (("--ar",) if kind == "ar" else ())
            servers = {"continuous": Server(model, args.max_batch, 10.0, extra),
                       "one_call": Server(model, args.max_batch, 10.0, (*extra, "--max-calls", "1"))}  # fmt: skip
            results: dict[str, list[dict]] = {k: [] for k in servers}
            try:
                for srv in servers.values():  # warm-up: first calls pay for lazy init
                    asyncio.run(mixed_round(srv.url, [8, 8], -1, args.round_timeout_s))
                for r in range(args.rounds):
                    for name, srv in servers.items():
                        res = asyncio.run(mixed_round(srv.url, plan, r, args.round_timeout_s))
                        results[name].append(res)
                        print(json.dumps({"bench": "serve_load_round", "model": kind, "engine": name, "round": r,
                                          "tokens": res["tokens"], "wall_s": round(res["wall_s"], 2),
                                          "tokens_per_s": round(res["tokens_per_s"], 1), "errors": res["errors"]}),
                              flush=True)  # fmt: skip
                out: dict = {}
                for name, rounds in results.items():
                    lat = sorted(x for res in rounds for x in res["latencies"])
                    out[name] = {"tokens_per_s": round(statistics.median(res["tokens_per_s"] for res in rounds), 1),
                                 "p50_s": round(percentile(lat, 0.5), 3), "p99_s": round(percentile(lat, 0.99), 3),
                                 "errors": sum(res["errors"] for res in rounds)}  # fmt: skip
                    out[name].update(short_behind_long(servers[name], min(lengths), max(lengths)))
                    print(json.dumps({"bench": "serve_load_engine", "model": kind, "engine": name, **out[name]}),
                          flush=True)  # fmt: skip
                out["throughput_ratio"] = round(out["continuous"]["tokens_per_s"] / out["one_call"]["tokens_per_s"], 2)
                out["sampler_ceiling_ratio"] = running_batch_ceiling(model, plan, args, causal=kind == "ar")
                summary[kind] = out
            finally:
                servers["one_call"].stop()
                if kind == "ar" and args.soak_s > 0:
                    soak_server = servers["continuous"]
                else:
                    servers["continuous"].stop()
        if soak_server is not None:
            summary["soak_ar_continuous"] = mixed_soak(soak_server, plan, args)
        summary["load_average_after"] = load_avg()
        print(json.dumps(summary), flush=True)
    finally:
        if soak_server is not None:
            soak_server.stop()
    return 0


def running_batch_ceiling(model_dir: Path, plan: list[int], args: argparse.Namespace, causal: bool) -> float:
    """The same mixed load without a server: every request in the inference engine's running batch (shared
    forwards: inference/causal_rows.py for AR, inference/canvas_rows.py for diffusion) vs one `generate` call
    per length (what the one-call
    engine batches), median ratio of interleaved rounds (3 AR, 1 diffusion). On a CPU a forward's cost grows
    with its rows (and a canvas's with its padded length), so sharing forwards saves only their fixed part."""
    import torch

    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.sampler import SamplerConfig, resolve_sampler
    from dllm.inference.engine import Engine, generate, make_loop
    from dllm.inference.scheduler import Limits
    from dllm.sampling.canvas import SpecialIds

    torch.set_num_threads(args.threads)
    loaded = load_for_inference(model_dir=model_dir)
    special = SpecialIds.of(loaded.profile)
    prompts = [loaded.tokenizer.encode(f"{(i * 7) % 50} + {(i * 3) % 50} =") for i in range(len(plan))]

    def cfg(n: int) -> SamplerConfig:
        base = SamplerConfig(gen_length=n, stop_at_eos=False, **({"generation": "causal"} if causal else {}))
        return resolve_sampler(base, loaded.profile)

    def running() -> None:
        engine = Engine(loaded.model, special, Limits(max_rows=len(plan)))
        for p, n in zip(prompts, plan, strict=True):
            engine.add(make_loop(loaded.model, [p], cfg(n), special))
        while engine.busy:
            engine.step()

    def calls() -> None:
        for n in sorted(set(plan)):
            generate(loaded.model, [p for p, k in zip(prompts, plan, strict=True) if k == n], cfg(n), special)

    ratios = []
    for _ in range(3 if causal else 1):
        t0 = time.perf_counter()
        calls()
        t1 = time.perf_counter()
        running()
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    return round(statistics.median(ratios), 2)


def write_drafter(model_dir: Path, folder: Path, block: int = 4) -> Path:
    """A random DFlash drafter (one layer, blocks of `block`) of the model folder `model_dir`."""
    import torch

    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.drafter import DFlashConfig
    from dllm.models.dflash import DFlashDrafter
    from dllm.models.dflash_io import save_drafter

    loaded = load_for_inference(model_dir=model_dir)
    cfg = DFlashConfig(num_layers=1, block_size=block, target_layer_ids=(0, 1), mask_id=loaded.profile.mask_id,
                       target=loaded.model_cfg)  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(3))
    return save_drafter(folder, drafter.attach(loaded.model))


def speculative_mixed(work: Path, plan: list[int], args: argparse.Namespace) -> dict:
    """The mixed load on a --draft server, every other request declining the drafter (`speculative: false`): one
    running batch; each request's text against `generate` of it alone (greedy: token for token)."""
    model = write_model(work / "speculative", args.preset, max(plan) + 64, "llama")
    drafter = write_drafter(model, work / "drafter")
    srv = Server(model, args.max_batch, 10.0, ("--set", "stop_at_eos=false", "--draft", str(drafter)))
    bodies = [{"prompt": f"{(i * 7) % 50} + {(i * 3) % 50} =", "max_tokens": n, "temperature": 0,
               "speculative": i % 2 == 0} for i, n in enumerate(plan)]  # fmt: skip
    try:
        asyncio.run(mixed_round(srv.url, [8, 8], -1, args.round_timeout_s))  # warm-up
        t0 = time.perf_counter()
        replies = asyncio.run(post_all(srv.url, bodies, args.round_timeout_s))
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    ok = [r for r in replies if r is not None]
    tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    spec = [r["dllm"] for r, b in zip(replies, bodies, strict=True) if r is not None and b["speculative"]]
    equal = equal_alone(model, drafter, bodies, replies)
    return {"requests": len(bodies), "speculative_requests": sum(b["speculative"] for b in bodies),
            "errors": len(bodies) - len(ok), "tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
            "mean_batch_rows": round(statistics.mean(r["dllm"]["batch_rows"] for r in ok), 2),
            "speculative_tau": round(statistics.mean(d["tau"] for d in spec), 3) if spec else None,
            "equal_alone": equal, "tokens_equal_alone": equal == len(bodies)}  # fmt: skip


async def post_all(url: str, bodies: list[dict], timeout_s: float) -> list[dict | None]:
    """Every body at once; the replies (None: an error)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:

        async def one(body: dict) -> dict | None:
            try:
                r = await http.post(url + "/v1/completions", json=body)
                return r.json() if r.status_code == 200 else None
            except httpx.HTTPError:
                return None

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def equal_alone(model_dir: Path, drafter_dir: Path, bodies: list[dict], replies: list[dict | None]) -> int:
    """How many replies' text equals `generate` of the request alone (its drafter or none, as it asked)."""
    import torch

    from dllm.config.sampler import SamplerConfig
    from dllm.inference.assembly import setup_sampling
    from dllm.inference.engine import generate

    base = SamplerConfig(generation="causal", gen_length=8, stop_at_eos=False)
    s = setup_sampling(base, torch.device("cpu"), model_dir=model_dir, drafter_dir=drafter_dir)
    tok, equal = s.loaded.tokenizer, 0
    for body, reply in zip(bodies, replies, strict=True):
        cfg = s.sampler.model_copy(update={"gen_length": body["max_tokens"]})
        drafter = s.drafter if body["speculative"] else None
        alone = generate(s.loaded.model, [tok.encode(body["prompt"])], cfg, s.special, drafter=drafter)
        equal += reply is not None and reply["choices"][0]["text"] == tok.decode(alone.sequences[0])
    return equal


def mixed_soak(srv: Server, plan: list[int], args: argparse.Namespace) -> dict:
    """The mixed load, round after round, for soak_s seconds: RSS after a first round at full load (the running
    batch's buffers at their working size), then every tenth of the way and at the end."""
    before_mb = srv.rss_mb()
    first = asyncio.run(mixed_round(srv.url, plan, 99, args.round_timeout_s))
    start_mb = srv.rss_mb()
    t0, requests, errors, series, r = time.monotonic(), len(plan), first["errors"], [round(start_mb, 1)], 0
    while time.monotonic() - t0 < args.soak_s:
        res = asyncio.run(mixed_round(srv.url, plan, 100 + r, args.round_timeout_s))
        requests, errors, r = requests + len(plan), errors + res["errors"], r + 1
        if time.monotonic() - t0 >= len(series) * args.soak_s / 10:
            series.append(round(srv.rss_mb(), 1))
    end_mb = srv.rss_mb()
    return {"soak_s": round(time.monotonic() - t0, 1), "requests": requests, "errors": errors,
            "rss_before_first_round_mb": round(before_mb, 1), "rss_start_mb": round(start_mb, 1),
            "rss_end_mb": round(end_mb, 1),
            "rss_growth": round(end_mb / start_mb - 1, 4), "rss_series_mb": series}  # fmt: skip


def soak(srv: Server, args: argparse.Namespace) -> dict:
    """The batched server under back-to-back rounds for soak_s seconds: RSS at start and end, and
    every tenth of the way (a plateau is the allocator settling; steady growth would be a leak)."""
    start_mb = srv.rss_mb()
    t0, requests, errors, series = time.monotonic(), 0, 0, [round(start_mb, 1)]
    r = 0
    while time.monotonic() - t0 < args.soak_s:
        res = asyncio.run(one_round(srv.url, args.clients, args.max_tokens, 100 + r, args.round_timeout_s))
        requests += args.clients
        errors += res["errors"]
        r += 1
        if time.monotonic() - t0 >= len(series) * args.soak_s / 10:
            series.append(round(srv.rss_mb(), 1))
    end_mb = srv.rss_mb()
    return {"soak_s": round(time.monotonic() - t0, 1), "soak_requests": requests, "soak_errors": errors,
            "rss_start_mb": round(start_mb, 1), "rss_end_mb": round(end_mb, 1),
            "rss_growth": round(end_mb / start_mb - 1, 4), "rss_series_mb": series}  # fmt: skip


def sampler_ceiling(model_dir: Path, args: argparse.Namespace) -> float:
    """The same decode without a server: one generate call of `clients` rows vs `clients` calls of one
    row (median of 3 interleaved rounds). No server can batch better than this on this machine."""
    import torch

    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.sampler import SamplerConfig, resolve_sampler
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    torch.set_num_threads(args.threads)
    loaded = load_for_inference(model_dir=model_dir)
    cfg = resolve_sampler(SamplerConfig(gen_length=args.max_tokens), loaded.profile)
    special = SpecialIds.of(loaded.profile)
    prompts = [loaded.tokenizer.encode(f"{(i * 7) % 50} + {(i * 3) % 50} =") for i in range(args.clients)]
    ratios = []
    for _ in range(3):
        t0 = time.perf_counter()
        generate(loaded.model, prompts, cfg, special)
        batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in prompts:
            generate(loaded.model, [p], cfg, special)
        ratios.append((time.perf_counter() - t0) / batched)
    return round(statistics.median(ratios), 2)


if __name__ == "__main__":
    sys.exit(main())
