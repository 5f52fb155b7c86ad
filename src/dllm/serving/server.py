"""Putting a server together: the engine over a loaded model, the app, and uvicorn (in the foreground
for `dllm serve`, in a thread for tests and benchmarks)."""

from __future__ import annotations

import math
import threading
import time

from dllm.checkpoint.inference import LoadedModel
from dllm.config.sampler import SamplerConfig
from dllm.errors import ConfigError
from dllm.sampling.canvas import SpecialIds
from dllm.serving.app import ServeState, build_app
from dllm.serving.engine import Engine

# Models the server does not decode yet: a drafter (it proposes beside a target), edit flows.
NOT_SERVED_YET = {
    "dflash": "a DFlash drafter decodes beside a target model (speculative decoding), which is not served yet",
    "dflash_distillation": "a DFlash drafter decodes beside a target model (speculative decoding), not served yet",
    "edit_flow": "edit-flow models are not served yet",
}


def make_state(loaded: LoadedModel, cfg: SamplerConfig, *, model_id: str | None = None, api_key: str | None = None,
               max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256) -> ServeState:  # fmt: skip
    """A server's state over a `checkpoint.inference.LoadedModel` and the resolved default sampler."""
    objective = loaded.profile.objective
    if objective in NOT_SERVED_YET:
        raise ConfigError(f"{loaded.source}: {NOT_SERVED_YET[objective]}")
    for name, value, low in (
        ("--max-batch", max_batch, 1),
        ("--max-queue", max_queue, 1),
        ("--max-wait-ms", max_wait_ms, 0),
    ):
        if not math.isfinite(value) or value < low:
            raise ConfigError(f"{name} must be a finite number >= {low} (got {value})")
    engine = Engine(loaded.model, loaded.tokenizer, SpecialIds.of(loaded.profile), max_batch=max_batch,
                    max_wait_ms=max_wait_ms, max_queue=max_queue)  # fmt: skip
    name = model_id or _model_name(loaded)
    return ServeState(engine, cfg, loaded.profile, name, api_key)


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
