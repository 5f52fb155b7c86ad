"""A request as the engine holds it (`Job`), what it returns per row (`RowResult`), and what its client sees
of its decoding (`Streams`): text deltas as a row's decided prefix grows, whole-canvas frames for the
denoising view, and each row's final text cut at EOS, `max_tokens` and stop strings.

Text is sent once everything before it is decided (positions commit in any order); while a row runs, a
partial character and what could still become a stop string are held back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dllm.sampling.canvas import SpecialIds
from dllm.sampling.results import GenerationResult, StepEvent
from dllm.sampling.stops import cut_at_stop
from dllm.serving.protocol import Settings
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


class Streams:
    """The client's view of its request: deltas, frames and the rows' final text."""

    def __init__(self, tokenizer: Tokenizer, special: SpecialIds) -> None:
        self.tokenizer, self.special = tokenizer, special
        self.pieces: dict[int, str] = {}

    def show_step(self, batch: list[Job], watched: list[Job], event: StepEvent, step: int, nfe: int) -> None:
        """The step's text deltas and denoising frames of the jobs that watch them (frames show the draft of a
        loop that has one, canvas_denoise's proposals; text streams only what is decided)."""
        canvas = event.canvas_BT.tolist()
        view = canvas if event.draft_BT is None else event.draft_BT.tolist()
        offset = 0
        for job in batch:
            if job in watched and not job.cancelled.is_set():
                n = len(job.rows)
                self.stream(job, canvas[offset : offset + n], view[offset : offset + n], event, offset, step, nfe)
            offset += len(job.rows)

    def stream(self, job: Job, rows: list[list[int]], view: list[list[int]], event: StepEvent, offset: int, step: int,
               nfe: int) -> None:  # fmt: skip
        s, mask_id = job.settings, self.special.mask_id
        if job.denoise:
            committed = int(event.committed_BT[offset : offset + len(rows)].sum())
            self.frame(job, view, event.gen_start_B[offset:], committed, step, event.block, nfe)
        if job.stream_text and s.cfg.policy != "uniform":
            gens = [row[g : g + s.max_tokens] for row, g in zip(rows, event.gen_start_B[offset:], strict=False)]
            for i, ids in enumerate(gens):
                decided = ids[: ids.index(mask_id)] if mask_id in ids else ids
                self.send_text(job, i, decided, final=False)

    def frame(self, job: Job, rows: list[list[int]], gen_start: list[int], committed: int, step: int, block: int,
              nfe: int, last: bool = False) -> None:  # fmt: skip
        """The canvas of the job's rows (their first max_tokens positions), masks as MASK."""
        n, mask_id = job.settings.max_tokens, self.special.mask_id
        gens = [row[g : g + n] for row, g in zip(rows, gen_start, strict=False)]
        frame = [[MASK if t == mask_id else self.piece(t) for t in ids] for ids in gens]
        job.sink("frame", {"step": step, "block": block, "committed": committed, "rows": frame, "last": last,
                           "nfe": nfe})  # fmt: skip

    def send_text(self, job: Job, i: int, ids: list[int], final: bool) -> None:
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

    def row_result(self, result: GenerationResult, b: int, s: Settings) -> tuple[RowResult, list[int]]:
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
        if token not in self.pieces:
            self.pieces[token] = self.tokenizer.decode([token], skip_special=False)
        return self.pieces[token]
