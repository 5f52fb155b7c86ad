"""Peak memory and time of the chunked LM head + CE against the plain one (forward + backward).

Memory is measured on any device (the CPU allocator keeps no statistics) by `LiveTensorBytes`, a
TorchDispatchMode that sees every tensor an aten op returns, keeps a weak reference to its storage and
sums the bytes of the storages still alive after each op: the peak of memory allocated inside the
measured region (autograd backward included; scratch space inside one kernel is not seen, and
tensors that existed before, e.g. the inputs, are not counted). Both variants run in this one
process, interleaved (A B A B ...); the JSON line reports medians and the chunked/plain ratios.

    python bench/chunked_ce.py [--rounds 3] [--tokens 8192] [--vocab 32000] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.profiling import LiveTensorBytes


def make_inputs(N: int, V: int, E: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden_NE = torch.randn(N, E, generator=g).requires_grad_()
    weight_VE = (torch.randn(V, E, generator=g) * E**-0.5).requires_grad_()
    targets_N = torch.randint(1, V, (N,), generator=g)
    weights_N = torch.rand(N, generator=g)
    return hidden_NE, weight_VE, targets_N, weights_N


def step(loss_fn: Callable, inputs: tuple[torch.Tensor, ...]) -> None:
    """Forward + backward of one loss; the mask token (id 0) is excluded as in MDLM."""
    hidden_NE, weight_VE, targets_N, weights_N = inputs
    hidden_NE.grad = weight_VE.grad = None
    weighted_sum, _ = loss_fn(hidden_NE, weight_VE, targets_N, weights_N, exclude_ids=(0,))
    weighted_sum.backward()


def peak_bytes(loss_fn: Callable, inputs: tuple[torch.Tensor, ...]) -> int:
    with LiveTensorBytes(exclude=inputs) as tracker:
        step(loss_fn, inputs)
    return tracker.peak_bytes


def seconds(loss_fn: Callable, inputs: tuple[torch.Tensor, ...]) -> float:
    start = time.perf_counter()
    step(loss_fn, inputs)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    inputs = make_inputs(args.tokens, args.vocab, args.hidden)
    fns = {"chunked": linear_cross_entropy, "plain": plain_cross_entropy}
    mem = {name: peak_bytes(fn, inputs) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(args.rounds):  # interleaved so machine jitter hits both alike
        for name, fn in fns.items():
            times[name].append(seconds(fn, inputs))
    t = {name: statistics.median(v) for name, v in times.items()}
    result = {
        "bench": "chunked_ce",
        "tokens": args.tokens,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "dtype": "float32",
        "device": "cpu",
        "peak_mib_chunked": round(mem["chunked"] / 2**20, 1),
        "peak_mib_plain": round(mem["plain"] / 2**20, 1),
        "peak_ratio_chunked_over_plain": round(mem["chunked"] / mem["plain"], 4),
        "time_s_chunked": round(t["chunked"], 3),
        "time_s_plain": round(t["plain"], 3),
        "time_ratio_chunked_over_plain": round(t["chunked"] / t["plain"], 3),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
