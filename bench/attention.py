"""Block-diffusion attention (BD3LM 2L mask, Arriola et al. 2025): dense SDPA vs FlexAttention vs blockwise.

For each L (sequence 2L = [x_t ; x_0]), batch 2, 8 query/key heads, head dim 64, block size 32:
- forward without grad (sampling, evaluation): SDPA with the dense bool mask, compiled FlexAttention
  and eager FlexAttention, both with the BlockMask; masks are built once and reused, as the
  per-description cache does for every layer of a step;
- forward + backward of every backend with a backward on this device (CPU: dense SDPA and blockwise,
  the exact path that `auto` trains with on CPU: on CPU the split path of bd_split.py, compared with
  `chunked_attention`, the one-SDPA-call-per-chunk path of other devices; `--chunk-counts 4 8 16` adds blockwise
  forward + backward at those chunk counts, to tune `DEFAULT_NUM_CHUNKS`);
- the one-off cost per step of building each mask (dense bool tensor vs BlockMask vs chunk masks).
Variants are measured interleaved (A B C A B C ...) in this one process; the JSON line reports
medians and ratios. The first compiled call per shape compiles (~30 s on a 2-core CPU) in warm-up.

One intra-op thread by default: on a 2-core machine shared with other work, two OpenMP threads wait
on each other and small elementwise ops take 10-100x longer, which would swamp the comparison.

    python bench/attention.py [--rounds 7] [--lengths 512 1024] [--block-size 32] [--threads 1]
                              [--chunk-counts 4 8 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import flex_attention

from dllm.attention.backends.blockwise import (
    DEFAULT_NUM_CHUNKS,
    blockwise_attention,
    chunk_masks,
    chunk_plan,
    chunked_attention,
)
from dllm.attention.backends.flex import compiled_flex, flex_block_mask
from dllm.attention.backends.sdpa import sdpa_attention, sdpa_mask
from dllm.attention.masks import AttentionMask

BATCH, HEADS, HEAD_DIM = 2, 8, 64


def make_inputs(seq_len: int, grad: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, 2 * seq_len, HEAD_DIM)
    return [torch.randn(shape, generator=g).requires_grad_(grad) for _ in range(3)]


def variants(seq_len: int, block_size: int, chunk_counts: list[int]) -> dict[str, Callable[[], object]]:
    """name -> one timed call; masks are prebuilt on one description (steady state of a step).

    Only the fwd_bwd inputs require grad, so the forward variants record no autograd graph.
    """
    mask = AttentionMask("block_diffusion", block_size=block_size)
    q, k, v = make_inputs(seq_len, grad=False, seed=0)
    qg, kg, vg = make_inputs(seq_len, grad=True, seed=1)
    S, device = 2 * seq_len, q.device
    block_mask = flex_block_mask(mask, BATCH, S, S, device)
    sdpa_mask(mask, BATCH, S, S, device)  # prebuild the dense mask into the same cache
    for n in {DEFAULT_NUM_CHUNKS, *chunk_counts}:  # and the chunk masks / split plans of every chunk count
        blockwise_attention(q, k, v, mask, num_chunks=n)
        chunked_attention(q, k, v, mask, num_chunks=n)

    def fwd_bwd(attend: Callable[..., torch.Tensor], **kw: int) -> Callable[[], None]:
        return lambda: attend(qg, kg, vg, mask, **kw).sum().backward()

    def fresh() -> AttentionMask:
        return AttentionMask("block_diffusion", block_size=block_size)

    def build_chunk_masks() -> None:
        new = fresh()
        chunk_masks(new, chunk_plan(new, S, S, DEFAULT_NUM_CHUNKS), BATCH, S, device)

    tuning = {f"fwd_bwd_blockwise_S{n}": fwd_bwd(blockwise_attention, num_chunks=n) for n in chunk_counts}
    return {
        "fwd_sdpa_dense": lambda: sdpa_attention(q, k, v, mask),
        "fwd_flex_compiled": lambda: compiled_flex()(q, k, v, block_mask=block_mask),
        "fwd_flex_eager": lambda: flex_attention(q, k, v, block_mask=block_mask),
        "fwd_blockwise": lambda: blockwise_attention(q, k, v, mask),
        "fwd_bwd_sdpa_dense": fwd_bwd(sdpa_attention),
        "fwd_bwd_blockwise": fwd_bwd(blockwise_attention),
        "fwd_chunked": lambda: chunked_attention(q, k, v, mask),
        "fwd_bwd_chunked": fwd_bwd(chunked_attention),
        **tuning,
        "build_dense_mask": lambda: sdpa_mask(fresh(), BATCH, S, S, device),
        "build_block_mask": lambda: flex_block_mask(fresh(), BATCH, S, S, device),
        "build_chunk_masks": build_chunk_masks,
    }


def timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def measure(seq_len: int, block_size: int, rounds: int, warmup: int, chunk_counts: list[int]) -> dict[str, float]:
    fns = variants(seq_len, block_size, chunk_counts)
    for _ in range(warmup):  # compiles the flex kernel for this shape
        for fn in fns.values():
            timed_ms(fn)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):  # interleaved: jitter hits every variant alike
        for name, fn in fns.items():
            samples[name].append(timed_ms(fn))
    return {name: round(statistics.median(s), 2) for name, s in samples.items()}


def chunked_ce_memory(tokens: int = 8192, vocab: int = 32000, hidden: int = 256) -> dict[str, object]:
    """Peak memory (forward + backward) of the LM head + cross-entropy at vocab 32k and 8k tokens:
    chunked (run for real) vs full logits (run on the meta device: the same allocations without the
    arithmetic, so the 3 GB reference costs nothing). Measured by dllm.profiling.LiveTensorBytes."""
    from chunked_ce import make_inputs, step  # bench/chunked_ce.py, next to this script
    from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
    from dllm.profiling import LiveTensorBytes

    peak = {}
    for name, fn, device in (("chunked", linear_cross_entropy, "cpu"), ("plain", plain_cross_entropy, "meta")):
        inputs = tuple(t.to(device) for t in make_inputs(tokens, vocab, hidden))
        inputs = tuple(t.detach().requires_grad_(t.is_floating_point() and i < 2) for i, t in enumerate(inputs))
        with LiveTensorBytes(exclude=inputs) as tracker:
            step(fn, inputs)
        peak[name] = tracker.peak_bytes / 2**20
    return {
        "ce": {"tokens": tokens, "vocab": vocab, "hidden": hidden},
        "ce_peak_mib_chunked": round(peak["chunked"], 1),
        "ce_peak_mib_plain": round(peak["plain"], 1),
        "ce_peak_ratio_chunked_over_plain": round(peak["chunked"] / peak["plain"], 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads; 2 threads on a shared 2-core box spin")
    ap.add_argument("--chunk-counts", type=int, nargs="*", default=[], help="also time blockwise fwd+bwd at these")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    result: dict[str, object] = {
        "bench": "attention",
        "device": "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": {"batch": BATCH, "heads": HEADS, "kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float32"},
        "block_size": args.block_size,
        "rounds": args.rounds,
        "backward_backends": ["sdpa", "blockwise"],  # FlexAttention has no CPU backward (torch 2.13)
        "blockwise_num_chunks": DEFAULT_NUM_CHUNKS,
    }
    for L in args.lengths:
        ms = measure(L, args.block_size, args.rounds, args.warmup, args.chunk_counts)
        result[f"L{L}"] = {"seq_2L": 2 * L, "allowed_fraction": (L * L + L * args.block_size) / (4 * L * L), "ms": ms}
        dense = ms["fwd_sdpa_dense"]
        result[f"flex_compiled_fwd_speedup_vs_dense_L{L}"] = round(dense / ms["fwd_flex_compiled"], 3)
        result[f"flex_eager_fwd_speedup_vs_dense_L{L}"] = round(dense / ms["fwd_flex_eager"], 3)
        result[f"block_mask_build_vs_dense_mask_L{L}"] = round(ms["build_block_mask"] / ms["build_dense_mask"], 3)
        result[f"fwd_bwd_vs_fwd_sdpa_L{L}"] = round(ms["fwd_bwd_sdpa_dense"] / dense, 3)
        result[f"blockwise_fwd_speedup_vs_dense_L{L}"] = round(dense / ms["fwd_blockwise"], 3)
        dense_bwd = ms["fwd_bwd_sdpa_dense"]
        result[f"blockwise_fwd_bwd_speedup_vs_dense_L{L}"] = round(dense_bwd / ms["fwd_bwd_blockwise"], 3)
        result[f"split_fwd_bwd_speedup_vs_chunked_L{L}"] = round(ms["fwd_bwd_chunked"] / ms["fwd_bwd_blockwise"], 3)
        result[f"split_fwd_speedup_vs_chunked_L{L}"] = round(ms["fwd_chunked"] / ms["fwd_blockwise"], 3)
        for n in args.chunk_counts:
            tuned = ms[f"fwd_bwd_blockwise_S{n}"]
            result[f"blockwise_S{n}_fwd_bwd_speedup_vs_dense_L{L}"] = round(dense_bwd / tuned, 3)
        result[f"chunk_masks_build_vs_dense_mask_L{L}"] = round(ms["build_chunk_masks"] / ms["build_dense_mask"], 3)
    result.update(chunked_ce_memory())
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
