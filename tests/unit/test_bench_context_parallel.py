"""bench/context_parallel.py: the documented traffic formula, the 14B projection, the balance numbers,
and (one gloo spawn, ~20 s) the quick run's JSON: every mode's measured bytes equal the formula, the
ring transport's too (the collective's bytes, a score tile of one shard); the windowed configuration
(DiffusionGemma's layout: window-aware CSBP against full-attention CSBP and position-sharded CP, every
rank's bytes per layer kind equal to bench/context_parallel_windows.py's formula) and its 26B-A4B projection."""

from __future__ import annotations

import json

import pytest
from bench.context_parallel import balance, formula_sent_bytes, main, projection
from bench.context_parallel_windows import prefix_canvas_rows
from bench.context_parallel_windows import projection as projection_26b


def test_formula_halves_under_csbp_and_vanishes_under_bp():
    args = dict(layout="block_diffusion", batch=2, seq_len=1024, kv_heads=8, head_dim=128, dtype_bytes=2, cp=4)
    cp, csbp, bp = (formula_sent_bytes(mode, **args)["total"] for mode in ("cp", "csbp", "bp"))
    # 2 passes x (cp-1) x K and V x B K D bytes x 2L/cp rows
    assert cp == 2 * 3 * 2 * 2 * 8 * 128 * 2 * (2 * 1024 // 4)
    assert csbp * 2 == cp and bp == 0
    # masked diffusion CP shards L rows, not 2L: the same bytes as CSBP's clean shards
    assert formula_sent_bytes("cp", **{**args, "layout": "sequence"})["total"] == csbp


def test_projection_14b_256k_cp8():
    p = projection()
    cp, csbp = p["per_gpu_per_step"]["cp"], p["per_gpu_per_step"]["csbp"]
    # per layer per pass: 7/8 x 2L x (K + V: 2 x 8 heads x 128 x 2 bytes) = 1.75 GiB; x 48 layers
    assert cp["forward_gib"] == cp["backward_gib"] == 84.0 and cp["total_gib"] == 168.0
    assert csbp["total_gib"] == 84.0 and p["csbp_over_cp"] == p["published_csbp_over_cp"] == 0.5
    assert p["hidden_width_one_pass_gib"] == {"cp": 210.0, "csbp": 105.0}  # the published accounting


def test_windowed_formula_sends_the_window_and_the_halo():
    """cp = bp = 4 ranks of L = 256, block 8, window 32: a sliding layer sends the w + B - 2 = 38 clean rows
    before the next rank's canvas blocks and B - 1 = 7 canvas rows to each neighbour; a full layer every
    clean row to the 3 others plus that halo; position-sharded CP its 2L/4 rows to the 3 others."""
    args = (256, 8, 32, 4)
    assert [prefix_canvas_rows("csbp_window", *args, r) for r in range(4)] == [(45, 7), (52, 52), (52, 52), (7, 45)]
    assert [prefix_canvas_rows("csbp_full", *args, r) for r in range(4)] == [(199, 199), (206, 206), (206, 206),
                                                                             (199, 199)]  # fmt: skip
    assert prefix_canvas_rows("cp", *args, 0) == (384, 384)


def test_projection_diffusion_gemma_26b():
    """Per GPU per step, CP8 at L = 256K: position-sharded CP sends 7/8 x 2L rows per layer and pass, 8 KiB
    (sliding: 2 x 8 x 256 x 2 B) or 4 KiB (full: 2 x 2 x 512 x 2 B) each; CSBP half of it plus the canvas
    halo; window-aware CSBP keeps the full layers and cuts the sliding ones to 1024 + 3 x 256 - 4 rows."""
    p = projection_26b()
    gib = p["per_gpu_per_step"]
    assert gib["cp"] == {"sliding_layers_gib": 175.0, "full_layers_gib": 17.5, "total_gib": 192.5}
    assert gib["csbp_window"]["full_layers_gib"] == gib["csbp_full"]["full_layers_gib"]
    sliding = 25 * 2 * (1024 + 3 * 256 - 4) * 2 * 8 * 256 * 2 / 2**30  # an inner rank, forward + backward
    assert gib["csbp_window"]["sliding_layers_gib"] == round(sliding, 3)
    assert p["window_over_full_csbp"] < 0.1 and p["published_gib"] == {"before": 433.0, "after": 28.3}
    assert "assumed" in p["assumptions"]


def test_dual_end_balances_and_contiguous_does_not():
    b = balance(256, 4)  # 8 blocks of 8 per rank
    assert b["block_size"] == 8 and b["blocks_per_rank"] == 8
    for mode in ("cp", "bp", "csbp"):
        assert b[f"{mode}_dual_end"]["max_over_mean"] <= 1.05, b
        assert b[f"{mode}_contiguous"]["max_over_mean"] > 1.1, b
    assert b["csbp_dual_end"]["noisy_max_over_mean"] == b["bp_dual_end"]["noisy_max_over_mean"] == 1.0


@pytest.mark.distributed
def test_quick_run_measures_the_formula(capsys):
    result = main(["--quick"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(line)["targets"] == result["targets"]  # one JSON line, the one returned
    assert result["targets"]["all_pass"], result["targets"]
    modes = result["L256"]["modes"]
    ring = {"cp4_ring", "csbp_cp4_bp4_ring", "mdlm_cp4_ring"}
    assert set(modes) == {"cp4", "bp4", "csbp_cp4_bp4", "cp2", "csbp_cp2_bp4", "mdlm_cp4"} | ring
    for name, row in modes.items():
        assert row["measured_over_formula"] == 1.0, (name, row)
        assert row["sent_bytes_equal_over_ranks"], name
        # 2 layers: one all-gather per layer forward, one reduce-scatter backward; the ring: cp - 1 hops each
        calls = 0 if row["mode"] == "bp" else 2 * (row["cp"] - 1 if row["transport"] == "ring" else 1)
        assert row["collective_calls_per_rank"] == {"forward": calls, "backward": calls}, name
        ws = row["working_set"]
        assert ws["kv_bytes"] == 2 * 1 * 1 * ws["keys_held"] * 16 * 4  # B=1, K=1, D=16, fp32
    # the ring: the collective's bytes, a score tile of one shard (CP over 2L: 512 / 4 keys; CSBP: the
    # clean shard 256 / 4 and the noisy private rows 64; MDLM: 256 / 4) against every key
    assert {n: r["bytes_ratio"] for n, r in result["L256"]["ring_vs_collective"].items()} == dict.fromkeys(ring, 1.0)
    assert modes["cp4_ring"]["working_set"]["score_tile_keys"] == 128
    assert modes["csbp_cp4_bp4_ring"]["working_set"]["score_tile_keys"] == 64
    assert modes["mdlm_cp4_ring"]["working_set"]["score_tile_keys"] == 64
    assert modes["cp4"]["working_set"]["score_tile_keys"] == modes["cp4"]["working_set"]["keys_held"]
    assert modes["cp4"]["working_set"]["keys_held"] == 512  # CP gathers all 2L rows
    assert modes["csbp_cp4_bp4"]["working_set"]["keys_held"] == 256 + 64  # clean x_0 + its own noisy blocks
    assert result["L256"]["csbp_bytes_over_cp"] == {"csbp_cp4_bp4_over_cp4": 0.5, "csbp_cp2_bp4_over_cp2": 0.5}
    assert {"projection", "balance", "projection_diffusion_gemma"} <= set(result)
    windowed = result["windowed_L256"]
    names = {"dgemma_cp4", "dgemma_csbp_cp4_bp4_full", "dgemma_csbp_cp4_bp4_window"}
    assert set(windowed["modes"]) == names
    for name, row in windowed["modes"].items():  # one all_to_all per layer and pass, every rank's bytes exact
        assert row["every_rank_equals_formula"] and row["all_to_all_calls_per_rank"] == [2, 2], (name, row)
        assert row["busiest_rank_total_bytes"] == row["busiest_rank_formula_bytes"], name
    window = windowed["modes"]["dgemma_csbp_cp4_bp4_window"]["sent_bytes_per_rank"]
    full = windowed["modes"]["dgemma_csbp_cp4_bp4_full"]["sent_bytes_per_rank"]
    for w, f in zip(window, full, strict=True):  # the sliding layer sends less, the full layer the same
        assert w["sliding_forward"] < f["sliding_forward"] and w["full_forward"] == f["full_forward"]
    assert windowed["window_over_full_csbp"] < 1 and windowed["window_over_cp"] < windowed["window_over_full_csbp"]
