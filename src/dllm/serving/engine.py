"""The server's engine: one thread that steps the inference engine (inference/engine.py) over the jobs the
event loop queues here, and sends each job's events back.

Jobs (HTTP requests) wait in a bounded queue (a 429 past `max_queue`). The thread hands them to the
inference engine as requests: jobs of equal sampler settings that wait together become one request (one
decoding loop over all their rows, up to `max_batch` rows), so a stochastic job that names a seed runs in a
request of its own with a generator seeded by it (reproducible), and one without a seed shares a request and
a freshly seeded generator with its compatible peers. A job whose decoding shares forwards anyway (causal
decoding, unguided uncached or block-cached canvases) is handed over at once; one that runs a forward of
its own waits up to `max_wait_ms` for peers to batch with. From then on the inference engine's scheduler
decides, each step, who runs and which rows share which forward: the server has no scheduling of its own.

A request's step callback feeds its jobs' streams (serving/jobs.py): text as the decided prefix of a row
grows, and whole-canvas frames for the denoising view. A job whose client went away leaves the queue; a
request whose jobs have all gone is cancelled and dropped at the next step. Nothing a request does stops
the server: a decoding that raises fails its own jobs (a 500), a failed forward fails the jobs it ran.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import Engine as InferenceEngine
from dllm.inference.engine import make_loop, shares_forwards
from dllm.inference.request import Request
from dllm.inference.scheduler import Limits
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import score_tokens
from dllm.sampling.results import GenerationResult, StepEvent
from dllm.sampling.speculative import Drafter
from dllm.sampling.stops import stop_function
from dllm.serving.errors import ApiError
from dllm.serving.jobs import Job, Streams
from dllm.serving.metrics import Metrics
from dllm.tokenization import Tokenizer


def sampler_failed(e: Exception) -> ApiError:
    """The 500 of a decoding that raised (nothing a request does may stop the server)."""
    return ApiError(500, f"the sampler failed: {type(e).__name__}: {e}", kind="server_error")


def batch_key(job: Job) -> str:
    """Jobs with equal keys decode as one request."""
    settings = job.settings
    if settings.stochastic and settings.seed is not None:
        return f"seeded:{secrets.token_hex(8)}"  # its own request, its own generator
    values = settings.cfg.model_dump(mode="json")
    values.pop("seed")
    return json.dumps({**values, "draft": settings.draft}, sort_keys=True)


@dataclass
class Handed:
    """A request of the inference engine and the jobs whose rows it decodes."""

    jobs: list[Job]
    t0: float


class Engine:
    """The queue and the thread over the inference engine. `submit` is called from the server's event loop."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Tokenizer, special: SpecialIds, metrics: Metrics | None = None, *,
        max_batch: int = 8, max_wait_ms: float = 10.0, max_queue: int = 256, drafter: Drafter | None = None,
        max_calls: int | None = None,
    ) -> None:  # fmt: skip
        self.model, self.tokenizer, self.special, self.drafter = model, tokenizer, special, drafter
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_ms / 1000, max_queue
        self.limits = Limits(max_rows=max_batch, max_requests=max_calls)
        self.inner = InferenceEngine(model, special, self.limits)
        self.metrics = metrics or Metrics(lambda: self.queued)
        self.queue: deque[Job] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.handed: dict[Request, Handed] = {}
        self.device = next(model.parameters()).device
        self.streams = Streams(tokenizer, special)
        self.thread = threading.Thread(target=self._work, name="dllm-serve-engine", daemon=True)

    def start(self) -> Engine:
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=30)

    @property
    def queued(self) -> int:
        """Jobs waiting: in the queue here, or handed over and not yet admitted."""
        handed = [self.handed.get(r) for r in list(self.inner.waiting)]  # read from the event loop's thread too
        return len(self.queue) + sum(len(h.jobs) for h in handed if h is not None)

    @property
    def running(self) -> int:
        """Rows of the requests decoding (0: idle)."""
        return sum(r.rows for r in list(self.inner.running))

    def submit(self, job: Job) -> None:
        """Queue a job; 429 when the queue is full."""
        job.key = batch_key(job)
        job.sent = [""] * len(job.rows)
        with self.cond:
            if self.queued >= self.max_queue:
                raise ApiError(429, f"the server's queue is full ({self.max_queue} requests waiting); retry later",
                               code="queue_full", kind="rate_limit_error")  # fmt: skip
            self.queue.append(job)
            self.cond.notify_all()

    # -- the thread ------------------------------------------------------------------------------------
    def _work(self) -> None:
        """Hand queued jobs over, step the inference engine, finish what ended; wait when there is nothing to do."""
        while True:
            with self.cond:
                while not self.stopping and not self.queue and not self.inner.busy:
                    self.cond.wait()
                if self.stopping:
                    return
                groups, wait_s = self._take()
            for jobs in groups:
                self._hand_over(jobs)
            self._cancel_gone()
            if not self.inner.busy:
                with self.cond:
                    if wait_s is not None and not self.stopping:
                        self.cond.wait(wait_s)  # peers of a waiting job may still come
                continue
            self._step()

    def _take(self) -> tuple[list[list[Job]], float | None]:
        """The queued jobs to hand over now, grouped by settings (up to `max_batch` rows a group), and how long
        the first job left waiting for peers may still wait (None: none waits)."""
        self.queue = deque(j for j in self.queue if not j.cancelled.is_set())
        groups, wait_s, now = [], None, time.monotonic()
        while self.queue:
            first = self.queue[0]
            group, rows = [], 0
            for job in [j for j in self.queue if j.key == first.key]:
                if group and rows + len(job.rows) > self.max_batch:
                    break
                group.append(job)
                rows += len(job.rows)
            left = first.enqueued_at + self.max_wait_s - now
            if self._shares(first.settings.cfg) or rows >= self.max_batch or left <= 0:
                groups.append(group)
                for job in group:
                    self.queue.remove(job)
                continue
            wait_s = left
            break
        return groups, wait_s

    def _shares(self, cfg: SamplerConfig) -> bool:
        """Whether requests of these settings share forwards with others (no reason to wait for peers)."""
        return cfg.generation == "causal" or shares_forwards(cfg, self.model)

    def _hand_over(self, jobs: list[Job]) -> None:
        """One request of the inference engine for `jobs` (equal settings): their rows in one decoding loop."""
        s = jobs[0].settings
        now = time.monotonic()
        for job in jobs:
            self.metrics.observe("dllm_request_queue_time_seconds", now - job.enqueued_at)
        box: list[Request] = []
        try:
            drafter = self.drafter if s.cfg.generation == "causal" and s.draft else None
            loop = make_loop(self.model, [row for job in jobs for row in job.rows], s.cfg, self.special,
                             generator=self._generator(jobs[0]), callback=self._watcher(jobs, box),
                             stop=stop_function(self.tokenizer, s.cfg.stop_strings), drafter=drafter)  # fmt: skip
        except Exception as e:
            for job in jobs:
                job.sink("error", sampler_failed(e))
            return
        req = self.inner.add(loop)
        box.append(req)
        self.handed[req] = Handed(jobs, time.perf_counter())

    def _generator(self, job: Job) -> torch.Generator:
        """A request's generator: seeded by the job's seed when it runs alone (a seeded stochastic job), else
        freshly seeded."""
        seed = job.settings.seed if job.settings.seed is not None and job.key.startswith("seeded:") else None
        return torch.Generator(device=self.device).manual_seed(seed if seed is not None else secrets.randbits(63))

    def _cancel_gone(self) -> None:
        """A request whose jobs have all gone (their clients went away) is dropped at the next step."""
        for req, handed in self.handed.items():
            if all(job.cancelled.is_set() for job in handed.jobs):
                req.cancelled = True

    def _step(self) -> None:
        """One step of the inference engine; the requests that ended are answered."""
        try:
            ended = self.inner.step()
        except Exception as e:  # a failed forward: the requests it ran fail, the server goes on
            err = sampler_failed(e)
            for handed in self.handed.values():
                for job in handed.jobs:
                    job.sink("error", err)
            self.handed.clear()
            self.inner = InferenceEngine(self.model, self.special, self.limits)
            return
        for req in ended:
            handed = self.handed.pop(req, None)
            if handed is not None and not req.cancelled:
                self._done(req, handed)

    def _done(self, req: Request, handed: Handed) -> None:
        if req.error is not None:  # its decoding raised (the others go on)
            for job in handed.jobs:
                job.sink("error", sampler_failed(req.error))
            return
        assert req.result is not None
        result = req.result
        self.metrics.observe_batch(len(result.sequences), time.perf_counter() - handed.t0, result.nfe)
        counters = {**result.counters.as_dict(), "batch_rows": round(req.batch_rows / max(req.counters.nfe, 1), 2)}
        offset = 0
        for job in handed.jobs:
            self._finish(job, result, offset, counters)
            offset += len(job.rows)

    def _watcher(self, jobs: list[Job], box: list[Request]) -> Callable[[StepEvent], None] | None:
        """The step callback of a request whose jobs stream text or frames (None: none watches); `box` holds the
        request once added (the frames show its steps and forwards)."""
        incremental = jobs[0].settings.cfg.policy != "uniform"  # uniform: noise, not masks, until the end
        watched = [j for j in jobs if (j.stream_text and incremental) or j.denoise]
        if not watched:
            return None

        def on_step(event: StepEvent) -> None:
            c = box[0].counters if box else None
            self.streams.show_step(jobs, watched, event, c.steps if c else 0, c.nfe if c else 0)

        return on_step

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
