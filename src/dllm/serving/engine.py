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
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import keeps_recurrent_state, score_tokens
from dllm.sampling.continuous import Group, RunningBatch
from dllm.sampling.generate import generate
from dllm.sampling.results import GenerationResult, StepEvent
from dllm.sampling.speculative import Drafter
from dllm.sampling.stops import cut_at_stop, stop_function
from dllm.serving.errors import ApiError
from dllm.serving.metrics import Metrics
from dllm.serving.protocol import Settings
from dllm.serving.turns import Turns
from dllm.tokenization import Tokenizer

MASK = None  # a masked position in a denoising frame


@dataclass
class RowResult:
    text: str
    """The completion (with echo: after the prompt's text)."""
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    logprobs: list[float | None] | None = None
    """With logprobs or echo (causal models): per token of prompt + completion, its log-probability under the
    model given those before it (None for the first); None: not scored."""
    pieces: list[str] = field(default_factory=list)
    """With logprobs: the text of each of those tokens (special tokens by name)."""
    top: list[list[tuple[str, float]]] = field(default_factory=list)
    """With logprobs: per token, the most likely tokens at its place (their text) and their log-probabilities."""


@dataclass
class Job:
    """One request: its rows (prompt ids per choice), settings, and where its events go.

    `sink(kind, payload)` is called from the worker thread with ("delta", (row, text)),
    ("frame", dict), ("done", (list[RowResult], counters)) or ("error", ApiError)."""

    rows: list[list[int]]
    settings: Settings
    sink: Callable[[str, Any], None]
    stream_text: bool = False
    denoise: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.monotonic)
    key: str = ""
    sent: list[str] = field(default_factory=list)
    """Text already streamed per row."""
    top_logprobs: int | None = None
    """Score the rows (causal models): the most likely tokens wanted at each place (0: none); None: no scores."""
    echo: bool = False
    """The prompt's text comes back before the completion."""


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
        self._pieces: dict[int, str] = {}
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
        """Whether a request joins the running batch (AR decoding of a causal model, step-level continuous
        batching) rather than a sampler call of its own (diffusion, speculative decoding, or `max_calls` 1:
        the one-call-at-a-time engine kept for comparison). A model with linear-attention layers has no running
        batch yet (its ragged cache keeps no recurrent states): its calls recompute (sampling/causal.py)."""
        causal = job.settings.cfg.generation == "causal" and not keeps_recurrent_state(self.model)
        return causal and self.drafter is None and self.max_calls > 1

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
                self.batch_thread = threading.Thread(target=self._batch_loop, name="dllm-serve-batch", daemon=True)
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

    # -- the running batch of a causal model --------------------------------------------------------
    def _batch_loop(self) -> None:
        """A causal model's running batch (sampling/continuous.py): waiting requests join it between
        forwards while their rows fit in `max_batch`, every row advances one token per forward, and a
        request leaves when its rows have ended or its client has gone. While it runs it is one of the
        calls in flight, taking its turn step by step."""
        batch = RunningBatch(self.model, self.special, self.max_batch)
        running: dict[Group, tuple[Job, float]] = {}
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
                self._join(batch, job, running)
            for group, (job, _) in list(running.items()):
                if job.cancelled.is_set():
                    batch.leave(group)
                    del running[group]
            try:
                finished = batch.step()
            except Exception as e:  # nothing a request does may stop the server
                err = sampler_failed(e)
                for job, _ in running.values():
                    job.sink("error", err)
                running.clear()
                batch = RunningBatch(self.model, self.special, self.max_batch)
                finished = []
            for group in finished:
                self._batch_done(group, *running.pop(group))
            self._batch_show(running)
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

    def _join(self, batch: RunningBatch, job: Job, running: dict[Group, tuple[Job, float]]) -> None:
        """Prefill a request into the running batch (answered at once when its rows end with their first token)."""
        s = job.settings
        generator = self._generator(job)
        t0 = time.perf_counter()
        try:
            group = batch.join(job.rows, s.cfg, generator, stop_function(self.tokenizer, s.cfg.stop_strings))
        except Exception as e:
            job.sink("error", sampler_failed(e))
            return
        if group.done:
            self._batch_done(group, job, t0)
        else:
            running[group] = (job, t0)

    def _generator(self, job: Job) -> torch.Generator:
        """The generator of a call or a request: seeded by the request's seed when it runs alone (a seeded
        stochastic request), else freshly seeded."""
        seed = job.settings.seed if job.settings.seed is not None and job.key.startswith("seeded:") else None
        return torch.Generator(device=self.device).manual_seed(seed if seed is not None else secrets.randbits(63))

    def _batch_done(self, group: Group, job: Job, t0: float) -> None:
        result = group.result()
        self.metrics.observe_batch(len(job.rows), time.perf_counter() - t0, result.nfe)
        mean_rows = round(group.batch_rows / max(group.counters.nfe, 1), 2)
        self._finish(job, result, 0, {**result.counters.as_dict(), "batch_rows": mean_rows})

    def _batch_show(self, running: dict[Group, tuple[Job, float]]) -> None:
        """The step's text deltas and frames of the requests that watch them (their tokens so far; masks after)."""
        mask_id = self.special.mask_id
        for group, (job, _) in running.items():
            if job.cancelled.is_set():
                continue
            if job.stream_text:
                for i, ids in enumerate(group.sequences()):
                    self._send_text(job, i, ids, final=False)
            if job.denoise:
                n = job.settings.max_tokens
                rows = [(t[:n] + [mask_id] * (n - len(t[:n]))) for t in group.tokens]
                self._local.forwards = group.counters.nfe
                live = group.ended.count(False)
                self._frame(job, rows, [0] * len(rows), live, group.counters.steps, 0)

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
            self._frame(job, canvas, result.gen_start_B[offset:], 0, result.counters.steps, -1, last=True)
        rows, ids = zip(*(self._row_result(result, offset + i, job.settings) for i in range(n)), strict=True)
        rows = list(rows)
        if job.top_logprobs is not None:  # one teacher-forced forward over prompt + completion per row
            sequences = [prompt + list(out) for prompt, out in zip(job.rows, ids, strict=True)]
            scored = score_tokens(self.model, sequences, job.top_logprobs, self.special.mask_id)
            for r, seq, sc in zip(rows, sequences, scored, strict=True):
                r.logprobs, r.pieces = sc.logprobs, [self.piece(t) for t in seq]
                r.top = [[(self.piece(t), lp) for t, lp in place] for place in sc.top]
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
                self._show_step(batch, watched, event, step[0])
            self.turns.next(call)  # the other calls in flight run a step each before this one's next

        return on_step

    def _show_step(self, batch: list[Job], watched: list[Job], event: StepEvent, step: int) -> None:
        """The step's text deltas and denoising frames of the jobs that watch them."""
        canvas = event.canvas_BT.tolist()
        offset = 0
        for job in batch:
            if job in watched and not job.cancelled.is_set():
                self._stream(job, canvas[offset : offset + len(job.rows)], event, offset, step)
            offset += len(job.rows)

    def _stream(self, job: Job, rows: list[list[int]], event: StepEvent, offset: int, step: int) -> None:
        s, mask_id = job.settings, self.special.mask_id
        if job.denoise:
            committed = int(event.committed_BT[offset : offset + len(rows)].sum())
            self._frame(job, rows, event.gen_start_B[offset:], committed, step, event.block)
        if job.stream_text and s.cfg.policy != "uniform":
            gens = [row[g : g + s.max_tokens] for row, g in zip(rows, event.gen_start_B[offset:], strict=False)]
            for i, ids in enumerate(gens):
                decided = ids[: ids.index(mask_id)] if mask_id in ids else ids
                self._send_text(job, i, decided, final=False)

    def _frame(self, job: Job, rows: list[list[int]], gen_start: list[int], committed: int, step: int, block: int,
               last: bool = False) -> None:  # fmt: skip
        """The canvas of the job's rows (their first max_tokens positions), masks as MASK."""
        n, mask_id = job.settings.max_tokens, self.special.mask_id
        gens = [row[g : g + n] for row, g in zip(rows, gen_start, strict=False)]
        frame = [[MASK if t == mask_id else self.piece(t) for t in ids] for ids in gens]
        nfe = getattr(self._local, "forwards", 0)
        job.sink("frame", {"step": step, "block": block, "committed": committed, "rows": frame, "last": last,
                           "nfe": nfe})  # fmt: skip

    def _send_text(self, job: Job, i: int, ids: list[int], final: bool) -> None:
        """Send the new text of row i: its decided ids, cut at EOS and stop strings; while not final,
        hold back a partial character and what could still become a stop string."""
        cfg = job.settings.cfg
        eos = self.special.eos_id
        ended = cfg.stop_at_eos and eos in ids
        text = self.tokenizer.decode(ids[: ids.index(eos)] if ended else ids)
        cut = cut_at_stop(text, cfg.stop_strings)
        if not final and not ended and len(cut) == len(text):
            text = text.rstrip("\ufffd")
            hold = max((len(x) for x in cfg.stop_strings), default=1) - 1
            cut = text[: len(text) - hold] if hold else text
        sent = job.sent[i]
        if len(cut) > len(sent) and cut.startswith(sent):
            job.sent[i] = cut
            job.sink("delta", (i, cut[len(sent) :]))

    def _row_result(self, result: GenerationResult, b: int, s: Settings) -> tuple[RowResult, list[int]]:
        """The text of row b cut at EOS, max_tokens and stop strings, its token count and why it ended; and
        the ids of that text."""
        cfg = s.cfg
        ids = result.sequences[b][: s.max_tokens]
        g = result.gen_start_B[b]
        raw = result.canvas_BL[b, g : g + s.max_tokens].tolist()
        reason = "stop" if cfg.stop_at_eos and self.special.eos_id in raw else "length"
        full = self.tokenizer.decode(ids)
        text = cut_at_stop(full, cfg.stop_strings)
        if len(text) < len(full):  # the tokens up to the one that completed the stop string
            reason = "stop"
            ids = next((ids[:k] for k in range(1, len(ids) + 1) if len(cut_at_stop(self.tokenizer.decode(ids[:k]),
                        cfg.stop_strings)) < len(self.tokenizer.decode(ids[:k]))), ids)  # fmt: skip
        return RowResult(text, len(ids), reason), ids

    def piece(self, token: int) -> str:
        """The text of one token, special tokens by name (cached: the frames decode every position)."""
        if token not in self._pieces:
            self._pieces[token] = self.tokenizer.decode([token], skip_special=False)
        return self._pieces[token]
