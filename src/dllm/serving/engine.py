"""The engine: a worker thread that drains a bounded queue of requests into batched sampler calls, up to
`max_calls` of them in flight at once, each in its own thread, taking turns step by step (`Turns`): a
long call no longer holds the model until it ends, and a short request queued behind it starts at once
(when fewer than `max_calls` run) and finishes after its own steps times the calls in flight. `max_calls`
1 is the one-call-at-a-time engine (each call to its end), kept for comparison (bench/serve_load.py).

Requests waiting together (up to `max_batch` rows, within `max_wait_ms` of the oldest) whose sampler
settings are compatible (the same resolved SamplerConfig and stop strings; max_tokens may differ, as
rows are cut from a canvas of the same length) are decoded in one `sampling.generate` call. The
loop decodes each row from its own prompt only (padding is masked out; tests/unit/test_sampling.py
checks that batched greedy rows equal each prompt alone), so a deterministic request's text does not
depend on its batch. Seeds: one generator serves a whole call, so a stochastic request that names a
seed runs in a batch of its own with a generator seeded by it (reproducible); one without a seed
shares a batch and a freshly seeded generator with its compatible peers.

The step callback of the loop feeds the streams: text as the decided prefix of a row grows (positions
commit in any order; text is sent once everything before it is decided), and whole-canvas frames for
the denoising view. A request whose client went away is dropped from the queue, and a running call
whose requests have all gone is aborted from the callback.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from dllm.config.sampler import SamplerConfig
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.canvas_batch import CanvasBatch, CanvasGroup
from dllm.sampling.causal import score_tokens
from dllm.sampling.continuous import Group, RunningBatch
from dllm.sampling.generate import generate
from dllm.sampling.results import GenerationResult, StepEvent
from dllm.sampling.speculative import Drafter
from dllm.sampling.stops import stop_function
from dllm.serving.errors import ApiError
from dllm.serving.jobs import Job, Streams
from dllm.serving.metrics import Metrics
from dllm.serving.protocol import Settings
from dllm.serving.turns import Turns
from dllm.tokenization import Tokenizer


class Cancelled(Exception):
    """Every request of a running call has gone: the call stops at its next step."""


def sampler_failed(e: Exception) -> ApiError:
    """The 500 of a sampler call that raised (nothing a request does may stop the server)."""
    return ApiError(500, f"the sampler failed: {type(e).__name__}: {e}", kind="server_error")


def batch_key(settings: Settings) -> str:
    """Requests with equal keys decode in one call."""
    if settings.stochastic and settings.seed is not None:
        return f"seeded:{secrets.token_hex(8)}"  # its own batch, its own generator
    values = settings.cfg.model_dump(mode="json")
    values.pop("seed")
    return json.dumps(values, sort_keys=True)


class Engine:
    """Holds the model and the worker. `submit` is called from the server's event loop."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Tokenizer, special: SpecialIds, metrics: Metrics | None = None, *,
        max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256, drafter: Drafter | None = None,
        max_calls: int = 4,
    ) -> None:  # fmt: skip
        self.model, self.tokenizer, self.special = model, tokenizer, special
        self.drafter = drafter
        """Speculative decoding of a causal model (its requests' sampler has generation causal); None: none."""
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_ms / 1000, max_queue
        self.metrics = metrics or Metrics(lambda: len(self.queue) + len(self.joining))
        self.queue: deque[Job] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.max_calls = max_calls
        """Sampler calls in flight at once, taking turns step by step (1: one call at a time, each to its end)."""
        self.calls: dict[int, int] = {}
        """The calls in flight: their rows."""
        self.joining: deque[Job] = deque()
        """Requests of a causal model waiting to join its running batch (`_batch_loop`)."""
        self.batch_thread: threading.Thread | None = None
        self.turns = Turns()
        self._next_call = 0
        self.device = next(model.parameters()).device
        self.streams = Streams(tokenizer, special)
        self._local = threading.local()
        """Per call thread: the model calls of that call (a forward hook; the denoising frames show its NFE)."""
        model.register_forward_hook(self._count_forward)
        self.thread = threading.Thread(target=self._work, name="dllm-serve-engine", daemon=True)

    def start(self) -> Engine:
        self.thread.start()
        return self

    @property
    def running(self) -> int:
        """Rows in the sampler calls under way (0: idle)."""
        return sum(self.calls.values())

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=30)
        if self.batch_thread is not None:
            self.batch_thread.join(timeout=30)

    def joins_running_batch(self, job: Job) -> bool:
        """Whether a request joins the running batch (step-level continuous batching: AR decoding of a causal
        model, or unguided diffusion, uncached or block-cached, `CanvasBatch.takes`) rather than a sampler call
        of its own (speculative decoding, approximate caches or guidance, or `max_calls` 1: the one-call-at-a-time
        engine kept for comparison)."""
        cfg = job.settings.cfg
        if self.max_calls <= 1:
            return False
        if cfg.generation == "causal":
            return self.drafter is None
        return CanvasBatch.takes(cfg, self.model)

    def _new_batch(self, cfg: SamplerConfig) -> RunningBatch | CanvasBatch:
        """The running batch of the model's decoding (a server's model decodes causally or on canvases)."""
        kind = RunningBatch if cfg.generation == "causal" else CanvasBatch
        return kind(self.model, self.special, self.max_batch)

    def submit(self, job: Job) -> None:
        """Queue a request; 429 when the queue is full."""
        job.key = batch_key(job.settings)
        job.sent = [""] * len(job.rows)
        joins = self.joins_running_batch(job)
        with self.cond:
            if len(self.queue) + len(self.joining) >= self.max_queue:
                raise ApiError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry later",
                               code="queue_full", kind="rate_limit_error")  # fmt: skip
            (self.joining if joins else self.queue).append(job)
            if joins and self.batch_thread is None:
                self.batch_thread = threading.Thread(target=self._batch_loop, args=(job.settings.cfg,),
                                                     name="dllm-serve-batch", daemon=True)  # fmt: skip
                self.batch_thread.start()
            self.cond.notify_all()

    def _count_forward(self, *_: Any) -> None:
        self._local.forwards = getattr(self._local, "forwards", 0) + 1

    def _work(self) -> None:
        """Start a call for each batch, while fewer than `max_calls` are in flight."""
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            call = self._next_call
            self._next_call += 1
            with self.cond:
                self.calls[call] = sum(len(j.rows) for j in batch)
            threading.Thread(target=self._call, args=(call, batch), name=f"dllm-serve-call-{call}", daemon=True).start()

    def _call(self, call: int, batch: list[Job]) -> None:
        """One sampler call, in its own thread, taking turns with the others step by step."""
        self.turns.join(call)
        try:
            self._run(batch, call)
        except Cancelled:
            pass
        except Exception as e:  # nothing a request does may stop the server
            err = sampler_failed(e)
            for job in batch:
                job.sink("error", err)  # the app's sink never raises (a closed loop is ignored)
        finally:
            self.turns.leave(call)
            with self.cond:
                del self.calls[call]
                self.cond.notify_all()

    def _take_batch(self) -> list[Job] | None:
        """The oldest request and its compatible peers, once `max_batch` rows wait or the oldest has
        waited `max_wait_ms`."""
        with self.cond:
            while True:
                self._drop_cancelled()
                if self.stopping:
                    return None
                if not self.queue or len(self.calls) >= self.max_calls:
                    self.cond.wait()
                    continue
                first = self.queue[0]
                rows = sum(len(j.rows) for j in self.queue if j.key == first.key)
                wait = first.enqueued_at + self.max_wait_s - time.monotonic()
                if rows >= self.max_batch or wait <= 0:
                    break
                self.cond.wait(wait)
            batch, rows = [], 0
            for job in list(self.queue):
                if job.key == first.key and (not batch or rows + len(job.rows) <= self.max_batch):
                    batch.append(job)
                    rows += len(job.rows)
            now = time.monotonic()
            for job in batch:
                self.queue.remove(job)
                self.metrics.observe("dllm_request_queue_time_seconds", now - job.enqueued_at)
            return batch

    def _drop_cancelled(self) -> None:
        for waiting in (self.queue, self.joining):
            for job in [j for j in waiting if j.cancelled.is_set()]:
                waiting.remove(job)

    # -- the running batch ----------------------------------------------------------------------------
    def _batch_loop(self, cfg: SamplerConfig) -> None:
        """The running batch (sampling/continuous.py for a causal model, sampling/canvas_batch.py for
        diffusion): waiting requests join it between forwards while their rows fit in `max_batch`, every
        row advances one step per forward (a token, or a denoising step), and a request leaves when its
        rows have ended or its client has gone. While it runs it is one of the calls in flight, taking its
        turn step by step."""
        batch = self._new_batch(cfg)
        running: dict[Group | CanvasGroup, tuple[list[Job], float]] = {}
        call: int | None = None
        in_line = False
        while True:
            with self.cond:
                self._drop_cancelled()
                while not self.stopping and not self.joining and not running:
                    self.cond.wait()
                    self._drop_cancelled()
                if self.stopping:
                    return
                admitted = []
                rows = batch.rows
                while self.joining and (rows == 0 or rows + len(self.joining[0].rows) <= self.max_batch):
                    admitted.append(self.joining.popleft())
                    rows += len(admitted[-1].rows)
                if call is None:
                    call, self._next_call = self._next_call, self._next_call + 1
                self.calls[call] = rows
            if not in_line:  # work to do: wait for the batch's turn
                self.turns.join(call)
                in_line = True
            now = time.monotonic()
            if admitted:  # the rows of all of them in one copy of the buffers
                longest = max(len(r) for job in admitted for r in job.rows) + max(j.settings.cfg.gen_length
                                                                                   for j in admitted)  # fmt: skip
                batch.reserve(sum(len(job.rows) for job in admitted), longest)
            for job in admitted:
                self.metrics.observe("dllm_request_queue_time_seconds", now - job.enqueued_at)
            for key in dict.fromkeys(job.key for job in admitted):  # requests of equal settings: one group
                self._join(batch, [job for job in admitted if job.key == key], running)
            for group, (jobs, _) in list(running.items()):
                if all(job.cancelled.is_set() for job in jobs):
                    batch.leave(group)
                    del running[group]
            try:
                finished = batch.step()
            except Exception as e:  # nothing a request does may stop the server
                err = sampler_failed(e)
                for jobs, _ in running.values():
                    for job in jobs:
                        job.sink("error", err)
                running.clear()
                batch = self._new_batch(cfg)
                finished = []
            for group in finished:
                self._batch_done(group, *running.pop(group))
            with self.cond:
                self.calls[call] = batch.rows
            if running or self.joining:
                self.turns.next(call)
            else:
                self.turns.leave(call)
                in_line = False
                with self.cond:
                    del self.calls[call]
                    call = None
                    self.cond.notify_all()

    def _join(self, batch: RunningBatch | CanvasBatch, jobs: list[Job], running: dict) -> None:
        """Start requests of equal settings that arrived together in the running batch, as one group (their
        rows decoded as one `generate` call of them would; a causal model prefills them; answered at once
        when their rows end with their first token)."""
        s = jobs[0].settings
        generator = self._generator(jobs[0])
        t0 = time.perf_counter()
        box: list[Group | CanvasGroup] = []
        rows = [row for job in jobs for row in job.rows]
        try:
            group = batch.join(rows, s.cfg, generator, stop_function(self.tokenizer, s.cfg.stop_strings),
                               self._watcher(jobs, box))  # fmt: skip
        except Exception as e:
            for job in jobs:
                job.sink("error", sampler_failed(e))
            return
        box.append(group)
        if group.done:
            self._batch_done(group, jobs, t0)
        else:
            running[group] = (jobs, t0)

    def _generator(self, job: Job) -> torch.Generator:
        """The generator of a call or a request: seeded by the request's seed when it runs alone (a seeded
        stochastic request), else freshly seeded."""
        seed = job.settings.seed if job.settings.seed is not None and job.key.startswith("seeded:") else None
        return torch.Generator(device=self.device).manual_seed(seed if seed is not None else secrets.randbits(63))

    def _batch_done(self, group: Group | CanvasGroup, jobs: list[Job], t0: float) -> None:
        if group.error is not None:  # its decoding raised (the others in the batch go on)
            for job in jobs:
                job.sink("error", sampler_failed(group.error))
            return
        result = group.result()
        self.metrics.observe_batch(len(result.sequences), time.perf_counter() - t0, result.nfe)
        mean_rows = round(group.batch_rows / max(group.counters.nfe, 1), 2)
        offset = 0
        for job in jobs:
            self._finish(job, result, offset, {**result.counters.as_dict(), "batch_rows": mean_rows})
            offset += len(job.rows)

    def _watcher(self, jobs: list[Job], box: list) -> Callable[[StepEvent], None] | None:
        """The step callback of a group in the running batch whose requests stream text or frames (None:
        none watches); `box` holds the group once joined (the frames show its steps and forwards)."""
        incremental = jobs[0].settings.cfg.policy != "uniform"  # uniform: noise, not masks, until the end
        watched = [j for j in jobs if (j.stream_text and incremental) or j.denoise]
        if not watched:
            return None

        def on_step(event: StepEvent) -> None:
            if box:
                c = box[0].counters
                self.streams.show_step(jobs, watched, event, c.steps, c.nfe)

        return on_step

    def _run(self, batch: list[Job], call: int) -> None:
        settings = batch[0].settings
        cfg = settings.cfg
        prompts = [row for job in batch for row in job.rows]
        generator = self._generator(batch[0])
        t0, self._local.forwards = time.perf_counter(), 0
        stop = stop_function(self.tokenizer, cfg.stop_strings)
        result = generate(self.model, prompts, cfg, self.special, generator=generator,
                          callback=self._callback(batch, call), stop=stop, drafter=self.drafter)  # fmt: skip
        self.metrics.observe_batch(len(prompts), time.perf_counter() - t0, result.nfe)
        counters = {**result.counters.as_dict(), "batch_rows": len(prompts)}
        offset = 0
        for job in batch:
            self._finish(job, result, offset, counters)
            offset += len(job.rows)

    def _finish(self, job: Job, result: GenerationResult, offset: int, counters: dict) -> None:
        """A job's last events: the final canvas (an early exit fills what was left with EOS), the text the
        steps had not sent yet, and its results."""
        n = len(job.rows)
        if job.denoise:
            canvas = result.canvas_BL[offset : offset + n].tolist()
            self.streams.frame(job, canvas, result.gen_start_B[offset:], 0, result.counters.steps, -1, result.nfe,
                               last=True)  # fmt: skip
        rows, ids = zip(*(self.streams.row_result(result, offset + i, job.settings) for i in range(n)), strict=True)
        rows = list(rows)
        if job.top_logprobs is not None:  # one teacher-forced forward over prompt + completion per row
            sequences = [prompt + list(out) for prompt, out in zip(job.rows, ids, strict=True)]
            scored = score_tokens(self.model, sequences, job.top_logprobs, self.special.mask_id)
            for r, seq, sc in zip(rows, sequences, scored, strict=True):
                r.logprobs, r.pieces = sc.logprobs, [self.streams.piece(t) for t in seq]
                r.top = [[(self.streams.piece(t), lp) for t, lp in place] for place in sc.top]
        if job.echo:
            for r, prompt in zip(rows, job.rows, strict=True):
                r.text = self.tokenizer.decode(prompt) + r.text
        self.metrics.inc("dllm_prompt_tokens_total", sum(len(r) for r in job.rows))
        self.metrics.inc("dllm_generated_tokens_total", sum(r.completion_tokens for r in rows))
        for i, r in enumerate(rows if job.stream_text else []):
            if len(r.text) > len(job.sent[i]) and r.text.startswith(job.sent[i]):
                job.sink("delta", (i, r.text[len(job.sent[i]) :]))
        job.sink("done", (rows, counters))

    def _callback(self, batch: list[Job], call: int) -> Callable[[StepEvent], None]:
        incremental = batch[0].settings.cfg.policy != "uniform"  # uniform: noise, not masks, until the end
        watched = [j for j in batch if (j.stream_text and incremental) or j.denoise]
        step = [0]

        def on_step(event: StepEvent) -> None:
            if all(j.cancelled.is_set() for j in batch):
                raise Cancelled
            step[0] += 1
            if watched:
                self.streams.show_step(batch, watched, event, step[0], self._local.forwards)
            self.turns.next(call)  # the other calls in flight run a step each before this one's next

        return on_step
