"""Expert parallelism applies to the hybrid MoE (qwen3_5_moe: Gated DeltaNet and attention layers, routed experts
and a gated shared expert) as to the other MoE families: `apply_expert_parallel` shards every `Experts` module,
whatever mixes the tokens before it. On 2 gloo processes (EP2, mesh (1, 2)) one AR step reproduces the
one-process loss and every parameter gradient (fp32, max relative difference per tensor <= 1e-5), as
tests/distributed/test_expert_parallel.py checks for qwen3_moe (whose helpers sum the gradients here).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from dllm.config.model import ModelConfig
from dllm.config.objectives import ARConfig
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import TokenIds
from dllm.diffusion.objectives.ar import ARObjective
from dllm.models import Transformer
from dllm.parallel.expert import apply_expert_parallel
from dllm.training.trainer import run_model
from tests.distributed.harness import run_cases
from tests.distributed.test_expert_parallel import _batch, _rel, _rows, _summed

pytestmark = pytest.mark.distributed

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)
B = 4  # _batch's rows: 2 per rank
COEF = 0.1  # router aux-loss coefficient, large enough that its gradient counts
CFG = ModelConfig(
    family="qwen3_5_moe", preset="tiny", vocab_size=V, num_layers=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, attention_backend="sdpa",
)  # fmt: skip


def _loss(model, obj: ARObjective, rows, num_targets: int, world: int) -> torch.Tensor:
    inputs = obj.prepare(rows, NoiseKeys(0, B))
    out = run_model(model, inputs)
    return obj.loss(out, inputs).loss_sum / num_targets + COEF * out.aux["router_loss"] / world


def _run_case(rank: int, world: int, case: dict) -> dict:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
    reference = Transformer(CFG)
    reference.init_weights(torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = Transformer(CFG)
    apply_expert_parallel(model, mesh["ep"])
    model.to_empty(device="cpu")
    model.init_buffers()
    full = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    obj, batch = ARObjective(ARConfig(), IDS, chunked_loss=False), _batch()
    num_targets = obj.normalizer(batch)
    loss = _loss(model, obj, _rows(batch, rank, world), num_targets, world)
    loss.backward()
    loss, grads = _summed(model, loss.detach(), mesh)
    if rank != 0:
        return {}
    ref_loss = sum(_loss(reference, obj, _rows(batch, r, world), num_targets, world) for r in range(world))
    ref_loss.backward()
    diffs = {n: _rel(grads[n], p.grad) for n, p in reference.named_parameters()}
    worst = max(diffs, key=diffs.__getitem__)
    return {"loss": _rel(loss, ref_loss.detach()), "grad": diffs[worst], "worst": worst}


def test_ep2_step_of_the_hybrid_moe_equals_one_process(tmp_path):
    result = run_cases(tmp_path, 2, {"ep2": {}}, _run_case)["ep2"]
    print("qwen3_5_moe EP2 vs one process:", result)
    assert result["loss"] <= 1e-5 and result["grad"] <= 1e-5, result
