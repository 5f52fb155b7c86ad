"""The server's counters in the Prometheus text exposition format (GET /metrics).

A few thread-safe counters, gauges and histograms, written out by hand: the format is a handful of
lines per metric (https://prometheus.io/docs/instrumenting/exposition_formats/), not worth a dependency.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

# Bucket bounds: an idle sampler takes a request after the batching window (--max-wait-ms, 10 ms by
# default) or sooner; a first token comes after one forward at least; a long canvas may decode for minutes.
QUEUE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FIRST_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)

HISTOGRAMS = {
    "dllm_request_queue_time_seconds": (QUEUE_BUCKETS_S, "Time a request waited in the queue for its sampler call."),
    "dllm_time_to_first_token_seconds": (
        FIRST_TOKEN_BUCKETS_S,
        "Time from a request's arrival to the first token sent to its client (a stream's first text or frame; "
        "the response of a whole answer).",
    ),
    "dllm_request_latency_seconds": (REQUEST_BUCKETS_S, "End to end: from a request's arrival to its last byte."),
    "dllm_batch_latency_seconds": (LATENCY_BUCKETS_S, "Time of one sampler call."),
    "dllm_batch_size": (BATCH_BUCKETS, "Rows (choices) decoded together in one sampler call."),
}
"""Every histogram: its buckets and help. Requests are counted once answered (errors are not timed)."""


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return [
            *out,
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.total:.6g}",
            f"{name}_count {self.count}",
        ]


class Metrics:
    """What GET /metrics reports. `queue_length` is read when the page is rendered."""

    COUNTERS = {
        "dllm_requests_total": "Requests answered, by endpoint and HTTP status.",
        "dllm_prompt_tokens_total": "Prompt tokens of the rows decoded (a prompt counts once per choice).",
        "dllm_generated_tokens_total": "Tokens returned to clients.",
        "dllm_nfe_total": "Model forward calls of the sampler.",
        "dllm_batches_total": "Sampler calls (one per batch of requests; a running batch: one per request).",
        "dllm_cancelled_total": "Requests whose client went away before their result.",
    }

    def __init__(self, queue_length: Callable[[], int]) -> None:
        self._lock = threading.Lock()
        self.queue_length = queue_length
        self.counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = {k: {} for k in self.COUNTERS}
        self.histograms = {name: Histogram(buckets) for name, (buckets, _) in HISTOGRAMS.items()}

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self.counters[name][key] = self.counters[name].get(key, 0) + value

    def value(self, name: str, **labels: str) -> float:
        """A counter's total over the series matching `labels` (tests, the health page)."""
        with self._lock:
            return sum(v for k, v in self.counters[name].items() if set(labels.items()) <= set(k))

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.histograms[name].observe(value)

    def observe_batch(self, rows: int, seconds: float, nfe: int) -> None:
        self.observe("dllm_batch_size", rows)
        self.observe("dllm_batch_latency_seconds", seconds)
        self.inc("dllm_batches_total")
        self.inc("dllm_nfe_total", nfe)

    def render(self) -> str:
        lines: list[str] = []
        with self._lock:
            for name, help_text in self.COUNTERS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                series = self.counters[name] or {(): 0}
                for key, v in series.items():
                    labels = ",".join(f'{k}="{val}"' for k, val in key)
                    lines.append(f"{name}{{{labels}}} {v:g}" if labels else f"{name} {v:g}")
            lines += ["# HELP dllm_queue_length Requests waiting for the sampler.", "# TYPE dllm_queue_length gauge",
                      f"dllm_queue_length {self.queue_length()}"]  # fmt: skip
            for name, (_, help_text) in HISTOGRAMS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *self.histograms[name].lines(name)]
        return "\n".join(lines) + "\n"
