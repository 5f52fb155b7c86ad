"""dflash_distillation under data parallelism: two gloo processes, each holding half the sequences of a
global batch and the same frozen target, reproduce the one-process step (loss and every drafter
gradient, 1e-5), and each rank draws its share of the anchors.

The ranks run what `training.trainer.train_step` runs: the objective's `prepare` on the rank's rows (the
target computes the features on the fly), the drafter wrapped in DDP through `run_model`, the loss sum
scaled by world / global targets (DDP averages the gradients over the ranks).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.training.trainer import run_model
from tests.distributed.harness import run_cases
from tests.unit.test_dflash import make_drafter, make_objective, make_target

pytestmark = pytest.mark.distributed

B, L, ANCHORS = 4, 24, 5


def _batch() -> Batch:
    """Four rows; each has more valid anchor positions than ANCHORS (so every row draws ANCHORS of them)."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(2, 60, (B, L), generator=g)
    sup = torch.ones(B, L, dtype=torch.bool)
    sup[0, :8] = False  # a prompt
    sup[3, 18:] = False  # a short answer
    return Batch(tokens, sup, torch.arange(B))


def _step(drafter, objective, batch: Batch, scale_world: int, global_targets: float) -> tuple[torch.Tensor, object]:
    inputs = objective.prepare(batch, NoiseKeys(0, B))
    loss_sum = objective.loss(run_model(drafter, inputs), inputs).loss_sum
    (loss_sum * scale_world / global_targets).backward()
    return loss_sum.detach(), inputs


def _one_process(loss_name: str) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    target = make_target()
    drafter = make_drafter(target, num_layers=2)
    objective = make_objective(target, num_anchors=ANCHORS, loss=loss_name)
    batch = _batch()
    loss_sum, inputs = _step(drafter, objective, batch, 1, float(objective.normalizer(batch)))
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    return float(loss_sum) / objective.normalizer(batch), grads, inputs.tokens_BL.context_len_BA


def _run_case(rank: int, world: int, case: dict) -> dict:
    target = make_target()  # every rank holds the same frozen target (same seed)
    drafter = DistributedDataParallel(make_drafter(target, num_layers=2))
    objective = make_objective(target, num_anchors=ANCHORS, loss=case["loss"])
    whole = _batch()
    rows = slice(rank * B // world, (rank + 1) * B // world)
    mine = Batch(whole.tokens_BL[rows], whole.loss_mask_BL[rows], whole.sample_ids_B[rows])
    local = torch.tensor([float(objective.normalizer(mine))], dtype=torch.float64)
    counts = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(counts, local)
    global_targets = float(sum(counts))
    loss_sum, inputs = _step(drafter, objective, mine, world, global_targets)
    dist.all_reduce(loss_sum)
    anchors = [torch.zeros(B // world, ANCHORS, dtype=torch.long) for _ in range(world)]
    dist.all_gather(anchors, inputs.tokens_BL.context_len_BA.contiguous())
    if rank != 0:
        return {}
    grads = {n: p.grad.tolist() for n, p in drafter.module.named_parameters()}
    return {
        "loss": float(loss_sum) / global_targets,
        "grads": grads,
        "targets_per_rank": [float(c) for c in counts],
        "anchors": torch.cat(anchors).tolist(),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return run_cases(tmp_path_factory.mktemp("dflash_dp"), 2, {"ce": {"loss": "ce"}, "kl": {"loss": "kl"}}, _run_case)


@pytest.mark.parametrize("loss_name", ["ce", "kl"])
def test_two_ranks_equal_one_process(results: dict[str, dict], loss_name: str):
    """Loss and every drafter gradient of the 2-rank step equal the 1-process step on the whole batch."""
    got = results[loss_name]
    loss, grads, anchors = _one_process(loss_name)
    assert got["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert set(got["grads"]) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(got["grads"][name]), g, atol=1e-5, rtol=1e-5, msg=name)
    assert any(bool(g.abs().sum() > 0) for g in grads.values())  # a step that moves the drafter
    # the ranks drew exactly the whole batch's anchors (keyed by sample id), not a rank-local draw
    assert torch.equal(torch.tensor(got["anchors"]), anchors)


def test_each_rank_carries_its_share_of_anchors(results: dict[str, dict]):
    """Every row draws the same number of anchors (ANCHORS, when it has as many valid positions), so ranks
    reading equally many rows carry equally many supervised draft targets."""
    per_rank = results["ce"]["targets_per_rank"]
    block = make_objective(make_target()).cfg.block_size
    print(json.dumps(per_rank))
    assert per_rank == [float(B // 2 * ANCHORS * (block - 1))] * 2
