"""Expert parallelism on gloo processes reproduces the one-process loss and every parameter gradient
of one step of a tiny qwen3_moe model (fp32, max relative difference per tensor <= 1e-5).

The cases of each world size run in one spawn: EP2 (world 2, mesh (1, 2)) and DP2 x EP2 (world 4,
mesh ("edp", "ep") = (2, 2), EP over the inner dimension). Every rank builds the model on the meta
device, applies `apply_expert_parallel`, materializes it as training/build.py does (`to_empty`, then
rank 0's full state dict broadcast by `set_model_state_dict`), checks that `get_model_state_dict`
gives the full tensors back under the same names, then runs one MDLM step on ITS OWN rows of the
global batch (ep ranks are data-parallel ranks). Per-rank loss: loss_sum / global targets +
COEF x router aux loss / W (W ranks). The one-process reference runs the same global batch as W
micro-batches (the rows of each rank; the router's load-balancing loss is a product of two means, so
data parallelism defines it per rank, as the trainer does over ranks and micro-batches) and adds up
the same losses. Dense gradients are summed over the W ranks; expert gradients over the edp replicas
(the owner's gradient already sums its ep group), then gathered over ep (`full_tensor`).

Cases: balanced routing; unbalanced routing (a biased router: in layer 0 no token goes to ep rank 1's
experts, so it receives nothing; in layer 1 expert 0 gets no token); and a negative control whose
dispatch drops the exchange (a rank runs only its own experts), which must fail the comparison.

Relative difference of a tensor: max |a - b| / max |b|.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from dllm.config.model import ModelConfig
from dllm.config.objectives import MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import MDLMObjective, TokenIds
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.moe import MoE
from dllm.parallel.expert import EPGroup, apply_expert_parallel, shard_experts
from dllm.parallel.grad_norm import clip_grad_norm
from dllm.training.trainer import run_model
from tests.distributed.harness import free_port

pytestmark = pytest.mark.distributed

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)
B, L = 4, 16  # the global batch: 2 rows per rank at world 2, 1 at world 4
EP = 2
COEF = 0.1  # router aux-loss coefficient, large enough that its gradient counts
CLIP = 0.05  # gradient-norm clip of the FSDP cases, below the step's norm (so the gradients are scaled)
CFG = ModelConfig(
    family="qwen3_moe", preset="tiny", vocab_size=V, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, attention_backend="sdpa",
)  # fmt: skip


def _batch() -> Batch:
    g = torch.Generator().manual_seed(5)
    sup = torch.ones(B, L, dtype=torch.bool)
    sup[0, :3] = False
    return Batch(torch.randint(0, V - 3, (B, L), generator=g), sup, torch.arange(B))


def _rows(batch: Batch, index: int, parts: int) -> Batch:
    rows = slice(index * B // parts, (index + 1) * B // parts)
    return Batch(batch.tokens_BL[rows], batch.loss_mask_BL[rows], batch.sample_ids_B[rows])


def _unbalance(model: Transformer) -> None:
    """Routers with a bias that keeps experts 2 and 3 (ep rank 1's) idle in layer 0 and expert 0 in layer 1."""
    for i, layer in enumerate(model.layers):
        old = layer.mlp.gate
        gate = nn.Linear(old.in_features, old.out_features, bias=True, device=old.weight.device)
        with torch.no_grad():
            gate.weight.copy_(old.weight)
            gate.bias.zero_()
            gate.bias[2:] = -30.0 if i == 0 else 0.0
            gate.bias[0] = -30.0 if i == 1 else 0.0
        layer.mlp.gate = gate


def _loss(model: nn.Module, obj: MDLMObjective, rows: Batch, num_targets: int, world: int) -> torch.Tensor:
    """One rank's loss: its loss sum over the global target count, plus its router loss / W."""
    inputs = obj.prepare(rows, NoiseKeys(0, B))
    out = run_model(model, inputs)
    return obj.loss(out, inputs).loss_sum / num_targets + COEF * out.aux["router_loss"] / world


def _local_only_forward(experts, ep: EPGroup, x_NE, experts_NK, weights_NK) -> torch.Tensor:
    """The negative control: no exchange; a rank applies only the experts it holds to its own tokens."""
    gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
    out_NE = torch.zeros_like(x_NE)
    for j in range(ep.num_local):
        token, slot = torch.where(experts_NK == ep.rank * ep.num_local + j)
        gate, up = F.linear(x_NE[token], gate_up[j]).chunk(2, dim=-1)
        y = F.linear(experts.act(gate) * up, down[j]) * weights_NK[token, slot, None]
        out_NE.index_add_(0, token, y)
    return out_NE


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _run_case(rank: int, world: int, mesh, case: dict) -> dict:
    reference = Transformer(CFG)
    reference.init_weights(torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = Transformer(CFG)
    if case.get("unbalanced"):
        _unbalance(reference)
        _unbalance(model)
    apply_expert_parallel(model, mesh["ep"])
    fsdp = case.get("fsdp", False)
    if fsdp:  # experts over the edp replicas (divide factor W), everything else over all W ranks
        shard_experts(model, mesh["edp"], world)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    model.to_empty(device="cpu")
    model.init_buffers()
    full = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    state_ok = _check_state(rank, model, reference, mesh, check_slices=not fsdp)
    if case.get("drop_exchange"):
        for layer in model.layers:
            experts = layer.mlp.experts
            experts.forward = functools.partial(_local_only_forward, experts, experts.forward.args[1])
    obj, batch = MDLMObjective(MDLMConfig(), IDS), _batch()
    num_targets = obj.normalizer(batch)
    start = time.perf_counter()
    loss = _loss(model, obj, _rows(batch, rank, world), num_targets, world)
    (loss * world if fsdp else loss).backward()  # FSDP averages over the W ranks (the trainer's scale)
    norm = clip_grad_norm(model.parameters(), CLIP) if fsdp else None  # FSDP's gradients are whole
    step_s = time.perf_counter() - start
    loss, grads = _summed(model, loss.detach(), mesh)
    if rank != 0:
        return {}
    start = time.perf_counter()
    ref_loss = sum(_loss(reference, obj, _rows(batch, r, world), num_targets, world) for r in range(world))
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP) if fsdp else None
    ref_s = time.perf_counter() - start
    diffs = {n: _rel(grads[n], p.grad) for n, p in reference.named_parameters()}
    worst = max(diffs, key=diffs.__getitem__)
    return {
        "loss": _rel(loss, ref_loss.detach()), "grad": diffs[worst], "worst": worst, "state_ok": state_ok,
        "step_s": step_s, "reference_step_s": ref_s, "routed": _routed(reference, obj, batch),
        **({"norm": _rel(norm, ref_norm), "ref_norm": float(ref_norm)} if fsdp else {}),
    }  # fmt: skip


def _check_state(rank: int, model: Transformer, reference: Transformer, mesh, check_slices: bool) -> bool:
    """Every rank: its expert slices are the reference's (without FSDP), and the full state dict
    comes back whole, under the reference's names."""
    ep = mesh["ep"]
    X = CFG.num_experts // ep.size()
    lo = ep.get_local_rank() * X
    ok = True
    for layer, ref in zip(model.layers if check_slices else [], reference.layers, strict=False):
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(layer.mlp.experts, name)
            ok &= isinstance(p, DTensor) and p.placements == (Shard(0),)
            ok &= torch.equal(p.to_local(), getattr(ref.mlp.experts, name)[lo : lo + X])
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    expected = reference.state_dict()
    ok &= list(state) == list(expected)
    ok &= all(not isinstance(v, DTensor) and torch.equal(v, expected[k]) for k, v in state.items())
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _summed(model: Transformer, loss: torch.Tensor, mesh) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and dense gradients summed over all ranks; expert gradients summed over the edp replicas
    and gathered over ep. Under FSDP2 the gradients are reduced already: gathered whole."""
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        if isinstance(model, FSDPModule):
            grads[name] = p.grad.full_tensor()
        elif isinstance(p.grad, DTensor):
            local = p.grad.to_local().clone()
            dist.all_reduce(local, group=mesh["edp"].get_group())
            grads[name] = DTensor.from_local(local, mesh["ep"], [Shard(0)], run_check=False).full_tensor()
        else:
            dist.all_reduce(p.grad)
            grads[name] = p.grad
    return loss, grads


@torch.no_grad()
def _routed(model: Transformer, obj: MDLMObjective, batch: Batch) -> list[list[int]]:
    """Assignments per expert per layer of the global batch (to show the unbalanced case's idle experts)."""
    counts: list[list[int]] = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(
            lambda m, args: counts.append(torch.bincount(args[1].flatten(), minlength=CFG.num_experts).tolist())
        )
        for layer in model.layers
        if isinstance(layer.mlp, MoE)
    ]
    run_model(model, obj.prepare(batch, NoiseKeys(0, B)))
    for h in hooks:
        h.remove()
    return counts


def _errors(mesh) -> dict:
    """User mistakes: ep_size not dividing num_experts, and EP on a dense model."""
    messages = {}
    indivisible = CFG.model_copy(update={"num_experts": 3})
    configs = {"indivisible": indivisible, "dense": ModelConfig(preset="tiny", vocab_size=V)}
    for key, cfg in configs.items():
        with torch.device("meta"):
            model = Transformer(cfg)
        try:
            apply_expert_parallel(model, mesh["ep"])
            messages[key] = None
        except ConfigError as e:
            messages[key] = str(e)
    return messages


def _worker(rank: int, world: int, cases: dict[str, dict], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // EP, EP), mesh_dim_names=("edp", "ep"))
    mesh["edp", "ep"]._flatten("dp")  # the dense parameters' FSDP mesh: all W ranks
    results = {}
    for key, case in cases.items():
        torch.manual_seed(0)
        results[key] = _errors(mesh) if case.get("errors") else _run_case(rank, world, mesh, case)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.barrier()  # leave without tearing gloo down from Python (see training/run.py `_keep_until_exit`)
    os._exit(0)


CASES = {
    "ep2": dict(world=2),
    "ep2-unbalanced": dict(world=2, unbalanced=True),
    "dp2xep2": dict(world=4),
    "dp2xep2-unbalanced": dict(world=4, unbalanced=True),
    # composed with FSDP2 (shard_experts over edp, the rest over all W ranks): gradients reduced by FSDP
    "ep2-fsdp": dict(world=2, fsdp=True),
    "dp2xep2-fsdp": dict(world=4, fsdp=True),
    "dp2xep2-fsdp-unbalanced": dict(world=4, fsdp=True, unbalanced=True),
}
DROPPED = ["ep2", "dp2xep2"]
ALL_CASES = {
    **CASES,
    **{f"dropped/{n}": dict(CASES[n], drop_exchange=True) for n in DROPPED},
    "errors": dict(world=2, errors=True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case, run once per world size (2 and 4 gloo processes)."""
    folder = tmp_path_factory.mktemp("expert_parallel")
    out: dict[str, dict] = {}
    for world in sorted({c["world"] for c in ALL_CASES.values()}):
        cases = {k: c for k, c in ALL_CASES.items() if c["world"] == world}
        path = folder / f"results-{world}.json"
        mp.spawn(_worker, args=(world, cases, free_port(), str(path)), nprocs=world, join=True)
        out.update(json.loads(path.read_text()))
    print(json.dumps(out, indent=1))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_step_equals_one_process(results: dict[str, dict], name: str):
    """Loss and every parameter gradient equal the one-process step; the EP model was built on meta
    and loaded from a full state dict, and gives the same full state dict back."""
    result = results[name]
    assert result["state_ok"], result
    assert result["loss"] <= 1e-5, result
    assert result["grad"] <= 1e-5, result
    if "norm" in result:  # FSDP cases: the gradients were clipped to CLIP (below their norm) first
        assert result["norm"] <= 1e-5 and result["ref_norm"] > CLIP, result


def test_unbalanced_routing_leaves_experts_idle(results: dict[str, dict]):
    """The unbalanced case really has idle experts: none of layer 0's tokens reach ep rank 1, and
    expert 0 gets none in layer 1."""
    for name in ("ep2-unbalanced", "dp2xep2-unbalanced"):
        layer0, layer1 = results[name]["routed"]
        assert layer0[2] == layer0[3] == 0 and layer1[0] == 0, results[name]["routed"]


@pytest.mark.parametrize("name", DROPPED)
def test_dropping_the_exchange_fails_the_comparison(results: dict[str, dict], name: str):
    """The check has teeth: without the exchange, tokens routed to another rank's experts are lost."""
    result = results[f"dropped/{name}"]
    assert result["state_ok"], result
    assert result["loss"] > 1e-3 or result["grad"] > 1e-3, result


def test_user_mistakes_are_config_errors(results: dict[str, dict]):
    messages = results["errors"]
    assert "does not divide model.num_experts 3" in messages["indivisible"]
    assert "needs a mixture-of-experts model" in messages["dense"]
