"""bench/parallel_memory.py: the analytic per-rank estimates (parameters, gradients, optimizer state,
activations, bytes sent per axis) agree within 10% with one measured training step, for one process
(activation checkpointing none, selective, full) and two 2-process layouts (FSDP2, TP2 with sequence
parallelism); one gloo spawn per world size. The parameter table the estimates start from names every
parameter of the model with its shape, so a model change shows up here first."""

from __future__ import annotations

import pytest
import torch
from bench.parallel_memory import TOLERANCE, Case, model_config, param_specs, run

from dllm.models import Transformer


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_table_is_the_model(moe: bool):
    cfg = model_config(Case(1, moe=moe))
    with torch.device("meta"):
        model = Transformer(cfg)
    assert {s.name: s.shape for s in param_specs(cfg)} == {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.distributed
def test_estimates_match_a_measured_step():
    result = run(["1proc", "1proc-selective", "1proc-full", "dp2", "tp2-sp"])
    for name, row in result["topologies"].items():
        for quantity, entry in [*row["memory"].items(), *row["sent_bytes"].items()]:
            ratio = entry.get("worst_ratio", entry["ratio"])
            assert abs(ratio - 1) <= TOLERANCE, (name, quantity, entry)
        assert "other" not in row["sent_bytes"], (name, row["sent_bytes"])  # every collective has an axis
    top = result["topologies"]
    assert set(top["1proc"]["sent_bytes"]) == set()
    assert set(top["dp2"]["sent_bytes"]) == {"fsdp"} and set(top["tp2-sp"]["sent_bytes"]) == {"tp"}
    # FSDP2 halves the parameters; the TP2 layout shards all but the norms
    one = top["1proc"]["memory"]["param"]["measured"]
    assert top["dp2"]["memory"]["param"]["measured"] == one // 2
    assert one // 2 < top["tp2-sp"]["memory"]["param"]["measured"] < one * 0.51
    ratios = result["summary"]["activation_vs_none"]["1proc"]
    assert ratios["full"]["measured"] < ratios["selective"]["measured"] < 1
    assert result["summary"]["all_within_10pct"]
