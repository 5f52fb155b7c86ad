"""Shard plans of context / block / context-sharded block parallelism, in one process.

Every global row is held exactly once per group (clean rows once per CP group), every key a query
row may see is in its rank's key set, the dual_end schedule balances the allowed query-key pairs,
every target is owned by exactly one rank (shifted objectives too), the index-mapped mask equals the
global one, the sharded attention of each rank equals the global attention at its rows (dense SDPA and
the FlexAttention forward), and layouts that cannot be split evenly are refused. DiffusionGemma's
prefix_canvas layout: its rows and targets, and the routes of its exchange (every key the mask allows,
whatever each batch row's canvas origin, for full and sliding-window layers).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.backends.flex import FlexBackend
from dllm.attention.backends.sharded import sharded_attention
from dllm.attention.masks import AttentionMask, block_diffusion, dense_mask, index_mapped, mask_mod
from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.context import ShardPlan, allowed_pairs, build_plan, cp_group_ranks
from dllm.parallel.context_attention import ContextParallelAttention, apply_context_parallel
from dllm.parallel.context_routes import exchange_routes, needed_rows

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)

# (mode, L, block, cp, bp, schedule, layout)
LAYOUTS = [
    ("cp", 32, None, 2, 1, "dual_end", "sequence"),
    ("cp", 32, None, 4, 1, "contiguous", "sequence"),
    ("cp", 32, 4, 2, 1, "dual_end", "block_diffusion"),
    ("cp", 32, 4, 4, 1, "contiguous", "block_diffusion"),
    ("bp", 32, 4, 1, 2, "dual_end", "block_diffusion"),
    ("bp", 32, 4, 1, 4, "dual_end", "block_diffusion"),
    ("bp", 32, 4, 1, 4, "contiguous", "block_diffusion"),
    ("csbp", 32, 4, 2, 2, "dual_end", "block_diffusion"),
    ("csbp", 32, 4, 2, 4, "dual_end", "block_diffusion"),
    ("csbp", 32, 4, 4, 4, "contiguous", "block_diffusion"),
]


def _plans(mode, L, block, cp, bp, schedule, layout) -> list[ShardPlan]:
    size = cp if mode == "cp" else bp
    return [build_plan(mode, L, block, cp, bp, r, schedule, layout) for r in range(size)]


def _sorted(t: torch.Tensor) -> list[int]:
    return sorted(t.tolist())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_every_row_is_held_once_per_group(layout):
    plans = _plans(*layout)
    mode, L = layout[0], layout[1]
    N = plans[0].num_rows
    for p in plans:
        assert torch.equal(p.rows, p.rows.sort().values) and p.rows.unique().numel() == p.rows.numel()
    # equal shared shards: all_gather_single moves equal shares
    assert len({int(p.shared.sum()) for p in plans}) == 1
    if mode == "cp":
        assert _sorted(torch.cat([p.rows for p in plans])) == list(range(N))
        assert all(bool(p.shared.all()) for p in plans)
        return
    noisy = torch.cat([p.rows[p.rows < L] for p in plans])
    assert _sorted(noisy) == list(range(L))  # each noisy block on exactly one rank, private
    assert all(not bool(p.shared[p.rows < L].any()) for p in plans)
    if mode == "bp":
        assert all(p.rows[p.rows >= L].tolist() == list(range(L, 2 * L)) for p in plans)
        assert not any(bool(p.shared.any()) for p in plans)
        return
    for group in cp_group_ranks(plans[0]):  # csbp: each CP group covers x_0 once, shared
        assert _sorted(torch.cat([plans[r].shared_rows for r in group])) == list(range(L, 2 * L))
    assert all(bool(p.shared[p.rows >= L].all()) for p in plans)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_every_key_a_query_may_see_is_held(layout):
    plans = _plans(*layout)
    p0 = plans[0]
    N = p0.num_rows
    kind = "block_diffusion" if p0.layout == "block_diffusion" else "bidirectional"
    mask = AttentionMask(kind, block_size=p0.block_size if kind == "block_diffusion" else None)
    allowed = dense_mask(mask_mod(mask, N), 1, N, N, torch.device("cpu"))[0, 0]
    for p in plans:
        keys = p.key_rows()
        assert keys.unique().numel() == keys.numel()
        needed = allowed[p.rows].any(0).nonzero().squeeze(1)
        assert set(needed.tolist()) <= set(keys.tolist())


def _balance(plans: list[ShardPlan]) -> float:
    p0 = plans[0]
    mod = block_diffusion(p0.seq_len, p0.block_size)
    work = torch.tensor([allowed_pairs(p, mod) for p in plans], dtype=torch.float64)
    return float(work.max() / work.mean())


@pytest.mark.parametrize(("mode", "cp", "bp"), [("bp", 1, 4), ("csbp", 2, 4)])
def test_dual_end_balances_the_block_causal_work(mode: str, cp: int, bp: int):
    """8 noisy blocks per rank: dual_end (block b with nb-1-b) within 5% of the mean, contiguous not."""
    L = 8 * bp * 4
    dual = _balance(_plans(mode, L, 4, cp, bp, "dual_end", "block_diffusion"))
    contiguous = _balance(_plans(mode, L, 4, cp, bp, "contiguous", "block_diffusion"))
    assert dual <= 1.05 < contiguous


def test_dual_end_balances_the_position_sharded_baseline_better():
    dual = _balance(_plans("cp", 64, 4, 4, 1, "dual_end", "block_diffusion"))
    contiguous = _balance(_plans("cp", 64, 4, 4, 1, "contiguous", "block_diffusion"))
    assert dual < contiguous


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="csbp", seq_len=32, block_size=4, cp=4, bp=2), "multiple of cp"),
        (dict(mode="cp", seq_len=30, cp=4), "divisible by 8"),
        (dict(mode="cp", seq_len=30, cp=4, schedule="contiguous"), "divisible by 4"),
        (dict(mode="bp", seq_len=32, block_size=4, bp=8), "8 noisy blocks divisible by 16"),
        (dict(mode="bp", seq_len=30, block_size=4, bp=2), "multiple of block_size"),
        (dict(mode="bp", seq_len=32, block_size=4, bp=2, layout="sequence"), "block_diffusion or prefix_canvas layout"),
        (dict(mode="csbp", seq_len=36, block_size=2, cp=4, bp=4, schedule="contiguous"), "divisible by 4"),
        (dict(mode="cp", seq_len=32, cp=2, bp=2), "bp must be 1"),
        (dict(mode="bp", seq_len=32, block_size=4, cp=2, bp=2), "cp must be 1"),
        (dict(mode="cp", seq_len=32, cp=2, rank=2), "outside"),
        (dict(mode="cp", seq_len=32, cp=2, schedule="zigzag"), "unknown"),
    ],
)
def test_layouts_that_cannot_be_split_evenly_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_plan(**kwargs)


# --------------------------------------------------------------------------------------------------
# sharding the inputs


def _batch(B: int = 2, L: int = 32) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V - 3, (B, L), generator=g)
    docs = torch.tensor([[0] * 11 + [1] * 21, [0] * 19 + [1] * 13])
    return Batch(tokens, torch.ones(B, L, dtype=torch.bool), torch.arange(B), docs)


OBJECTIVES = {
    "mdlm": lambda: MDLMObjective(MDLMConfig(), IDS),
    "mdlm-shift": lambda: MDLMObjective(MDLMConfig(), IDS, shift_logits=True),
    "bd3lm": lambda: BD3LMObjective(BD3LMConfig(block_size=4), IDS),
    "bd3lm-shift": lambda: BD3LMObjective(BD3LMConfig(block_size=4, shift=True), IDS),
}


PAIRS = [(o, x) for o in OBJECTIVES for x in LAYOUTS if o.startswith("bd3lm") == (x[6] == "block_diffusion")]


@pytest.mark.parametrize(
    ("objective", "layout"), PAIRS, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x))
)
def test_every_target_is_owned_by_exactly_one_rank(objective: str, layout):
    inputs = OBJECTIVES[objective]().prepare(_batch(), NoiseKeys(0, 2))
    T = inputs.targets_BL.shape[1]
    tagged = torch.arange(1, 2 * T + 1, dtype=torch.float32).view(2, T)  # weights that name their target
    inputs = dataclasses.replace(inputs, weights_BL=tagged)
    owned = []
    for plan in _plans(*layout):
        local = plan.shard(inputs)
        assert torch.equal(local.tokens_BL, inputs.tokens_BL[:, plan.rows])
        assert torch.equal(local.positions_BL, inputs.positions_BL[:, plan.rows])  # global positions
        assert local.mask.doc_ids_BL is inputs.mask.doc_ids_BL  # the global description
        owned.append(local.weights_BL)
        if local.loss_rows is not None:  # the predicting row is held, at the right place
            global_rows = plan.rows[local.loss_rows]
            idx = (local.weights_BL - 1).long() % T
            assert torch.equal(global_rows, inputs.loss_rows.gather(1, idx))
    assert sorted(torch.cat(owned, dim=1).flatten().tolist()) == tagged.flatten().tolist()


def test_num_outputs_becomes_the_local_count_of_noisy_rows():
    inputs = OBJECTIVES["bd3lm"]().prepare(_batch(), NoiseKeys(0, 2))
    assert inputs.mask.num_outputs == 32
    plans = _plans("csbp", 32, 4, 2, 2, "dual_end", "block_diffusion")
    assert [p.shard(inputs).mask.num_outputs for p in plans] == [16, 16]
    # a rank without noisy rows computes all its outputs (its loss must still reach every gather)
    plans = _plans("cp", 32, 4, 2, 1, "contiguous", "block_diffusion")
    assert [p.shard(inputs).mask.num_outputs for p in plans] == [32, None]


def test_shard_refuses_what_it_cannot_split():
    plan = build_plan("cp", 32, cp=2)
    inputs = OBJECTIVES["mdlm"]().prepare(_batch(L=32), NoiseKeys(0, 2))
    with pytest.raises(ValueError, match="self-conditioning"):
        plan.shard(dataclasses.replace(inputs, self_cond_rows_B=torch.ones(2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="64 rows"):
        build_plan("cp", 32, cp=2, layout="block_diffusion").shard(inputs)
    shifted = OBJECTIVES["mdlm-shift"]().prepare(_batch(), NoiseKeys(0, 2))
    uneven = shifted.loss_rows.clone()
    uneven[1, 5] = 7
    with pytest.raises(ValueError, match="equal for every batch row"):
        plan.shard(dataclasses.replace(shifted, loss_rows=uneven))


def test_moe_models_and_missing_groups_are_refused():
    moe = Transformer(ModelConfig(preset="tiny", vocab_size=V, num_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="MoE"):
        apply_context_parallel(moe, build_plan("cp", 32, cp=2), None)
    dense = Transformer(ModelConfig(preset="tiny", vocab_size=V))
    with pytest.raises(ValueError, match="torch.distributed"):
        apply_context_parallel(dense, build_plan("cp", 32, cp=2), None)
    apply_context_parallel(dense, build_plan("bp", 32, 4, bp=2), None)  # bp exchanges nothing: no group needed
    assert isinstance(dense.layers[0].self_attn.attend, ContextParallelAttention)
    with pytest.raises(ValueError, match="already applied"):
        apply_context_parallel(dense, build_plan("bp", 32, 4, bp=2), None)


# --------------------------------------------------------------------------------------------------
# the attention at global indices, one process (the keys a rank would gather, taken from the whole)


def _global_mask(kind: str, L: int, window: int | None = None) -> AttentionMask:
    docs = torch.tensor([[0] * 11 + [1] * 21, [0] * 19 + [1] * 13])
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, 27:] = False
    block = 4 if kind == "block_diffusion" else None
    return AttentionMask(kind, key_valid_BL=valid, doc_ids_BL=docs, block_size=block, window=window)


@pytest.mark.parametrize("kind", ["bidirectional", "block_diffusion"])
def test_index_mapped_mask_is_the_global_submatrix(kind: str):
    mask = _global_mask(kind, 32)
    N = 64 if kind == "block_diffusion" else 32
    full = dense_mask(mask_mod(mask, N), 2, N, N, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    q_rows, kv_rows = torch.randperm(N, generator=g)[: N // 2], torch.randperm(N, generator=g)[: N - 3]
    mapped = dense_mask(index_mapped(mask_mod(mask, N), q_rows, kv_rows), 2, N // 2, N - 3, torch.device("cpu"))
    assert torch.equal(mapped, full[:, :, q_rows][:, :, :, kv_rows])


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kernel", ["dense", "flex"])
@pytest.mark.parametrize(
    "layout", [x for x in LAYOUTS if x[6] == "block_diffusion"], ids=lambda x: "-".join(map(str, x))
)
def test_each_rank_computes_the_global_attention_at_its_rows(kernel: str, window: int | None, layout):
    """The FlexAttention path (CUDA's) is checked forward only: FlexAttention has no CPU backward."""
    plans = _plans(*layout)
    N = plans[0].num_rows
    mask = _global_mask("block_diffusion", 32, window)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, N, 8, generator=g) for h in (4, 2, 2))
    full = F.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_mask(mask_mod(mask, N), 2, N, N, q.device), enable_gqa=True
    )
    for p in plans:
        keys = p.key_rows()
        with torch.no_grad():
            out = sharded_attention(
                q[:, :, p.rows], k[:, :, keys], v[:, :, keys], mask, p.rows, keys, N, ("t", p.rank), kernel,
                FlexBackend(compiled=False),
            )  # fmt: skip
        torch.testing.assert_close(out, full[:, :, p.rows], atol=1e-5, rtol=1e-5)


def test_parallel_dims_place_context_groups_on_consecutive_ranks():
    """World rank w: data-parallel index w // G, group rank w % G; the CP groups of every dp index are
    the plan's cp_group_ranks shifted to that index's ranks (built in one order on every rank)."""
    from dllm.config.training import ContextParallelConfig, TopologyConfig
    from dllm.parallel.dims import ParallelDims

    csbp = ContextParallelConfig(mode="csbp", cp_size=2, bp_size=4)
    dims = ParallelDims.from_topology(TopologyConfig(nproc_per_node=8, context=csbp), 8)
    assert (dims.dp, dims.group) == (2, 4)
    assert [(dims.dp_index(w), dims.group_rank(w)) for w in (0, 3, 4, 7)] == [(0, 0), (0, 3), (1, 0), (1, 3)]
    plan = build_plan("csbp", 32, 4, cp=2, bp=4, rank=0)
    local = cp_group_ranks(plan)
    assert (
        dims.cp_groups()
        == [[d * 4 + r for r in g] for d in range(2) for g in local]
        == [[0, 1], [2, 3], [4, 5], [6, 7]]
    )
    bp = ParallelDims.from_topology(TopologyConfig(nproc_per_node=4, context={"mode": "bp", "bp_size": 2}), 4)
    assert (bp.dp, bp.group, bp.cp_groups()) == (2, 2, [])  # nothing gathered: no CP groups
    cp = ParallelDims.from_topology(
        TopologyConfig(nproc_per_node=4, dp_size=2, context={"mode": "cp", "cp_size": 2}), 4
    )
    assert cp.cp_groups() == [[0, 1], [2, 3]]
    none = ParallelDims.from_topology(TopologyConfig(nproc_per_node=2, context={"mode": "cp"}), 2)  # cp_size 1
    assert (none.mode, none.dp, none.group) == ("none", 2, 1)


# --------------------------------------------------------------------------------------------------
# DiffusionGemma's [clean ; canvas] layout (prefix_canvas): canvas blocks play the noisy blocks' part

PREFIX_LAYOUTS = [
    ("cp", 32, 4, 2, 1, "dual_end", "prefix_canvas"),
    ("cp", 32, 4, 4, 1, "contiguous", "prefix_canvas"),
    ("bp", 32, 4, 1, 2, "dual_end", "prefix_canvas"),
    ("bp", 32, 4, 1, 4, "contiguous", "prefix_canvas"),
    ("csbp", 32, 4, 2, 2, "dual_end", "prefix_canvas"),
    ("csbp", 32, 4, 2, 4, "dual_end", "prefix_canvas"),
    ("csbp", 32, 4, 4, 4, "contiguous", "prefix_canvas"),
]


@pytest.mark.parametrize("layout", PREFIX_LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_prefix_canvas_rows_and_targets_are_held_and_owned_once(layout):
    """Canvas rows once per group, clean rows once per CP group (all of them on every bp rank), and every
    row's target owned by exactly one rank."""
    plans = _plans(*layout)
    mode, L = layout[0], layout[1]
    for p in plans:
        assert torch.equal(p.rows, p.rows.sort().values) and p.owned is not None
    owned = torch.zeros(2 * L, dtype=torch.long)
    for p in plans:
        owned.index_add_(0, p.rows[p.owned], torch.ones(int(p.owned.sum()), dtype=torch.long))
    assert owned.tolist() == [1] * (2 * L)
    if mode == "cp":
        assert _sorted(torch.cat([p.rows for p in plans])) == list(range(2 * L))
        return
    assert _sorted(torch.cat([p.rows[p.rows >= L] for p in plans])) == list(range(L, 2 * L))
    for group in cp_group_ranks(plans[0]):
        assert _sorted(torch.cat([plans[r].rows[plans[r].rows < L] for r in group])) == list(range(L))


def _canvas_mask(L: int, block: int, window: int | None, origins: list[int]) -> AttentionMask:
    valid = torch.ones(len(origins), 2 * L, dtype=torch.bool)
    valid[1, 27:L] = valid[1, L + 27 :] = False  # padding after row 1's response
    return AttentionMask("prefix_canvas", key_valid_BL=valid, block_size=block, num_clean=L, canvas_start=0,
                         canvas_origin_B=torch.tensor(origins), window=window)  # fmt: skip


@pytest.mark.parametrize("window", [None, 5, 9])
@pytest.mark.parametrize("layout", PREFIX_LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_routes_bring_every_key_the_mask_allows(layout, window: int | None):
    """For responses starting anywhere (origins on and off the block grid, none): the keys a rank holds
    after its exchange (received rows + its own) cover every key its queries may see, each once; what p
    sends q is what q receives from p; and each rank's sharded attention equals the global one at its rows."""
    plans = _plans(*layout)
    L, block, N = layout[1], layout[2], 2 * layout[1]
    mask = _canvas_mask(L, block, window, [0, 3, 6, 13, 31, 32])
    allowed = dense_mask(mask_mod(mask, N), 6, N, N, torch.device("cpu"))[:, 0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, N, 8, generator=g) for h in (4, 2, 2))
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=True)
    routes = [exchange_routes(p, window) for p in plans]
    for p, r in zip(plans, routes, strict=True):
        keys = torch.cat([r.recv_rows, p.rows])
        assert keys.unique().numel() == keys.numel()
        assert set(allowed[:, p.rows].any(1).any(0).nonzero().squeeze(1).tolist()) <= set(keys.tolist())
        assert set(keys.tolist()) == set(needed_rows(p, window).nonzero().squeeze(1).tolist())
        for peer in plans:  # p's rows sent to `peer`, in order, are what `peer` receives from p
            start = sum(r.send_counts[: peer.rank])
            sent = p.rows[r.send_idx[start : start + r.send_counts[peer.rank]]]
            theirs = routes[peer.rank]
            got = theirs.recv_rows[sum(theirs.recv_counts[: p.rank]) :][: theirs.recv_counts[p.rank]]
            assert torch.equal(sent, got)
        out = sharded_attention(q[:, :, p.rows], k[:, :, keys], v[:, :, keys], mask, p.rows, keys, N, ("t", p.rank))
        torch.testing.assert_close(out, full[:, :, p.rows], atol=1e-5, rtol=1e-5)


def test_a_sliding_window_receives_fewer_rows_than_a_full_layer():
    """csbp cp4 x bp4, contiguous: a window of 5 reaches the 7 clean rows before a rank's run of blocks and
    3 canvas rows each side; a full layer receives every other rank's clean rows too (3 x 8 + 6)."""
    plans = _plans("csbp", 32, 4, 4, 4, "contiguous", "prefix_canvas")
    received = [[sum(exchange_routes(p, w).recv_counts) for p in plans] for w in (5, None)]
    assert received == [[3, 13, 13, 10], [27, 30, 30, 27]]


def _dgemma_inputs(self_condition_prob: float = 0.0):
    from dllm.config.objectives import DiffusionGemmaSFTConfig
    from dllm.diffusion.objectives.diffusion_gemma import DiffusionGemmaSFT

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, V - 1, (2, 32), generator=g)
    sup = torch.zeros(2, 32, dtype=torch.bool)
    sup[0, 3:], sup[1, 6:] = True, True
    obj = DiffusionGemmaSFT(DiffusionGemmaSFTConfig(block_size=4, self_condition_prob=self_condition_prob), IDS)
    return obj.prepare(Batch(tokens, sup, torch.tensor([4, 7])), NoiseKeys(0, 2))


def test_prefix_canvas_shard_counts_its_clean_rows_and_keeps_self_conditioning():
    """The sharded mask says how many of a rank's rows are clean (the model embeds the rest as canvas),
    self-conditioning's draws pass through, and a mask that is not training's prefix_canvas is refused."""
    inputs = _dgemma_inputs(0.5)
    assert inputs.self_cond_rows_B is not None
    for p in _plans("csbp", 32, 4, 2, 4, "dual_end", "prefix_canvas"):
        local = p.shard(inputs)
        assert local.mask.input_clean_rows == int((p.rows < 32).sum()) == 16  # L / cp
        assert local.self_cond_rows_B is inputs.self_cond_rows_B
        assert torch.equal(local.weights_BL, inputs.weights_BL[:, p.rows] * p.owned)
    assert inputs.mask.input_clean_rows == 32  # one process: the whole clean stream
    plan = build_plan("bp", 32, 4, bp=2, layout="prefix_canvas")
    with pytest.raises(ValueError, match="canvas_start 0"):
        plan.shard(dataclasses.replace(inputs, mask=dataclasses.replace(inputs.mask, canvas_start=32)))


def test_prefix_canvas_attention_needs_the_context_group_and_the_collective():
    plan = build_plan("bp", 32, 4, bp=2, layout="prefix_canvas")
    with pytest.raises(ValueError, match="ring transport does not carry prefix_canvas"):
        ContextParallelAttention(FlexBackend(compiled=False), plan, None, transport="ring")
    with pytest.raises(ValueError, match="pass the context group"):  # bp exchanges canvas rows next to its blocks
        ContextParallelAttention(FlexBackend(compiled=False), plan, None)
    # an MoE model without a router loss shards exactly (routing is per token)
    moe = Transformer(ModelConfig(preset="tiny", vocab_size=V, num_experts=4, num_experts_per_tok=2,
                                  router_aux_loss_coef=0.0))  # fmt: skip
    apply_context_parallel(moe, build_plan("bp", 32, 4, bp=2), None)
