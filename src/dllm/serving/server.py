"""Putting a server together: the engine over a loaded model, the app, and uvicorn (in the foreground
for `dllm serve`, in a thread for tests and benchmarks)."""

from __future__ import annotations

import math
import threading
import time

from dllm.checkpoint.loading import LoadedModel
from dllm.config.sampler import SamplerConfig
from dllm.errors import ConfigError
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.speculative import Drafter
from dllm.serving.app import ServeState, build_app
from dllm.serving.engine import Engine
from dllm.serving.limits import DEFAULT_MAX_BODY_BYTES, Limits
from dllm.tokenization import max_chars_per_token

# Models the server does not decode on their own: a drafter (it proposes beside its target), edit flows.
NOT_SERVED_YET = {
    "dflash": "a DFlash drafter is not served on its own; serve its target with --draft THIS_FOLDER",
    "dflash_distillation": "a DFlash drafter is not served on its own; export the run (dllm convert --to-hf) and "
    "serve its target with --draft",
    "edit_flow": "edit-flow models are not served yet",
}


def make_state(loaded: LoadedModel, cfg: SamplerConfig, *, model_id: str | None = None, api_key: str | None = None,
               max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_prompt_tokens: int | None = None,
               max_steps: int | None = None, drafter: Drafter | None = None,
               max_calls: int | None = None) -> ServeState:  # fmt: skip
    """A server's state over a `checkpoint.loading.LoadedModel` and the resolved default sampler (generation
    causal: a causal model decoded token by token, or with `drafter` speculatively; see
    `inference.assembly.setup_sampling`). `max_prompt_tokens` None: the model's positions less one;
    `max_steps` None: see `default_max_steps`; `max_calls`: requests decoding at once (None: as many as
    `max_batch` rows hold)."""
    objective = loaded.profile.objective
    if drafter is not None and cfg.generation != "causal":
        raise ConfigError("--draft: a drafter proposes tokens for a causal model; serve it with generation causal")
    if objective in NOT_SERVED_YET:
        raise ConfigError(f"{loaded.source}: {NOT_SERVED_YET[objective]}")
    if api_key is not None:
        check_api_key(api_key)
    positions = loaded.profile.max_length
    prompt_cap = positions - 1 if max_prompt_tokens is None else max_prompt_tokens
    steps_cap = default_max_steps(cfg, positions) if max_steps is None else max_steps
    limits = Limits(max_body_bytes, prompt_cap, steps_cap, prompt_cap * max_chars_per_token(loaded.tokenizer))
    for name, value, low, high, why in (
        ("--max-batch", max_batch, 1, None, ""),
        ("--max-calls", 1 if max_calls is None else max_calls, 1, None, ""),
        ("--max-queue", max_queue, 1, None, ""),
        ("--max-wait-ms", max_wait_ms, 0, None, ""),
        ("--max-body-bytes", max_body_bytes, 1, None, ""),
        ("--max-prompt-tokens", prompt_cap, 1, positions - 1, f" (the model has {positions} positions)"),
        ("--max-steps", limits.max_steps, cfg.total_steps, None, " (the server's own sampler takes that many)"),
    ):
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{name} must be a finite number {bound}{why} (got {value})")
    engine = Engine(loaded.model, loaded.tokenizer, SpecialIds.of(loaded.profile), max_batch=max_batch,
                    max_wait_ms=max_wait_ms, max_queue=max_queue, drafter=drafter, max_calls=max_calls)  # fmt: skip
    name = model_id or _model_name(loaded)
    return ServeState(engine, cfg, loaded.profile, name, limits, api_key)


def check_api_key(key: str, source: str = "--api-key") -> None:
    """A key a client can send: not empty (an unset variable must not turn the key off without a word)
    and printable ASCII without spaces (it travels in the Authorization header)."""
    if not key:
        raise ConfigError(f"{source} is empty (an unset variable?): give the key, or leave it out to serve "
                          "without one")  # fmt: skip
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise ConfigError(f"{source}: an API key travels in an HTTP header; use printable ASCII without spaces")


def default_max_steps(cfg: SamplerConfig, positions: int) -> int:
    """The step cap when none is given: the model's positions at the server's steps per token (rounded
    up, at least one): every request the server's defaults would decode fits, up to a whole context."""
    return positions * max(math.ceil(cfg.total_steps / cfg.gen_length), 1)


def _model_name(loaded: LoadedModel) -> str:
    """The run's name, else the model folder's name."""
    if loaded.spec is not None and loaded.spec.run.name:
        return str(loaded.spec.run.name)
    return loaded.source.resolve().name


class BackgroundServer:
    """uvicorn serving `state` in a thread on host:port (tests, benchmarks); a context manager."""

    def __init__(self, state: ServeState, host: str = "127.0.0.1", port: int = 8000) -> None:
        import uvicorn

        self.state, self.host, self.port = state, host, port
        config = uvicorn.Config(build_app(state), host=host, port=port, log_level="warning", access_log=False,
                                timeout_keep_alive=30, limit_concurrency=None)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="dllm-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > 30:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
