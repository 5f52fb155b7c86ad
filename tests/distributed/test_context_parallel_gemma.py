"""DiffusionGemma's native SFT under context (CP), block (BP) and context-sharded block parallelism (CSBP)
and under expert parallelism (EP) on gloo processes reproduces the one-process loss and every parameter
gradient of one step (fp32, max relative difference per tensor <= 1e-5).

The model is a tiny random DiffusionGemma with one sliding-window layer (window 5, smaller than the 32
clean rows: the window matters) and one full layer of its own head shape (Gemma 4's global layers);
the batch has responses that start at rows 3 and 6, so canvas blocks straddle the ranks' canvas rows.
Every rank prepares the same batch with the real objective, shards it with its prefix_canvas ShardPlan
and runs the model through ContextParallelAttention, whose sliding layer receives only the clean rows
its window reaches (the routed exchange, one all_to_all per layer). Loss sums and gradients are summed
over the ranks and compared on rank 0 with the one-process step. Also: self-conditioning's two passes,
the MoE variant (routers frozen, as the build does), the exchange with every layer treated as full,
activation checkpointing (full, selective) over the exchange, a negative control whose sliding layer
receives too few rows, EP2, and the exchange's bytes against the formula of
bench/context_parallel_windows.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from bench.context_parallel_windows import prefix_canvas_rows

from dllm.config.model import ModelConfig
from dllm.config.objectives import DiffusionGemmaSFTConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import TokenIds
from dllm.diffusion.objectives.diffusion_gemma import DiffusionGemmaSFT
from dllm.models import Transformer
from dllm.models.gemma import freeze_routers
from dllm.parallel import context_attention
from dllm.parallel.checkpointing import apply_activation_checkpointing
from dllm.parallel.context import build_plan
from dllm.parallel.context_attention import apply_context_parallel
from dllm.parallel.context_routes import exchange_routes
from dllm.training.trainer import run_model
from tests.distributed.harness import run_cases

pytestmark = pytest.mark.distributed

V, B, L, BLOCK, W = 48, 2, 32, 4, 5
IDS = TokenIds(mask_id=V - 1, eos_id=1, pad_id=0, num_tokens=V)


def _config(moe: bool) -> ModelConfig:
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.0)
    return ModelConfig(
        family="diffusion_gemma", preset="tiny", vocab_size=V, attention_pattern=["local", "global"],
        local_window=W, global_head_dim=32, global_num_kv_heads=1, canvas_length=BLOCK, attention_backend="sdpa",
        **(experts if moe else {}),
    )  # fmt: skip


def _model(moe: bool) -> Transformer:
    model = Transformer(_config(moe))
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():  # norms and scales start at 1: move every parameter so that each one matters
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    freeze_routers(model)  # what the build does for this objective
    return model


def _batch() -> Batch:
    """Row 0: prompt of 3, response to the end; row 1: prompt of 6, response of 20, then padding."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, V - 1, (B, L), generator=g)
    sup = torch.zeros(B, L, dtype=torch.bool)
    sup[0, 3:] = True
    sup[1, 6:26] = True
    tokens[1, 26:] = IDS.pad_id
    return Batch(tokens, sup, torch.tensor([4, 7]))


def _objective(self_condition_prob: float) -> DiffusionGemmaSFT:
    cfg = DiffusionGemmaSFTConfig(block_size=BLOCK, encoder_loss_weight=0.3, self_condition_prob=self_condition_prob)
    return DiffusionGemmaSFT(cfg, IDS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _step(model, obj, inputs) -> torch.Tensor:
    loss = obj.loss(run_model(model, inputs), inputs).loss_sum
    loss.backward()
    return loss.detach()


def _grads(model) -> dict[str, torch.Tensor]:
    """Trainable parameters' gradients; zeros for those the step did not reach (the self-conditioning block
    without self-conditioning), so that every rank reduces the same tensors."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _compare(loss, grads, ref_loss, ref_grads) -> dict:
    diffs = {n: _rel(g, ref_grads[n]) for n, g in grads.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return {"loss": _rel(loss, ref_loss), "grad": diffs[worst], "worst": worst, "ref_loss": float(ref_loss)}


class _Bytes:
    """Wraps context_attention's all_to_all: bytes sent per call, in call order."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.inner = context_attention._ALL_TO_ALL

    def __call__(self, out, inp, *args, **kw):
        self.calls.append(inp.numel() * inp.element_size())
        return self.inner(out, inp, *args, **kw)


def _run_case(rank: int, world: int, case: dict) -> dict:
    if case.get("ep"):
        return _run_ep(rank, world)
    torch.manual_seed(0)
    model = _model(case.get("moe", False))
    reference = copy.deepcopy(model)
    obj = _objective(case.get("self_cond", 0.0))
    inputs = obj.prepare(_batch(), NoiseKeys(0, B))
    plan = build_plan(case["mode"], L, BLOCK, case["cp"], case["bp"], rank, case["schedule"], "prefix_canvas")
    assert plan.group_size == world
    apply_context_parallel(model, plan, None, window_aware=case.get("window_aware", True))  # context group = world
    apply_activation_checkpointing(model, case.get("ac", "none"))  # after CP, as parallel/apply.py does
    if case.get("short_window"):  # the negative control: the sliding layer receives what a window of 1 reaches
        model.layers[0].self_attn.attend.routes[W] = exchange_routes(plan, 1)
    counter = _Bytes()
    context_attention._ALL_TO_ALL = counter
    try:
        local = plan.shard(inputs)
        loss = _step(model, obj, local)
    finally:
        context_attention._ALL_TO_ALL = counter.inner
    dist.all_reduce(loss)
    for g in _grads(model).values():
        dist.all_reduce(g)
    sent = torch.tensor([counter.calls], dtype=torch.long)
    every = [torch.zeros_like(sent) for _ in range(world)]
    dist.all_gather(every, sent)
    if rank != 0:
        return {}
    self_cond = inputs.self_cond_rows_B
    result = _compare(loss, _grads(model), _step(reference, obj, inputs), _grads(reference))
    routes = [[exchange_routes(plan.peer(r), w) for w in (W, None)] for r in range(world)]
    return {
        **result,
        "sent_bytes": [t[0].tolist() for t in every],  # per rank: fwd local, fwd global, bwd global, bwd local
        "routes_rows": [[[sum(r.send_counts), sum(r.recv_counts)] for r in kinds] for kinds in routes],
        "self_conditioned": None if self_cond is None else self_cond.tolist(),
    }


def _run_ep(rank: int, world: int) -> dict:
    """EP2: the MoE model's experts split over the 2 ranks (built on meta, loaded from rank 0's full state);
    each rank trains on its own batch row (ep ranks are data-parallel ranks); dense gradients summed, the
    experts' (owned by one rank, already summed over the ep group) gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from dllm.parallel.expert import apply_expert_parallel

    reference = _model(moe=True)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    with torch.device("meta"):
        model = Transformer(_config(moe=True))
    apply_expert_parallel(model, mesh)
    model.to_empty(device="cpu")
    model.init_buffers()
    full = reference.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    freeze_routers(model)
    obj, batch = _objective(0.5), _batch()

    def rows(r: int) -> Batch:
        return Batch(batch.tokens_BL[r : r + 1], batch.loss_mask_BL[r : r + 1], batch.sample_ids_B[r : r + 1])

    loss = _step(model, obj, obj.prepare(rows(rank), NoiseKeys(0, B)))
    dist.all_reduce(loss)
    grads = {}
    for name, g in _grads(model).items():
        if isinstance(g, DTensor):
            grads[name] = g.full_tensor()
        else:
            dist.all_reduce(g)
            grads[name] = g
    if rank != 0:
        return {}
    ref_loss = sum(_step(reference, obj, obj.prepare(rows(r), NoiseKeys(0, B))) for r in range(world))
    sharded = sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor))
    return {**_compare(loss, grads, ref_loss, _grads(reference)), "sharded": sharded}


CASES = {
    "cp2": dict(world=2, mode="cp", cp=2, bp=1, schedule="dual_end"),
    "bp2": dict(world=2, mode="bp", cp=1, bp=2, schedule="dual_end"),
    "csbp-cp2-bp2": dict(world=2, mode="csbp", cp=2, bp=2, schedule="dual_end"),
    "csbp-cp2-bp2-contiguous": dict(world=2, mode="csbp", cp=2, bp=2, schedule="contiguous"),
    # self-conditioning: a detached first pass, then the second on its canvas logits (drawn per example)
    "csbp-cp2-bp2-self-cond": dict(world=2, mode="csbp", cp=2, bp=2, schedule="dual_end", self_cond=0.5),
    "cp2-moe": dict(world=2, mode="cp", cp=2, bp=1, schedule="dual_end", moe=True),
    "bp2-moe-self-cond": dict(world=2, mode="bp", cp=1, bp=2, schedule="dual_end", moe=True, self_cond=0.5),
    "csbp-cp2-bp2-all-full": dict(world=2, mode="csbp", cp=2, bp=2, schedule="dual_end", window_aware=False),
    # 4 ranks: two CP groups (clean rows from the own CP group, canvas rows from any rank), and cp = bp = 4
    "csbp-cp2-bp4": dict(world=4, mode="csbp", cp=2, bp=4, schedule="dual_end"),
    "csbp-cp4-bp4-contiguous": dict(world=4, mode="csbp", cp=4, bp=4, schedule="contiguous"),
    "bp4-contiguous": dict(world=4, mode="bp", cp=1, bp=4, schedule="contiguous"),
    # activation checkpointing over the routed exchange: the recompute issues the all_to_all again
    "csbp-cp2-bp2-checkpointed-full": dict(world=2, mode="csbp", cp=2, bp=2, schedule="dual_end", ac="full"),
    "cp2-checkpointed-selective": dict(world=2, mode="cp", cp=2, bp=1, schedule="dual_end", ac="selective"),
}
ALL_CASES = {
    **CASES,
    "short-window/csbp-cp2-bp2": dict(CASES["csbp-cp2-bp2"], short_window=True),
    "ep2": dict(world=2, ep=True),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case, run once per world size (2 and 4 gloo processes)."""
    folder = tmp_path_factory.mktemp("context_parallel_gemma")
    out: dict[str, dict] = {}
    for world in sorted({c["world"] for c in ALL_CASES.values()}):
        cases = {k: {f: v for f, v in c.items() if f != "world"} for k, c in ALL_CASES.items() if c["world"] == world}
        out.update(run_cases(folder, world, cases, _run_case))
    print(json.dumps(out, indent=1))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_step_equals_one_process(results: dict[str, dict], name: str):
    result = results[name]
    assert result["loss"] <= 1e-5, result
    assert result["grad"] <= 1e-5, result
    if CASES[name].get("self_cond"):  # the seed conditions one example of two
        assert sorted(result["self_conditioned"]) == [False, True], result


def test_a_window_that_reaches_too_few_rows_fails_the_comparison(results: dict[str, dict]):
    """The check has teeth: the sliding layer's routes matter (a window of 1 misses clean keys)."""
    result = results["short-window/csbp-cp2-bp2"]
    assert result["loss"] > 1e-3 or result["grad"] > 1e-3, result


def test_expert_parallel_step_equals_one_process(results: dict[str, dict]):
    """EP2 of the MoE DiffusionGemma (experts beside the dense MLP, Gemma's frozen router)."""
    result = results["ep2"]
    assert result["loss"] <= 1e-5 and result["grad"] <= 1e-5, result
    assert result["sharded"] and all(".beside.experts." in n for n in result["sharded"]), result


@pytest.mark.parametrize("name", ["csbp-cp2-bp2-contiguous", "csbp-cp4-bp4-contiguous"])
def test_window_aware_exchange_sends_the_formula_bytes(results: dict[str, dict], name: str):
    """Bytes each rank hands to all_to_all per layer and pass (forward: the rows it sends; backward: the
    gradients of the rows it received) equal the routes' row counts and bench/context_parallel.py's
    closed form, and the sliding layer sends fewer than the full layer and than a full exchange."""
    case, result = CASES[name], results[name]
    n = case["bp"]
    row_bytes = {W: 2 * B * 2 * 16 * 4, None: 2 * B * 1 * 32 * 4}  # K, V x batch x K heads x D x fp32
    for rank, (fwd_local, fwd_global, bwd_global, bwd_local) in enumerate(result["sent_bytes"]):
        (local_sent, local_recv), (global_sent, global_recv) = result["routes_rows"][rank]
        assert (fwd_local, bwd_local) == (local_sent * row_bytes[W], local_recv * row_bytes[W])
        assert (fwd_global, bwd_global) == (global_sent * row_bytes[None], global_recv * row_bytes[None])
        assert (local_sent, local_recv) == prefix_canvas_rows("csbp_window", L, BLOCK, W, n, rank)
        assert (global_sent, global_recv) == prefix_canvas_rows("csbp_full", L, BLOCK, W, n, rank)
        assert local_sent + local_recv < global_sent + global_recv
    full = results["csbp-cp2-bp2-all-full"]["sent_bytes"]  # every layer as full (dual_end): more
    assert sum(map(sum, results["csbp-cp2-bp2"]["sent_bytes"])) < sum(map(sum, full))
