"""The windowed configuration of bench/context_parallel.py: DiffusionGemma's [clean ; canvas] layout
(prefix_canvas) with sliding-window and full layers, its traffic formula and the 26B-A4B projection.

Three ways to share one sequence over n ranks, all through `ContextParallelAttention`'s routed exchange
(one all_to_all_single per layer over the context group; dllm/parallel/context_routes.py):

- `cp`: position-sharded CP over the 2L rows, every layer exchanging every row (as a full layer does);
- `csbp_full`: CSBP (cp = bp = n, contiguous), every layer exchanging as a full layer: the clean rows of
  the CP group, plus the canvas rows next to each rank's blocks (blocks follow each batch row's response
  start, so a block may straddle two ranks);
- `csbp_window`: the same, with the sliding-window layers receiving only what their window reaches.

Rows a rank sends per layer per pass (`prefix_canvas_rows`, contiguous schedule, cp = bp = n, S = L/n
rows of each half per rank, rank r of n, B the block size, w the window, S >= w + B - 2):

    cp:                    sent = received = (n - 1) 2L/n
    csbp_full:             sent = received = (n - 1) S + (B - 1) [r < n-1] + (B - 1) [r > 0]
    csbp_window (sliding): sent = (w + 2B - 3) [r < n-1] + (B - 1) [r > 0]
                           received = (w + 2B - 3) [r > 0] + (B - 1) [r < n-1]
    csbp_window (full layers): as csbp_full

The forward sends the rows, the backward sends back the gradients of the rows received; bytes = rows x
2 (K, V) x batch x K x D x dtype bytes of that layer kind.

Shapes: B block size, L sequence length (2L rows), K key/value heads, D head width.
"""

from __future__ import annotations

GiB = 2**30
KINDS = ("cp", "csbp_full", "csbp_window")

# The bench's DiffusionGemma-like model: one sliding and one full layer, each of its own head shape
DGEMMA_MODEL = {
    "family": "diffusion_gemma", "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
    "head_dim": 16, "attention_pattern": ["local", "global"], "global_head_dim": 32, "global_num_kv_heads": 1,
    "router_aux_loss_coef": 0.0,
}  # fmt: skip

# DiffusionGemma 26B-A4B as described publicly (see `projection` for the sources and what is assumed)
PROJECTION_26B = {
    "num_layers": 30, "sliding_layers": 25, "full_layers": 5, "window": 1024,
    "sliding": {"num_kv_heads": 8, "head_dim": 256}, "full": {"num_kv_heads": 2, "head_dim": 512},
    "num_heads": 16, "dtype_bytes": 2, "seq_len": 262144, "block_size": 256, "cp": 8, "batch": 1,
}  # fmt: skip
PUBLISHED_26B_GIB = {"before": 433.0, "after": 28.3}


def prefix_canvas_rows(kind: str, seq_len: int, block: int, window: int | None, n: int, rank: int) -> tuple[int, int]:
    """(rows sent, rows received) by `rank` of n per layer per pass (module doc); `window` None: a full layer."""
    L, B, S = seq_len, block, seq_len // n
    if kind == "cp":
        rows = (n - 1) * 2 * L // n
        return rows, rows
    first, last = rank == 0, rank == n - 1
    halo_next, halo_prev = (0 if last else B - 1), (0 if first else B - 1)  # canvas rows to / from each neighbour
    if kind == "csbp_full" or window is None:
        rows = (n - 1) * S + halo_next + halo_prev
        return rows, rows
    assert kind == "csbp_window" and window + B - 2 <= S, "the closed form assumes a window inside one rank's rows"
    reach = window + B - 2  # clean rows before a run of canvas blocks that its windows reach
    sent = (0 if last else reach) + halo_next + halo_prev
    received = (0 if first else reach) + halo_next + halo_prev
    return sent, received


def layer_bytes(kind: str, seq_len: int, block: int, window: int, n: int, rank: int, shape: dict) -> dict[str, int]:
    """Bytes `rank` sends per step, one sliding and one full layer of `shape` ({"sliding": {K, D}, "full": ...}),
    forward (rows sent) and backward (gradients of the rows received)."""
    out = {}
    for layer, w in (("sliding", window if kind == "csbp_window" else None), ("full", None)):
        sent, received = prefix_canvas_rows(kind, seq_len, block, w, n, rank)
        row = 2 * shape["batch"] * shape[layer]["num_kv_heads"] * shape[layer]["head_dim"] * shape["dtype_bytes"]
        out[f"{layer}_forward"], out[f"{layer}_backward"] = sent * row, received * row
    return out


def projection() -> dict[str, object]:
    """Attention traffic per GPU per step of DiffusionGemma 26B-A4B, by the formula above: the busiest rank
    (an inner one) of position-sharded CP, full-attention CSBP and window-aware CSBP at cp = bp = 8."""
    s = PROJECTION_26B
    per_gpu = {}
    for kind in KINDS:
        n = s["cp"]
        per_rank = [layer_bytes(kind, s["seq_len"], s["block_size"], s["window"], n, r, s) for r in range(n)]
        totals = [s["sliding_layers"] * (b["sliding_forward"] + b["sliding_backward"])
                  + s["full_layers"] * (b["full_forward"] + b["full_backward"]) for b in per_rank]  # fmt: skip
        b = per_rank[max(range(n), key=totals.__getitem__)]
        sliding = s["sliding_layers"] * (b["sliding_forward"] + b["sliding_backward"]) / GiB
        full = s["full_layers"] * (b["full_forward"] + b["full_backward"]) / GiB
        per_gpu[kind] = {"sliding_layers_gib": round(sliding, 3), "full_layers_gib": round(full, 3),
                         "total_gib": round(sliding + full, 2)}  # fmt: skip
    window = per_gpu["csbp_window"]["total_gib"]
    return {
        "shape": s,
        "assumptions": (
            "30 layers (25 sliding with window 1024, 5 full), 16 query heads, K/V heads 8 x 256 on sliding and "
            "2 x 512 on full layers (num_global_key_value_heads 2, global_head_dim 512), canvas 256, from public "
            "descriptions of Gemma 4 26B-A4B and transformers' diffusion_gemma config (its class defaults are "
            "not this checkpoint's); assumed: L = 262144 (max_position_embeddings) clean tokens plus as many "
            "canvas rows, batch 1, bf16, CP8 with cp = bp = 8 (contiguous), K and V both sent on full layers "
            "(their values are the keys before the key norm and RoPE), no activation-checkpointing recompute"
        ),
        "per_gpu_per_step": per_gpu,
        "window_over_full_csbp": round(window / per_gpu["csbp_full"]["total_gib"], 4),
        "window_over_cp": round(window / per_gpu["cp"]["total_gib"], 4),
        "published_gib": PUBLISHED_26B_GIB,
        "published_after_over_before": round(PUBLISHED_26B_GIB["after"] / PUBLISHED_26B_GIB["before"], 4),
    }


def kind_of(job) -> str:
    """The formula's name of a windowed job (bench/context_parallel_windows.py)."""
    return "cp" if job.mode == "cp" else "csbp_window" if job.window_aware else "csbp_full"


def summarize(job, records: list[dict]) -> dict[str, object]:
    """Every rank's bytes per layer kind against the formula; the busiest rank's step total."""
    a = records[0]["attention"]
    m = DGEMMA_MODEL  # its two layer kinds, in fp32
    shape = {
        "batch": a["B"], "dtype_bytes": 4, "sliding": {"num_kv_heads": m["num_kv_heads"], "head_dim": m["head_dim"]},
        "full": {"num_kv_heads": m["global_num_kv_heads"], "head_dim": m["global_head_dim"]},
    }  # fmt: skip
    kind = kind_of(job)
    per_rank = sorted(records, key=lambda r: r["rank"])
    formula = [layer_bytes(kind, job.seq_len, job.block_size, job.window, job.group_size, r["rank"], shape)
               for r in per_rank]  # fmt: skip
    totals = [sum(r["sent"].values()) for r in per_rank]
    busiest = max(range(len(per_rank)), key=totals.__getitem__)
    return {
        "formula_kind": kind, "mode": job.mode, "schedule": job.schedule, "cp": job.cp, "bp": job.bp,
        "window": job.window, "window_aware": job.window_aware,
        "sent_bytes_per_rank": [r["sent"] for r in per_rank],
        "formula_bytes_per_rank": formula,
        "every_rank_equals_formula": all(r["sent"] == f for r, f in zip(per_rank, formula, strict=True)),
        "busiest_rank_total_bytes": totals[busiest],
        "busiest_rank_formula_bytes": sum(formula[busiest].values()),
        "all_to_all_calls_per_rank": per_rank[0]["calls"],
        "widest_attention": a | {"S": max(r["attention"]["S"] for r in per_rank)},
        "step_s_max": round(max(r["step_s"] for r in per_rank), 3),
    }  # fmt: skip


def summarize_group(rows: dict[str, dict], size: int) -> dict[str, object]:
    """Window-aware CSBP against full-attention CSBP and position-sharded CP (busiest rank, per step)."""
    total = {name: row["busiest_rank_total_bytes"] for name, row in rows.items()}
    window, full, cp = (total[f"dgemma_{k}"] for k in (f"csbp_cp{size}_bp{size}_window",
                                                       f"csbp_cp{size}_bp{size}_full", f"cp{size}"))  # fmt: skip
    return {"modes": rows, "window_over_full_csbp": round(window / full, 4), "window_over_cp": round(window / cp, 4)}
