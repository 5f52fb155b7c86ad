"""The inference engine: requests in, one step at a time; `generate`, THE entry point of decoding.

Every decoding (the CLI's generate and chat, the Python API, evaluation, GRPO rollouts, and the server)
runs through an `Engine`: its requests wait in arrival order; each `step` asks the scheduler (scheduler.py,
a pure function of the queue and the running set) which requests to drop and to admit, and which running
requests' rows share which forward, and the executor (executor.py) runs those forwards and sends each
request its answer. A request is one decoding loop of sampling/ (make_loop picks it from the sampler's
resolved `generation`): the canvas loop of diffusion (every policy and cache), the causal loop (AR, and
with a drafter speculative decoding), Edit Flows' tau-leaping, or DiffusionGemma's canvases. Offline
`generate` is an engine holding one request; the server's engine holds many (serving/engine.py feeds it).

Shapes: B batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dllm.config.sampler import SamplerConfig
from dllm.inference.canvas_rows import key_end
from dllm.inference.executor import Executor
from dllm.inference.request import Request
from dllm.inference.scheduler import Kind, Limits, Running, Waiting, admit, plan
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.canvas_denoiser import Denoiser
from dllm.sampling.canvas_loop import Loop
from dllm.sampling.causal import keeps_recurrent_state
from dllm.sampling.causal_loop import CausalLoop
from dllm.sampling.edit_flow import EditFlowLoop
from dllm.sampling.results import GenerationResult, StepEvent
from dllm.sampling.speculative import Drafter

StepCallback = Callable[[StepEvent], None]


def generate(
    model: nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds, *,
    generator: torch.Generator | None = None, callback: StepCallback | None = None,
    stop: Callable[[list[int]], bool] | None = None, drafter: Drafter | None = None, return_logits: bool = False,
    recompute: bool = False,
) -> GenerationResult:  # fmt: skip
    """Decode `gen_length` tokens after each prompt. `stop(row_ids)` says whether a row's decided prefix
    already ends the row (stop strings); `callback` sees the canvas after every step. `cfg` must be
    resolved (`config.sampler.resolve_sampler`: it picks the loop from the model's decode profile).
    `cfg.compile` compiles the model's blocks in place (sampling.compiled), once; later calls reuse them.
    Causal decoding only: `drafter` proposes tokens (None: AR decoding), `return_logits` keeps the logits each
    new token was chosen from, `recompute` runs every row's whole sequence at each step instead of the KV
    cache (the plain reference of the cache).

    The loop runs under `torch.inference_mode` (less dispatch work per op than `no_grad`: ~10% of a
    small model's forward); the returned tensors are ordinary ones, usable in autograd later."""
    if not prompts:
        raise ValueError("generate needs at least one prompt")
    if (drafter is not None or return_logits or recompute) and cfg.generation != "causal":
        raise ValueError(f"a drafter, return_logits and recompute are causal decoding's, not {cfg.generation}'s")
    with torch.inference_mode():
        loop = make_loop(model, prompts, cfg, special, generator=generator, callback=callback, stop=stop,
                         drafter=drafter, return_logits=return_logits)  # fmt: skip
    return decode_alone(model, special, loop, recompute=recompute)


def decode_alone(model: nn.Module, special: SpecialIds, loop: Any, recompute: bool = False) -> GenerationResult:
    """Run one decoding loop (make_loop's) to its end through an engine that holds it alone."""
    with torch.inference_mode():
        engine = Engine(model, special, Limits(share_forwards=False), recompute=recompute)
        req = engine.add(loop)
        try:
            while not req.done:
                engine.step()
        finally:  # an interrupted call leaves no hooks on the model
            engine.executor.close()
    if req.error is not None:
        raise req.error
    assert req.result is not None
    return outside_inference(req.result)


def outside_inference(result: GenerationResult) -> GenerationResult:
    """The result with tensors made outside inference mode (inference tensors cannot enter autograd)."""
    result.canvas_BL = result.canvas_BL.clone()
    if result.logits_BNV is not None:
        result.logits_BNV = result.logits_BNV.clone()
    return result


def make_loop(
    model: nn.Module, prompts: list[list[int]], cfg: SamplerConfig, special: SpecialIds, *,
    generator: torch.Generator | None = None, callback: StepCallback | None = None,
    stop: Callable[[list[int]], bool] | None = None, drafter: Drafter | None = None, return_logits: bool = False,
) -> Any:  # fmt: skip
    """The decoding loop of one request, by the sampler's resolved `generation`."""
    if cfg.generation == "causal":  # AR, or speculative with a drafter (sampling/causal_loop.py)
        device = next(model.parameters()).device
        return CausalLoop(prompts, cfg, special, device, drafter=drafter, generator=generator, callback=callback,
                          stop=stop, return_logits=return_logits)  # fmt: skip
    if drafter is not None:
        raise ValueError(f"a drafter proposes tokens for causal decoding, not for generation {cfg.generation}")
    if cfg.generation == "edit_flow":  # no canvas: tau-leaping over edit rates (sampling/edit_flow.py)
        return EditFlowLoop(model, prompts, cfg, special, generator, callback)
    if cfg.generation == "canvas_denoise":  # DiffusionGemma (sampling/canvas_denoiser.py)
        return Denoiser(model, prompts, cfg, special, generator, callback, stop)
    return Loop(model, prompts, cfg, special, generator, callback, stop)


def shares_forwards(cfg: SamplerConfig, model: nn.Module) -> bool:
    """Whether a canvas request of these (resolved) settings may share forwards with others (not Edit Flows nor
    DiffusionGemma's canvases, which run their own): unguided, uncached or with the exact block cache, and not
    on a model with linear-attention layers (they read a forward's last block as the noisy one, and keep per-row
    states the ragged cache holds for causal rows only) nor reading its context causally (causal_context, which
    the shared masks do not)."""
    if cfg.generation in ("causal", "edit_flow", "canvas_denoise") or cfg.cfg_scale > 0 or cfg.causal_context == "on":
        return False
    return cfg.cache in ("none", "block") and not keeps_recurrent_state(model)


class Engine:
    """Holds the requests; `step` runs one scheduled step of them. Not thread-safe: one thread steps it."""

    def __init__(self, model: nn.Module, special: SpecialIds, limits: Limits | None = None, *,
                 recompute: bool = False) -> None:  # fmt: skip
        self.model, self.special = model, special
        self.limits = limits or Limits()
        self.executor = Executor(model, special, recompute)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0

    def kind_of(self, loop: Any) -> Kind:
        """How a loop's model calls run (scheduler.py: `Kind`)."""
        if isinstance(loop, CausalLoop):
            return "causal"
        if isinstance(loop, Loop) and self.limits.share_forwards and shares_forwards(loop.cfg, self.model):
            return "canvas_cached" if loop.cfg.cache == "block" else "canvas"
        return "own"

    def add(self, loop: Any) -> Request:
        """Queue a decoding loop (make_loop) as a request; it starts when the scheduler admits it."""
        req = Request(self._next_id, loop, self.kind_of(loop))
        self._next_id += 1
        self.waiting.append(req)
        return req

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def rows(self) -> int:
        """Rows of the running requests."""
        return sum(r.rows for r in self.running)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Drop the cancelled, admit who fits, run the planned forwards; the requests that ended at this step
        (with a result, an error, or dropped)."""
        decision = admit([Waiting(r.id, r.rows, r.cancelled) for r in self.waiting],
                         [_view(r) for r in self.running], self.limits)  # fmt: skip
        ended = [self._drop(i) for i in decision.drop]
        for i in decision.admit:
            req = next(r for r in self.waiting if r.id == i)
            self.waiting.remove(req)
            self.running.append(req)
            self.executor.start(req)
        by_id = {r.id: r for r in self.running if not r.done}
        for forward in plan([_view(r) for r in by_id.values()], self.limits):
            self.executor.run(forward, [by_id[i] for i in forward.ids])
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            self.executor.leave(req)
            ended.append(req)
        return ended

    def _drop(self, req_id: int) -> Request:
        req = next(r for r in [*self.waiting, *self.running] if r.id == req_id)
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
            self.executor.leave(req)
        req.close()
        return req


def _view(req: Request) -> Running:
    """What the scheduler sees of a running request."""
    if req.kind == "canvas":
        canvas = req.loop.canvas
        mask = canvas.block_length if canvas.block_attention else None
        return Running(req.id, req.rows, req.cancelled, "canvas", mask, key_end(req))
    if req.kind == "canvas_cached":
        return Running(req.id, req.rows, req.cancelled, "canvas_cached", req.loop.canvas.block_length)
    return Running(req.id, req.rows, req.cancelled, req.kind)
