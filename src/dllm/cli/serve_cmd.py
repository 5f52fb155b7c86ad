"""`dllm serve`: an OpenAI-compatible HTTP server over a run, a checkpoint or a model folder."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from dllm.cli.common import MODEL_HELP, THREADS_OPTION, apply_threads, finite, hub_id, info
from dllm.cli.sampling_common import (
    AR_OPTION,
    DRAFT_BLOCK_SIZE_OPTION,
    DTYPE_OPTION,
    SAMPLER_CONFIG_OPTION,
    SET_OPTION,
    setup_sampling,
)
from dllm.errors import ConfigError
from dllm.serving.limits import DEFAULT_MAX_BODY_BYTES

API_KEY_ENV = "DLLM_API_KEY"


def serve(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder (step_XXXXXXXX)."),
    model: str = typer.Option(None, "--model", help=MODEL_HELP),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: str = typer.Option(
        None, "--api-key", help=f"Require `Authorization: Bearer KEY` on every request (or set ${API_KEY_ENV})."
    ),
    max_batch: int = typer.Option(
        8,
        "--max-batch",
        help="Most rows (choices) decoding at once, in the running batch (a larger request still runs, alone).",
    ),
    max_calls: int = typer.Option(
        None,
        "--max-calls",
        help="Requests decoding at once (1: one at a time, each to its end; default: as many "
        "as --max-batch rows hold).",
    ),
    max_wait_ms: float = typer.Option(
        10.0, "--max-wait-ms", callback=finite, help="How long a request waits for peers to batch with."
    ),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests that may wait; past it the server answers 429."),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", help="Largest request body; a longer one is refused (413)."
    ),
    max_prompt_tokens: int = typer.Option(
        None, "--max-prompt-tokens", help="Longest prompt in tokens (default: the model's positions less one)."
    ),
    max_steps: int = typer.Option(
        None,
        "--max-steps",
        help="Most steps (forwards) one request may ask for (default: the model's positions x the server's steps per "
        "token).",
    ),
    model_id: str = typer.Option(None, "--model-id", help="The id clients send as `model` (default: the run's name)."),
    sampler_config: Path = SAMPLER_CONFIG_OPTION,
    overrides: list[str] = SET_OPTION,
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = DTYPE_OPTION,
    ar: bool = AR_OPTION,
    draft: str = typer.Option(
        None, "--draft", help="Serve a causal model with speculative decoding by this drafter (a folder or hub id)."
    ),
    draft_block_size: int = DRAFT_BLOCK_SIZE_OPTION,
    threads: str = THREADS_OPTION,
) -> None:
    """Serve a model over HTTP: OpenAI completions and chat, streaming, a live denoising page at /."""
    try:
        import uvicorn

        from dllm.serving.app import build_app
        from dllm.serving.server import check_api_key, make_state
    except ImportError as e:
        raise ConfigError(
            f"dllm serve needs the serve extra ({e.name} is missing): pip install 'dllm[serve]'"
        ) from None
    if not 0 < port < 65536:
        raise ConfigError(f"--port must lie in 1..65535 (got {port})")
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None:  # an empty key (an unset variable) would serve without one: refused, not dropped
        check_api_key(key, "--api-key" if api_key is not None else f"${API_KEY_ENV}")
    _check_port(host, port)  # before the model loads: a busy port is a one-line error, not a log after a wait
    num_threads = apply_threads(threads)  # before the model loads: every op of the server runs on this many threads
    causal = ar or draft is not None
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides,
                       {"generation": "causal"} if causal else {}, draft=draft, draft_block_size=draft_block_size,
                       causal_option="--draft" if draft is not None else "--ar", dtype=dtype)  # fmt: skip
    state = make_state(s.loaded, s.sampler, model_id=model_id or hub_id(model), api_key=key, max_batch=max_batch,
                       max_wait_ms=max_wait_ms, max_queue=max_queue, max_body_bytes=max_body_bytes,
                       max_prompt_tokens=max_prompt_tokens, max_steps=max_steps, drafter=s.drafter,
                       max_calls=max_calls)  # fmt: skip
    if host not in ("127.0.0.1", "localhost", "::1") and key is None:
        info(f"dllm: warning: serving on {host} without an API key: anyone who can reach it can use it")
    lim = state.limits
    mode = "" if s.sampler.generation != "causal" else "; ar (KV cache)" if s.drafter is None else "; speculative"
    mode += f" (block {s.drafter.block_size})" if s.drafter is not None else ""
    info(f"{s.loaded.source}: serving {state.model_id!r}{mode} on http://{host}:{port} (page at /, API at /v1; "
         f"{num_threads} CPU thread(s), max batch {max_batch}, "
         f"{'requests up to the batch' if max_calls is None else f'{max_calls} request(s)'} at once, "
         f"{'API key required' if key else 'no API key'}; "
         f"limits: body {lim.max_body_bytes} "
         f"bytes, prompt {lim.max_prompt_tokens} tokens, {lim.max_steps} steps, queue {max_queue})")  # fmt: skip
    uvicorn.run(build_app(state), host=host, port=port, log_level="warning", access_log=False)


def _check_port(host: str, port: int) -> None:
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ConfigError(f"--port {port}: cannot listen on {host} ({e.strerror}); choose another port") from None
