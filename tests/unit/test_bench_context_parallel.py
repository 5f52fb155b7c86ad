"""bench/context_parallel.py: the documented traffic formula, the 14B projection, the balance numbers,
and (one gloo spawn, ~20 s) the quick run's JSON: every mode's measured bytes equal the formula, the
ring transport's too (the collective's bytes, a score tile of one shard)."""

from __future__ import annotations

import json

import pytest
from bench.context_parallel import balance, formula_sent_bytes, main, projection


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
    assert {"projection", "balance"} <= set(result)
