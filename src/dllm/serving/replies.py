"""The OpenAI shapes of one request's answer: a whole completion or chat completion, or the chunks of
its server-sent-event stream (text deltas, denoising frames, the closing chunks with usage)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dllm.serving.jobs import RowResult
from dllm.serving.protocol import ChatRequest, CompletionRequest, Settings


def from_json(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@dataclass
class Reply:
    """The OpenAI shapes of one request's answer: whole, or as stream chunks."""

    kind: str  # completion, chat or denoise
    chat: bool
    model_id: str
    prompts: list[list[int]]
    req: CompletionRequest | ChatRequest
    settings: Settings

    def __post_init__(self) -> None:
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}

    def usage(self, rows: list[RowResult]) -> dict[str, int]:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(r.completion_tokens for r in rows)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def final(self, rows: list[RowResult], counters: dict) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason":
                        r.finish_reason, "logprobs": self.chat_logprobs(r)} for i, r in enumerate(rows)]  # fmt: skip
            body = {**self._head("chat.completion"), "choices": choices}
        else:
            choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason,
                        "logprobs": self.completion_logprobs(r)} for i, r in enumerate(rows)]  # fmt: skip
            body = {**self._head("text_completion"), "choices": choices}
        return {**body, "usage": self.usage(rows), "dllm": _sampler_counters(counters)}

    def _scored(self, r: RowResult) -> range:
        """The positions of a row's scores that the answer reports: the completion's, with echo the prompt's too."""
        assert r.logprobs is not None
        total = len(r.logprobs)
        echo = isinstance(self.req, CompletionRequest) and self.req.echo
        return range(0 if echo else total - r.completion_tokens, total)

    def completion_logprobs(self, r: RowResult) -> dict[str, Any] | None:
        """OpenAI's legacy shape: tokens, token_logprobs (null for a text's first token), top_logprobs
        ({token: logprob} of the `logprobs` most likely) and text_offset (from the start of `text`)."""
        if r.logprobs is None or not isinstance(self.req, CompletionRequest) or self.req.logprobs is None:
            return None
        at = self._scored(r)
        tokens = [r.pieces[i] for i in at]
        top = [dict(r.top[i]) if i else None for i in at] if self.req.logprobs else None
        offsets, n = [], 0
        for t in tokens:
            offsets.append(n)
            n += len(t)
        return {"tokens": tokens, "token_logprobs": [r.logprobs[i] for i in at], "top_logprobs": top,
                "text_offset": offsets}  # fmt: skip

    def chat_logprobs(self, r: RowResult) -> dict[str, Any] | None:
        """OpenAI's chat shape: per token of the reply its text, logprob, UTF-8 bytes and top_logprobs."""
        if r.logprobs is None:
            return None

        def entry(text: str, logprob: float) -> dict[str, Any]:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [{**entry(r.pieces[i], r.logprobs[i]),  # type: ignore[arg-type]
                    "top_logprobs": [entry(t, lp) for t, lp in r.top[i]]} for i in self._scored(r)]  # fmt: skip
        return {"content": content, "refusal": None}

    def opening(self) -> dict[str, Any]:
        """The first event: the chat role, or the canvas size of a denoising stream."""
        if self.kind == "denoise":
            return {**self._head("denoise.start"), "max_tokens": self.settings.max_tokens, "n": len(self.prompts) *
                    self.req.n, "steps": self.settings.cfg.total_steps}  # fmt: skip
        if self.chat:
            choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                       for i in range(len(self.prompts) * self.req.n)]  # fmt: skip
            return {**self._head("chat.completion.chunk"), "choices": choices}
        choices = [{"index": i, "text": "", "finish_reason": None, "logprobs": None}
                   for i in range(len(self.prompts) * self.req.n)]  # fmt: skip
        return {**self._head("text_completion"), "choices": choices}

    def delta(self, index: int, text: str) -> dict[str, Any]:
        if self.chat:
            return {**self._head("chat.completion.chunk"),
                    "choices": [{"index": index, "delta": {"content": text}, "finish_reason": None}]}  # fmt: skip
        return {**self._head("text_completion"),
                "choices": [{"index": index, "text": text, "finish_reason": None, "logprobs": None}]}  # fmt: skip

    def frame(self, frame: dict[str, Any]) -> dict[str, Any]:
        masked = sum(t is None for row in frame["rows"] for t in row)
        choices = [{"index": i, "tokens": row} for i, row in enumerate(frame["rows"])]
        return {**self._head("denoise.frame"), "step": frame["step"], "block": frame["block"],
                "committed": frame["committed"], "masked": masked, "final": frame["last"], "nfe": frame["nfe"],
                "choices": choices}  # fmt: skip

    def closing(self, rows: list[RowResult], counters: dict) -> list[dict[str, Any]]:
        if self.kind == "denoise":  # one shape for prompts and conversations: the text of each row
            choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason} for i, r in enumerate(rows)]
            return [{**self._head("denoise.done"), "choices": choices, "usage": self.usage(rows),
                     "dllm": _sampler_counters(counters)}]  # fmt: skip
        if self.chat:
            choices = [{"index": i, "delta": {}, "finish_reason": r.finish_reason} for i, r in enumerate(rows)]
            out = [{**self._head("chat.completion.chunk"), "choices": choices}]
        else:
            choices = [{"index": i, "text": "", "finish_reason": r.finish_reason, "logprobs": None}
                       for i, r in enumerate(rows)]  # fmt: skip
            out = [{**self._head("text_completion"), "choices": choices}]
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            obj = "chat.completion.chunk" if self.chat else "text_completion"
            out.append({**self._head(obj), "choices": [], "usage": self.usage(rows)})
        out[-1]["dllm"] = _sampler_counters(counters)
        return out


def _sampler_counters(counters: dict) -> dict[str, Any]:
    """What the sampler call that answered spent (shared by the whole batch); a causal model's also its rounds,
    drafted and accepted tokens and tau (speculative decoding)."""
    keys = ("nfe", "steps", "tokens_committed", "tokens_per_forward", "batch_rows")
    if "tau" in counters:  # the causal loop's
        keys += ("rounds", "drafted", "accepted", "tau", "acceptance_rate")
    return {k: counters[k] for k in keys if k in counters}
