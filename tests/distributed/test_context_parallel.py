"""Context, block and context-sharded block parallelism on gloo processes reproduce the one-process
loss and every parameter gradient of one step (fp32, max relative difference <= 1e-5).

The cases of each world size (2 and 4) run in one spawn of gloo processes. Every rank prepares the
same global batch with the real objective (packed documents, key padding), shards it with its
ShardPlan, runs the real Transformer with ContextParallelAttention through
`training.trainer.run_model`, and backpropagates its loss sum; loss sums and parameter gradients are
then summed over the ranks (they share one data shard) and rank 0 compares them with the one-process
step of the same batch. A plan that drops the gather must fail that comparison.

Relative difference of a tensor: max |a - b| / max |b| (per tensor, so tiny gradient entries do not
turn summation-order noise into large ratios).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.checkpointing import apply_activation_checkpointing
from dllm.parallel.context import build_plan, cp_group_ranks
from dllm.parallel.context_attention import apply_context_parallel
from dllm.training.trainer import run_model
from tests.distributed.harness import run_cases

pytestmark = pytest.mark.distributed

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)
B, L, BLOCK = 2, 32, 4  # 8 blocks: dual_end BP4 gets one pair each


def _batch() -> Batch:
    """Two packed rows: documents that cross every shard boundary, an unsupervised prompt, and
    trailing padding in row 1 (its own key-padding mask, the last document's id)."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V - 3, (B, L), generator=g)
    sup = torch.ones(B, L, dtype=torch.bool)
    sup[0, :5] = False
    docs = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * 19 + [1] * 13])
    tokens[1, 27:] = IDS.pad_id
    sup[1, 27:] = False
    return Batch(tokens, sup, torch.arange(B), docs)


def _objective(name: str):
    """mdlm / bd3lm, and their shifted variants (hidden row i-1 predicts token i: Dream-style MDLM,
    BD3LM with `shift`, where a block's first token is predicted by the previous clean row)."""
    if name.startswith("mdlm"):
        return MDLMObjective(MDLMConfig(), IDS, shift_logits=name.endswith("shift"))
    return BD3LMObjective(BD3LMConfig(block_size=BLOCK, shift=name.endswith("shift")), IDS)


def _inputs(obj, dead_rows: bool = False):
    """`dead_rows`: every key of row 0's last document is padding, so its query rows have no key at all
    (SDPA gives them 0; the ring must too, without NaN in the forward or the backward)."""
    inputs = obj.prepare(_batch(), NoiseKeys(0, B))
    valid = inputs.targets_BL != IDS.pad_id  # padding keys of the L positions (both halves for bd3lm)
    if dead_rows:
        valid[0, 24:] = False
    return dataclasses.replace(inputs, mask=dataclasses.replace(inputs.mask, key_valid_BL=valid))


def _step(model, obj, inputs) -> torch.Tensor:
    loss = obj.loss(run_model(model, inputs), inputs).loss_sum
    loss.backward()
    return loss.detach()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run_case(rank: int, world: int, case: dict) -> dict:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V))
    model.init_weights(torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model)
    obj = _objective(case["objective"])
    inputs = _inputs(obj, case.get("dead_rows", False))
    layout = "block_diffusion" if case["objective"].startswith("bd3lm") else "sequence"
    plan = build_plan(case["mode"], L, BLOCK, case["cp"], case["bp"], rank, case["schedule"], layout)
    assert plan.group_size == world
    groups = [dist.new_group(ranks) for ranks in cp_group_ranks(plan)]  # every rank builds every group
    group = groups[rank // plan.cp]
    if case.get("drop_gather"):  # the broken plan: shared rows treated as private, nothing gathered
        plan = dataclasses.replace(plan, shared=torch.zeros_like(plan.shared))
    transport = case.get("transport", "collective")
    # ring cases also run the collective transport on the same inputs (a second copy of the model)
    collective = copy.deepcopy(model) if transport == "ring" else None
    apply_context_parallel(model, plan, group if plan.mode != "bp" else None, transport)
    apply_activation_checkpointing(model, case.get("ac", "none"))  # after CP, as parallel/apply.py does
    loss = _sharded_step(model, obj, plan.shard(inputs))
    if collective is not None:
        apply_context_parallel(collective, plan, group, "collective")
        collective_loss = _sharded_step(collective, obj, plan.shard(inputs))
    if rank != 0:
        return {}
    ref_loss = _step(reference, obj, inputs)
    loss_diff, (worst, grad_diff) = _rel(loss, ref_loss), _worst(model, reference)
    result = {"loss": loss_diff, "grad": grad_diff, "worst": worst, "ref_loss": float(ref_loss)}
    if collective is not None:
        worst, grad_diff = _worst(model, collective)
        result["vs_collective"] = {"loss": _rel(loss, collective_loss), "grad": grad_diff, "worst": worst}
    return result


def _sharded_step(model, obj, local) -> torch.Tensor:
    """One rank's step, then the loss sum and every parameter gradient summed over the group."""
    loss = _step(model, obj, local)
    dist.all_reduce(loss)
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
    return loss


def _worst(model, reference) -> tuple[str, float]:
    grads = {
        n: _rel(p.grad, r.grad) for (n, p), r in zip(model.named_parameters(), reference.parameters(), strict=True)
    }
    worst = max(grads, key=grads.__getitem__)
    return worst, grads[worst]


CASES = {
    "mdlm-cp2": dict(world=2, objective="mdlm", mode="cp", cp=2, bp=1, schedule="dual_end"),
    "mdlm-cp4": dict(world=4, objective="mdlm", mode="cp", cp=4, bp=1, schedule="dual_end"),
    "bd3lm-cp2-position-sharded": dict(world=2, objective="bd3lm", mode="cp", cp=2, bp=1, schedule="dual_end"),
    "bd3lm-cp2-contiguous": dict(world=2, objective="bd3lm", mode="cp", cp=2, bp=1, schedule="contiguous"),
    "bd3lm-bp2": dict(world=2, objective="bd3lm", mode="bp", cp=1, bp=2, schedule="dual_end"),
    "bd3lm-bp4": dict(world=4, objective="bd3lm", mode="bp", cp=1, bp=4, schedule="dual_end"),
    "bd3lm-csbp-cp2-bp2": dict(world=2, objective="bd3lm", mode="csbp", cp=2, bp=2, schedule="dual_end"),
    "bd3lm-csbp-cp2-bp4": dict(world=4, objective="bd3lm", mode="csbp", cp=2, bp=4, schedule="dual_end"),
    # shifted objectives: targets follow the row that predicts them (clean rows held by several ranks count once)
    "mdlm-shift-cp2": dict(world=2, objective="mdlm-shift", mode="cp", cp=2, bp=1, schedule="dual_end"),
    "bd3lm-shift-bp2": dict(world=2, objective="bd3lm-shift", mode="bp", cp=1, bp=2, schedule="dual_end"),
    "bd3lm-shift-csbp-cp2-bp4": dict(world=4, objective="bd3lm-shift", mode="csbp", cp=2, bp=4, schedule="dual_end"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_step_equals_one_process(results: dict[str, dict], name: str):
    result = results[f"collective/{name}"]
    assert result["loss"] <= 1e-5, result
    assert result["grad"] <= 1e-5, result


# the ring transport: shared K/V shards passed around the CP group, partial softmaxes merged by log-sum-exp
RING_CASES = {
    "mdlm-cp2": CASES["mdlm-cp2"],
    "mdlm-cp4": CASES["mdlm-cp4"],
    "bd3lm-cp2-position-sharded": CASES["bd3lm-cp2-position-sharded"],
    "bd3lm-csbp-cp2-bp2": CASES["bd3lm-csbp-cp2-bp2"],
    "bd3lm-csbp-cp2-bp4": CASES["bd3lm-csbp-cp2-bp4"],
    "bd3lm-csbp-cp4-bp4-contiguous": dict(world=4, objective="bd3lm", mode="csbp", cp=4, bp=4, schedule="contiguous"),
    # query rows with no key in any shard (a fully padded document): finite, equal to SDPA's 0
    "mdlm-cp2-dead-rows": dict(CASES["mdlm-cp2"], dead_rows=True),
    "bd3lm-csbp-cp2-bp2-dead-rows": dict(CASES["bd3lm-csbp-cp2-bp2"], dead_rows=True),
}


DROPPED = ["mdlm-cp2", "bd3lm-csbp-cp2-bp2"]
# activation checkpointing over CP attention: the recompute issues the K/V exchange again in the
# backward (the selective policy recomputes torch.distributed's in-place collectives; the ring's own
# checkpointed partials nest inside the block's checkpoint)
CHECKPOINTED = {
    "full/collective/mdlm-cp2": dict(CASES["mdlm-cp2"], ac="full"),
    "selective/collective/bd3lm-csbp-cp2-bp2": dict(CASES["bd3lm-csbp-cp2-bp2"], ac="selective"),
    "selective/collective/mdlm-cp4": dict(CASES["mdlm-cp4"], ac="selective"),
    "full/ring/bd3lm-csbp-cp2-bp2": dict(CASES["bd3lm-csbp-cp2-bp2"], ac="full", transport="ring"),
    "selective/ring/mdlm-cp2": dict(CASES["mdlm-cp2"], ac="selective", transport="ring"),
}
ALL_CASES = {
    **{f"collective/{n}": c for n, c in CASES.items()},
    **{f"ring/{n}": dict(c, transport="ring") for n, c in RING_CASES.items()},
    **{f"dropped/{n}": dict(CASES[n], drop_gather=True) for n in DROPPED},
    **{f"checkpointed/{n}": c for n, c in CHECKPOINTED.items()},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case's comparison, run once per world size (2 and 4 processes)."""
    folder = tmp_path_factory.mktemp("context_parallel")
    out: dict[str, dict] = {}
    for world in sorted({c["world"] for c in ALL_CASES.values()}):
        cases = {k: {f: v for f, v in c.items() if f != "world"} for k, c in ALL_CASES.items() if c["world"] == world}
        out.update(run_cases(folder, world, cases, _run_case))
    print(json.dumps(out, indent=1))
    return out


@pytest.mark.parametrize("name", list(RING_CASES))
def test_ring_step_equals_one_process_and_collective(results: dict[str, dict], name: str):
    """Loss and every parameter gradient equal the one-process step, and the collective transport's on
    the same inputs (same plan, same group)."""
    result = results[f"ring/{name}"]
    assert result["loss"] <= 1e-5, result
    assert result["grad"] <= 1e-5, result
    assert result["vs_collective"]["loss"] <= 1e-5, result
    assert result["vs_collective"]["grad"] <= 1e-5, result


@pytest.mark.parametrize("name", DROPPED)
def test_dropping_the_gather_fails_the_comparison(results: dict[str, dict], name: str):
    """The check has teeth: a rank that attends only its own rows misses keys and changes the step."""
    result = results[f"dropped/{name}"]
    assert result["loss"] > 1e-3 or result["grad"] > 1e-3, result


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_checkpointed_sharded_step_equals_one_process(results: dict[str, dict], name: str):
    """Activation checkpointing (full, selective) applied after context parallelism: the sharded step
    still equals the one-process step without checkpointing."""
    result = results[f"checkpointed/{name}"]
    assert result["loss"] <= 1e-5, result
    assert result["grad"] <= 1e-5, result
