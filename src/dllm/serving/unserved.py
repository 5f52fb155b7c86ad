"""The request fields this server knows and does not honour: the one place they are refused.

A request that sends one of them with any value other than null or the value that changes nothing
(`tool_choice: "none"`, `presence_penalty: 0`, `response_format: {"type": "text"}`, ...) gets a 400
naming the field and why: a field is never accepted and then silently ignored. A model kind that comes
to honour a field (log-probabilities for causal models, say) drops it from the table it is checked
against, here and nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dllm.serving.errors import ApiError


@dataclass(frozen=True)
class Unserved:
    why: str
    """Why the field is refused, and what to send instead where there is something."""
    no_ops: tuple[Any, ...] = ()
    """Values that ask for nothing (besides null): accepted, as the server then does what they ask."""


_TOOLS = "tool and function calling are not served"
_LOGPROBS = "log-probabilities are served for causal models only (dllm serve --ar or --draft)"
_SPECULATIVE = "speculative decoding is the server's (dllm serve --draft DRAFTER)"

LOGPROB_FIELDS = {
    "logprobs": Unserved(_LOGPROBS, (False,)),
    "top_logprobs": Unserved(_LOGPROBS),
    "echo": Unserved("echoing the prompt back (with its log-probabilities) is served for causal models only", (False,)),
}
"""OpenAI's log-probability fields, in one group: a causal model's server honours them (protocol.parse_request)."""

SPECULATIVE_FIELDS = {"speculative"}
"""Honoured by a server with a drafter (protocol.parse_request): `speculative: false` decodes a request without it."""

REQUEST_FIELDS = {
    **LOGPROB_FIELDS,
    "suffix": Unserved("insertion (a suffix after the completion) is not served", ("",)),
    "best_of": Unserved("best_of is not served; ask for n choices instead", (1,)),
    "presence_penalty": Unserved("penalties are not served", (0,)),
    "frequency_penalty": Unserved("penalties are not served", (0,)),
    "logit_bias": Unserved("logit_bias is not served", ({},)),
    "tools": Unserved(_TOOLS, ([],)),
    "tool_choice": Unserved(_TOOLS, ("none",)),
    "parallel_tool_calls": Unserved(_TOOLS),
    "functions": Unserved(_TOOLS, ([],)),
    "function_call": Unserved(_TOOLS, ("none",)),
    "response_format": Unserved('structured output is not served; only {"type": "text"}', ({"type": "text"},)),
    "modalities": Unserved("only text is served", (["text"],)),
    "audio": Unserved("only text is served"),
    "prediction": Unserved("predicted outputs are not served"),
    "reasoning_effort": Unserved("reasoning effort is not served"),
    "web_search_options": Unserved("web search is not served"),
    "store": Unserved("nothing is stored here", (False,)),
    "metadata": Unserved("nothing is stored here, so there is nothing to attach metadata to", ({},)),
    "service_tier": Unserved("there is one service tier", ("auto", "default")),
    "draft_model": Unserved(_SPECULATIVE),
    "speculative": Unserved(_SPECULATIVE, (False,)),
    "edits": Unserved("edit-flow decoding is not served yet"),
}
"""Top-level fields of a completion or chat request."""

MESSAGE_FIELDS = {
    "name": Unserved("participant names are not passed to the chat template"),
    "tool_calls": Unserved(_TOOLS, ([],)),
    "tool_call_id": Unserved(_TOOLS),
    "function_call": Unserved(_TOOLS),
    "refusal": Unserved("refusals are not passed to the chat template"),
    "audio": Unserved("only text is served"),
}
"""Fields of one chat message."""


def refuse_unserved(data: dict[str, Any], table: dict[str, Unserved], where: str = "") -> dict[str, Any]:
    """400 naming the first field of `data` that `table` refuses with a value that asks for something;
    else `data` without the table's fields (each is null or asks for nothing, which is what the server does)."""
    for name, value in data.items():
        rule = table.get(name)
        if rule is None or value is None or any(_same(value, v) for v in rule.no_ops):
            continue
        accepted = " or ".join(["null", *(_show(v) for v in rule.no_ops)])
        raise ApiError(400, f"{where}{name}: {rule.why} (this server accepts {accepted} here)", param=where + name,
                       code="unsupported_field")  # fmt: skip
    return {k: v for k, v in data.items() if k not in table}


def _same(value: Any, no_op: Any) -> bool:
    """Equal, and not through bool being an int (`logprobs: 0` asks for something, `false` does not)."""
    return value == no_op and isinstance(value, bool) == isinstance(no_op, bool)


def _show(value: Any) -> str:
    return json.dumps(value)
