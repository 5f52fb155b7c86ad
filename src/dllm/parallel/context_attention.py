"""The K/V exchange and the attention of one rank of a CP/BP group (context.py: which rows it holds).

1. `gather_rows`: an autograd Function, all-gather along the row dim forward, reduce-scatter (sum)
   backward, with torch.distributed collectives only (gloo and NCCL; see `_ALL_GATHER`).
2. `ring_shift`: one step around the CP group (point-to-point batch_isend_irecv); the backward shifts
   the gradient back the other way.
3. `ContextParallelAttention` replaces each layer's `self_attn.attend` (`apply_context_parallel`):
   keys = gathered shared K/V of the CP group (global rows known statically from the peers' plans)
   + local private K/V; attention at global indices via `attention.backends.sharded`.
   With `transport="ring"` the shared K/V shards travel around the CP group instead (`ring_shift`),
   one checkpointed partial attention per shard, merged by log-sum-exp: the same bytes, a score tile
   of one shard (see the class doc).
4. `exchange_rows` (the prefix_canvas layout, DiffusionGemma): the rows of the static `Routes` of a
   layer kind (context_routes.py: a sliding-window layer's queries reach only the last w clean rows
   before them) move in one all_to_all_single over the context group; the backward sends the K/V
   gradients back the reverse way and adds them into the senders' rows.

The K/V gradient a rank computes for another rank's rows travels back through the exchange's backward
to the rank that owns them, so the parameter gradients of a group's ranks add up to the one-process
gradient (context.py says how the plan splits the targets, and what is refused).
bench/context_parallel.py wraps this module's `_ALL_GATHER`, `_REDUCE_SCATTER`, `_BATCH_ISEND_IRECV`, `_ALL_TO_ALL`,
`sharded_attention` and `partial_attention` to count bytes and time.

Shapes: B batch, H query heads, K key/value heads, R rows held, Q query rows, S keys held, D head width.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dllm.attention.backends import AttentionFn
from dllm.attention.backends.flex import FlexBackend
from dllm.attention.backends.sharded import Kernel, merge_partials, partial_attention, shard_mask, sharded_attention
from dllm.parallel.context import ShardPlan
from dllm.parallel.context_routes import Routes, exchange_routes

Transport = Literal["collective", "ring"]

# torch >= 2.13 renamed the tensor collectives (the old names warn); gloo and NCCL implement both
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_BATCH_ISEND_IRECV = dist.batch_isend_irecv  # the ring's point-to-point exchange (wrapped by the bench)
_ALL_TO_ALL = dist.all_to_all_single  # the routed exchange of prefix_canvas plans (gloo and NCCL, uneven splits)


# --------------------------------------------------------------------------------------------------
# the exchange


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0 (equal shards, rank order); backward: reduce-scatter (sum) to the owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """Concatenate every group rank's `x` along `dim` (in group-rank order); the backward sums each
    rank's gradient of the gathered tensor and hands every owner the gradient of its own rows."""
    return _GatherRows.apply(x.movedim(dim, 0), group).movedim(0, dim)


class _RingShift(torch.autograd.Function):
    """Send to the next rank of the group, receive from the previous one; backward: the reverse shift of
    the gradient (to the previous rank, from the next), which carries it back towards the owner."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _shift(x, group, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, ctx.group, -1), None


def _shift(x: torch.Tensor, group: dist.ProcessGroup | None, step: int) -> torch.Tensor:
    """One ring step: every rank sends `x` to rank + step and receives the same shape from rank - step
    (one batch_isend_irecv, so NCCL pairs the send and the receive; with 2 ranks both go to the peer)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to, frm = (rank + step) % size, (rank - step) % size
    if group is not None:
        to, frm = dist.get_global_rank(group, to), dist.get_global_rank(group, frm)
    x = x.contiguous()
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, out, frm, group)]
    for req in _BATCH_ISEND_IRECV(ops):
        req.wait()
    return out


def ring_shift(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """`x` of the previous rank of the group (ring order); the backward hands each gradient back to the
    rank the tensor came from. Every rank of the group must call it, in the same order."""
    return _RingShift.apply(x, group)


class _ExchangeRows(torch.autograd.Function):
    """Rows `routes.send_idx` of x (dim 0) to their peers, `routes.recv_rows` back (one all_to_all_single);
    backward: the received rows' gradients go back the reverse way and are added into the sent rows'."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routes: Routes, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.routes, ctx.group, ctx.num_rows = routes, group, x.shape[0]
        send = x.index_select(0, routes.send_idx.to(x.device)).contiguous()
        out = x.new_empty((routes.recv_rows.numel(), *x.shape[1:]))
        _ALL_TO_ALL(out, send, routes.recv_counts, routes.send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        routes = ctx.routes
        back = grad.new_empty((routes.send_idx.numel(), *grad.shape[1:]))
        _ALL_TO_ALL(back, grad.contiguous(), routes.send_counts, routes.recv_counts, group=ctx.group)
        out = grad.new_zeros((ctx.num_rows, *grad.shape[1:]))
        return out.index_add_(0, routes.send_idx.to(grad.device), back), None, None


def exchange_rows(x: torch.Tensor, routes: Routes, group: dist.ProcessGroup | None, dim: int = 0) -> torch.Tensor:
    """The rows this rank receives under `routes` (along `dim`, in `routes.recv_rows` order); every rank of
    the group must call it with its own routes of the same layer kind, in the same order."""
    return _ExchangeRows.apply(x.movedim(dim, 0), routes, group).movedim(0, dim)


# --------------------------------------------------------------------------------------------------
# the attention


class ContextParallelAttention:
    """An attention backend `(q_BHQD, k_BKRD, v_BKRD, mask) -> out_BHQD` for a rank's rows: keys =
    shared K/V of the CP group + local private K/V, attention under the global mask.

    transport `collective` (default): the shared K/V are all-gathered (one collective per layer; the
    backward reduce-scatters their gradients) and one attention call covers every key (score tile
    Q x all keys on the dense path).
    transport `ring`: the shared shards travel around the CP group (cp - 1 `ring_shift`s per layer,
    batch_isend_irecv to the next rank / from the previous one); at each step the local queries attend
    to the shard held at that step (and, once, to the private rows), giving a partial output and its
    log-sum-exp, merged exactly (`merge_partials`). Each step's partial attention is checkpointed: its
    probabilities are recomputed in the backward, so the score tile is Q x one shard, forward and
    backward. The backward shifts the K/V gradients back around the ring (each hop adds the receiving
    rank's share) to their owners: (cp - 1) shards sent per rank each way, the same bytes as the
    collective. The received shards are kept for the backward (as the gathered K/V are). The dense
    plain-torch partial attention runs on every device (no FlexAttention), and no step overlaps its
    transfer with compute yet.
    prefix_canvas plans (DiffusionGemma) use neither: keys = the rows the layer kind's `Routes` bring in
    (one `exchange_rows` per layer over the whole context group) + every held row; a sliding-window layer
    (its mask has a window) gets only what its window reaches (`window_aware`; False: what a full layer
    gets, the all-gather's rows, for comparison).
    """

    def __init__(
        self,
        inner: AttentionFn,
        plan: ShardPlan,
        group: dist.ProcessGroup | None,
        kernel: Kernel | None = None,
        transport: Transport = "collective",
        window_aware: bool = True,
    ) -> None:
        if transport not in ("collective", "ring"):
            raise ValueError(f"unknown K/V transport {transport!r} (collective or ring)")
        self.inner, self.plan, self.group = inner, plan, group  # inner: the model's backend (kept to undo)
        self.kernel = kernel  # None: dense SDPA on CPU, FlexAttention elsewhere
        self.transport = transport
        self.flex = inner if isinstance(inner, FlexBackend) else FlexBackend()
        self.routed = plan.layout == "prefix_canvas"
        self.window_aware = window_aware
        self.routes: dict[int | None, Routes] = {}  # per layer kind (window), built on first use: static per plan
        if self.routed and transport == "ring":
            raise ValueError("the ring transport does not carry prefix_canvas plans (their routed exchange); "
                             "use the collective transport")  # fmt: skip
        self.gathers = bool(plan.shared.any()) and not self.routed
        if self.gathers or (self.routed and plan.group_size > 1):
            _check_group(plan, group)
        self.shared_idx = torch.nonzero(plan.shared).squeeze(1)
        self.private_idx = torch.nonzero(~plan.shared).squeeze(1)
        self.all_shared = bool(plan.shared.all())
        self.kv_rows = plan.key_rows()
        self.map_key = ("shard_plan", plan.mode, plan.layout, plan.seq_len, plan.cp, plan.bp, plan.rank, plan.schedule)
        # ring: the global rows of the shard held at step s (cp index c - s's shared rows)
        if self.gathers:
            peers = [plan.peer(r).shared_rows for r in plan.cp_group]
            self.ring_rows = [peers[(plan.cp_index - s) % plan.cp] for s in range(plan.cp)]

    def __call__(self, q_BHQD: torch.Tensor, k_BKRD: torch.Tensor, v_BKRD: torch.Tensor, mask) -> torch.Tensor:
        R, Q = self.plan.rows.numel(), q_BHQD.shape[2]
        if k_BKRD.shape[2] != R or Q > R:
            raise ValueError(f"context parallel attention: {R} rows held, got {k_BKRD.shape[2]} keys and {Q} queries")
        if self.routed:
            return self.routed_attention(q_BHQD, k_BKRD, v_BKRD, mask)
        if self.transport == "ring" and self.gathers:
            return self.ring(q_BHQD, k_BKRD, v_BKRD, mask)
        k_BKSD, v_BKSD = self.keys_values(k_BKRD, v_BKRD)
        kernel = self.kernel or ("dense" if q_BHQD.device.type == "cpu" else "flex")
        return sharded_attention(
            q_BHQD, k_BKSD, v_BKSD, mask, self.plan.rows[:Q], self.kv_rows, self.plan.num_rows,
            (*self.map_key, Q), kernel, self.flex,
        )  # fmt: skip

    def layer_routes(self, window: int | None) -> Routes:
        """The static routes of a layer kind: its window if window-aware, else a full layer's."""
        window = window if self.window_aware else None
        if window not in self.routes:
            self.routes[window] = exchange_routes(self.plan, window)
        return self.routes[window]

    def routed_attention(self, q_BHQD: torch.Tensor, k_BKRD: torch.Tensor, v_BKRD: torch.Tensor, mask):
        """prefix_canvas: keys = the layer kind's received rows + every held row, under the global mask."""
        Q, plan = q_BHQD.shape[2], self.plan
        routes = self.layer_routes(mask.window)
        kv_2BKRD = torch.stack([k_BKRD, v_BKRD])
        if plan.group_size > 1:  # one collective per layer on every rank, even with nothing to send
            kv_2BKRD = torch.cat([exchange_rows(kv_2BKRD, routes, self.group, dim=3), kv_2BKRD], dim=3)
        kv_rows = torch.cat([routes.recv_rows, plan.rows])
        kernel = self.kernel or ("dense" if q_BHQD.device.type == "cpu" else "flex")
        return sharded_attention(
            q_BHQD, kv_2BKRD[0], kv_2BKRD[1], mask, plan.rows[:Q], kv_rows, plan.num_rows,
            (*self.map_key, routes.window, Q), kernel, self.flex,
        )  # fmt: skip

    def keys_values(self, k_BKRD: torch.Tensor, v_BKRD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys in `plan.key_rows()` order: K and V travel in one collective (one reduce-scatter per layer
        in the backward, so every rank issues its collectives in the same order)."""
        if not self.gathers:
            return k_BKRD, v_BKRD
        kv_2BKRD = torch.stack([k_BKRD, v_BKRD])
        idx = self.shared_idx.to(kv_2BKRD.device)
        shared = kv_2BKRD if self.all_shared else kv_2BKRD.index_select(3, idx)
        kv = gather_rows(shared, self.group, dim=3)
        if not self.all_shared:
            kv = torch.cat([kv, kv_2BKRD.index_select(3, self.private_idx.to(kv.device))], dim=3)
        return kv[0], kv[1]

    def ring(self, q_BHQD: torch.Tensor, k_BKRD: torch.Tensor, v_BKRD: torch.Tensor, mask) -> torch.Tensor:
        """The ring transport (see the class doc): partials over the private rows and each ring step's
        shard, merged by log-sum-exp. Every rank issues the same cp - 1 shifts per layer, in order."""
        Q, device, N = q_BHQD.shape[2], q_BHQD.device, self.plan.num_rows
        q_rows = self.plan.rows[:Q].to(device)
        kv_2BKRD = torch.stack([k_BKRD, v_BKRD])
        held = kv_2BKRD if self.all_shared else kv_2BKRD.index_select(3, self.shared_idx.to(device))
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if not self.all_shared:
            private = kv_2BKRD.index_select(3, self.private_idx.to(device))
            parts.append(_checkpointed_partial(q_BHQD, private, (mask, q_rows, self.plan.private_rows, N)))
        for step in range(self.plan.cp):
            if step:
                held = ring_shift(held, self.group)
            parts.append(_checkpointed_partial(q_BHQD, held, (mask, q_rows, self.ring_rows[step], N)))
        outs, lses = zip(*parts, strict=True)
        return merge_partials(list(outs), list(lses)).to(q_BHQD.dtype)


def _partial(q_BHQD: torch.Tensor, kv_2BKSD: torch.Tensor, where: tuple):
    """(out, lse) of the queries over one shard; the step's mask tile is built here (see shard_mask)."""
    mask, q_rows, kv_rows, num_rows = where
    tile = shard_mask(mask, q_rows, kv_rows, num_rows, q_BHQD.shape[0])
    return partial_attention(q_BHQD, kv_2BKSD[0], kv_2BKSD[1], tile)


def _checkpointed_partial(q_BHQD: torch.Tensor, kv_2BKSD: torch.Tensor, where: tuple):
    """One step's (out, lse); with gradients on, its mask tile and probabilities are recomputed in the
    backward (non-reentrant checkpoint: no communication inside, so the recompute issues no P2P op)."""
    if not torch.is_grad_enabled():
        return _partial(q_BHQD, kv_2BKSD, where)
    return checkpoint(_partial, q_BHQD, kv_2BKSD, where, use_reentrant=False)


def _check_group(plan: ShardPlan, group: dist.ProcessGroup | None) -> None:
    """The exchange's group: the CP group, or for prefix_canvas plans the whole context group (their
    canvas rows next to a block may sit on a rank of another CP group)."""
    whole = plan.layout == "prefix_canvas"
    what = "context group" if whole else "CP group"
    if not dist.is_initialized():
        raise ValueError(f"mode {plan.mode} exchanges K/V: initialise torch.distributed and pass the {what}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    want_size, want_rank = (plan.group_size, plan.rank) if whole else (plan.cp, plan.cp_index)
    if size != want_size or rank != want_rank:
        how = "every rank of the context group, in order" if whole else "cp_group_ranks(plan), in order"
        raise ValueError(
            f"the {what}'s process group (size {size}, this rank {rank}) does not match the plan "
            f"(size {want_size}, index {want_rank}): build it from {how}"
        )


def apply_context_parallel(
    model: nn.Module,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    transport: Transport = "collective",
    window_aware: bool = True,
) -> nn.Module:
    """Replace every layer's attention backend with `ContextParallelAttention` (in place; returns the model).
    Feed the model `plan.shard(inputs)`. `transport`: how shared K/V move (collective or ring). `group`: the
    CP group's process group, or for a prefix_canvas plan the whole context group's. `window_aware`
    (prefix_canvas): sliding-window layers receive only what their window reaches."""
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError("context parallelism needs a dllm Transformer (layers[i].self_attn.attend)")
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "num_experts", 0) and getattr(cfg, "router_aux_loss_coef", 0) > 0:
        raise ValueError(
            "context/block parallelism does not support MoE models with a router loss (router_aux_loss_coef > 0): "
            "the load-balancing loss is not a sum over rows, so the ranks' losses would not add up"
        )
    inner = layers[0].self_attn.attend
    if isinstance(inner, ContextParallelAttention):
        raise ValueError("context parallelism is already applied to this model")
    # one object for all layers, like the model's backend
    attend = ContextParallelAttention(inner, plan, group, transport=transport, window_aware=window_aware)
    if attend.routed:  # the routes of both layer kinds now, outside any compiled region (static per plan)
        local = getattr(cfg, "local_window", None) if any(getattr(layer, "local", False) for layer in layers) else None
        for window in {None, local}:
            attend.layer_routes(window)
    for layer in layers:
        layer.self_attn.attend = attend
    return model
