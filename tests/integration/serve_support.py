"""A tiny model that writes printable text, and a server over it on a free loopback port."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dllm.checkpoint.loading import LoadedModel, derive_profile
from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.models.transformer import Transformer
from dllm.tokenization import ByteTokenizer
from tests.distributed.harness import free_port

MAX_LEN = 128


def tiny_model(seed: int = 0, preset: str = "tiny") -> tuple[Transformer, ModelConfig]:
    """A random tiny model over bytes whose greedy choices are printable ASCII: the tied embedding
    rows of every other byte are zero (logit 0, below the best of ~95 random logits)."""
    tok = ByteTokenizer()
    cfg = ModelConfig(preset=preset, vocab_size=tok.vocab_size, max_seq_len=MAX_LEN, init_std=0.2)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    keep = torch.zeros(tok.vocab_size, dtype=torch.bool)
    keep[32:127] = True
    keep[tok.mask_id] = True
    with torch.no_grad():
        model.embed_tokens.weight[~keep] = 0
    return model.eval(), cfg


def tiny_loaded(preset: str = "tiny") -> LoadedModel:
    model, cfg = tiny_model(preset=preset)
    tok = ByteTokenizer()
    return LoadedModel(model, tok, cfg, Path("tiny"), derive_profile(None, cfg, tok))


def make_server(loaded: LoadedModel | None = None, **kw):
    """A BackgroundServer (not started) over the tiny model; `kw` go to serving.server.make_state."""
    from dllm.serving.server import BackgroundServer, make_state

    loaded = loaded or tiny_loaded()
    base = resolve_sampler(SamplerConfig(gen_length=16), loaded.profile)
    kw.setdefault("model_id", "tiny")
    return BackgroundServer(make_state(loaded, base, **kw), port=free_port())


class Slow(torch.nn.Module):
    """A model that takes at least `delay_s` per forward, whatever the machine (cancellation, queue tests)."""

    def __init__(self, inner: torch.nn.Module, delay_s: float) -> None:
        super().__init__()
        self.inner, self.delay_s = inner, delay_s

    def forward(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.inner(*args, **kwargs)


def slow_loaded(delay_s: float = 0.01) -> LoadedModel:
    loaded = tiny_loaded()
    loaded.model = Slow(loaded.model, delay_s)
    return loaded


class SlowTokenizer:
    """A tokenizer that takes `delay_s` to encode a long text, as a real one does over a long context;
    `started` is set when such an encode begins (tests of what the server does meanwhile)."""

    def __init__(self, inner, delay_s: float, long_chars: int = 10_000) -> None:
        import threading

        self.inner, self.delay_s, self.long_chars = inner, delay_s, long_chars
        self.started = threading.Event()

    def encode(self, text: str) -> list[int]:
        if len(text) >= self.long_chars:
            self.started.set()
            time.sleep(self.delay_s)
        return self.inner.encode(text)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def wait_until(cond, timeout: float = 30) -> None:
    """Poll `cond` every 10 ms until it holds; fail after `timeout` seconds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)
