"""Context parallelism (CP), block parallelism (BP) and context-sharded block parallelism (CSBP).

The model keeps its single-device contract; parallelism is applied from outside in three pieces:

1. `ShardPlan` (static per run): which global rows of the objective's model input this rank holds
   (`rows`, sorted) and which of them are SHARED over its CP process group (their K/V are
   all-gathered in the forward, their K/V gradients reduce-scattered back in the backward) or
   PRIVATE (K/V stay local). Rows index the objective's layout: length L for MDLM, 2L = [x_t ; x_0]
   for block diffusion (rows < L noisy, rows >= L clean).
   - `cp`: the N rows (N = L or 2L) cut into 2*cp chunks; rank r holds chunks r and 2cp-1-r
     (`dual_end`, load balance for causal-like masks) or chunk r of cp (`contiguous`). All shared.
     Over BD3LM's 2L layout this is the position-sharded baseline.
   - `bp` (block diffusion): noisy blocks dealt to the bp ranks: `dual_end` pairs block b with block
     nb-1-b and deals pair p to rank p % bp (each pair costs (b+1) + (nb-b) = nb+1 block units of
     block-causal work, so ranks balance exactly); `contiguous` gives rank r the r-th run of nb/bp
     blocks. Every rank also holds ALL clean rows (computed redundantly). All private: no
     communication in attention.
   - `csbp` (bp ranks, bp a multiple of cp): noisy blocks as in `bp`; rank r has bp index r, cp
     index c = r % cp, and its CP group is the cp consecutive ranks [r - c, r - c + cp). The clean
     sequence x_0 is cut like `cp` mode cuts its rows (2*cp chunks, dual_end or contiguous) and cp
     index c holds its chunk(s); so each CP group covers x_0 exactly once and there are bp/cp copies
     of the clean shards (one per CP group). Clean rows shared, noisy rows private.
   Ranks here are indices inside one CP/BP group (0 .. group_size-1), not world ranks: the data-
   parallel placement of these groups on the mesh is the integration step's (ParallelDims).
2. `gather_rows`: an autograd Function, all-gather along the row dim forward, reduce-scatter (sum)
   backward, with torch.distributed collectives only (gloo and NCCL; see `_ALL_GATHER`).
3. `ContextParallelAttention` replaces each layer's `self_attn.attend` (`apply_context_parallel`):
   keys = gathered shared K/V of the CP group (global rows known statically from the peers' plans)
   + local private K/V; attention at global indices via `attention.backends.sharded`.
   With `transport="ring"` the shared K/V shards travel around the CP group instead (`ring_shift`,
   point-to-point batch_isend_irecv), one checkpointed partial attention per shard, merged by
   log-sum-exp: the same bytes, a score tile of one shard (see the class doc).

`plan.shard(inputs)` selects the rank's rows of the model inputs; positions stay global (RoPE is
global) and the mask stays the global description (only `num_outputs` becomes local: the first rows
of a rank are its rows below the global `num_outputs`, since rows are sorted). A target belongs to
the rank that holds the hidden row that predicts it. `loss_sum` is a sum over targets, so the loss
sums of the ranks of one CP/BP group add up to the one-process `loss_sum`, and so do their parameter
gradients: the K/V gradient a rank computes for another rank's rows travels back through
`gather_rows`' reduce-scatter, and replicated clean rows (bp) each carry only their own rank's part.

Gradient averaging for the integration step (trainer + FSDP/DDP; tested here: the sum over a group's
ranks of their parameter gradients equals the one-process gradient of the group's batch):
- every rank of a CP/BP group prepares the SAME micro-batch (same sample ids, so the same noise),
  then `shard`s it; `objective.normalizer` counts a batch's targets, so the global target count must
  be summed over the data-parallel ranks only (or the world sum divided by the group size);
- FSDP2/DDP AVERAGE gradients over the ranks they reduce over. The trainer today scales each rank's
  loss by dp / global_targets. If the gradient reduction spans the CP/BP ranks too (one flattened
  dp x cp|bp mesh dimension for FSDP, the usual choice), the scale becomes (dp * group_size) /
  global_targets, group_size = cp for `cp`, bp for `bp`/`csbp`; the loss metric (sum of the ranks'
  loss sums over the world / global_targets) needs no change, since each target is owned once;
- every rank of a group must run backward on a loss connected to every layer's gather (the
  reduce-scatter is a collective): `shard` keeps at least one output row per rank.

Not supported yet (refused): MoE models (the router's load-balancing loss is a product of two means
over all tokens, not a sum over rows); self-conditioning (a second model pass); masks with
`query_offset` (cached decoding); a shifted objective whose `loss_rows` differ between batch rows.

Shapes: B batch, H query heads, K key/value heads, R rows held, Q query rows, S keys held, D head width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dllm.attention.backends import AttentionFn
from dllm.attention.backends.flex import FlexBackend
from dllm.attention.backends.sharded import Kernel, merge_partials, partial_attention, shard_mask, sharded_attention
from dllm.attention.masks import MaskMod, dense_mask, index_mapped
from dllm.diffusion.objectives.base import ModelInputs

Mode = Literal["cp", "bp", "csbp"]
Transport = Literal["collective", "ring"]
Schedule = Literal["dual_end", "contiguous"]
Layout = Literal["sequence", "block_diffusion"]

# torch >= 2.13 renamed the tensor collectives (the old names warn); gloo and NCCL implement both
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_BATCH_ISEND_IRECV = dist.batch_isend_irecv  # the ring's point-to-point exchange (wrapped by the bench)


# --------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True, eq=False)
class ShardPlan:
    """Which global rows of the objective's model input one rank of a CP/BP group holds (see module doc)."""

    mode: Mode
    layout: Layout
    seq_len: int
    """L: the objective's sequence length (the model input has L rows, or 2L for block diffusion)."""
    block_size: int | None
    cp: int
    bp: int
    rank: int
    """This rank's index inside its CP/BP group (0 .. group_size - 1)."""
    schedule: Schedule
    rows: torch.Tensor
    """Global row indices held, sorted ascending (LongTensor [R])."""
    shared: torch.Tensor
    """Per held row: K/V all-gathered over the CP group (True) or kept local (False) (bool [R])."""

    @property
    def num_rows(self) -> int:
        """Rows of the global model input: L, or 2L for the block-diffusion layout."""
        return 2 * self.seq_len if self.layout == "block_diffusion" else self.seq_len

    @property
    def group_size(self) -> int:
        """Ranks that together hold one copy of the model input: cp (cp mode) or bp (bp, csbp)."""
        return self.cp if self.mode == "cp" else self.bp

    @property
    def cp_index(self) -> int:
        """This rank's index inside its CP process group (its rank in that group)."""
        return self.rank % self.cp

    @property
    def cp_group(self) -> list[int]:
        """The group-local ranks whose shared rows this rank gathers (itself included), in cp-index order."""
        base = self.rank - self.cp_index
        return list(range(base, base + self.cp))

    @property
    def shared_rows(self) -> torch.Tensor:
        return self.rows[self.shared]

    @property
    def private_rows(self) -> torch.Tensor:
        return self.rows[~self.shared]

    def peer(self, rank: int) -> ShardPlan:
        """The plan of another rank of the same group."""
        return build_plan(self.mode, self.seq_len, self.block_size, self.cp, self.bp, rank, self.schedule, self.layout)

    def key_rows(self) -> torch.Tensor:
        """Global rows of the keys this rank attends over, in the order ContextParallelAttention builds
        them: the shared rows of each rank of its CP group (cp-index order), then its private rows."""
        if not bool(self.shared.any()):
            return self.private_rows
        gathered = [self.peer(r).shared_rows for r in self.cp_group]
        return torch.cat([*gathered, self.private_rows])

    def shard(self, inputs: ModelInputs) -> ModelInputs:
        """This rank's rows of the model inputs, targets and weights (see the module doc)."""
        if inputs.self_cond_rows_B is not None:
            raise ValueError("context/block parallelism does not support self-conditioning (a second model pass)")
        num_rows = inputs.tokens_BL.shape[1]
        if num_rows != self.num_rows:
            raise ValueError(
                f"shard plan is for {self.num_rows} rows ({self.layout}, L={self.seq_len}), inputs have {num_rows}"
            )
        rows = self.rows.to(inputs.tokens_BL.device)
        num_out = _local_num_outputs(rows, inputs.mask.num_outputs)
        mask = dataclasses.replace(inputs.mask, num_outputs=num_out)
        group_rows = torch.cat([self.peer(r).rows for r in self.cp_group]).to(rows.device)
        targets, weights, loss_rows = _shard_targets(inputs, rows, group_rows, num_out)
        tokens, positions = inputs.tokens_BL[:, rows], inputs.positions_BL[:, rows]
        return ModelInputs(tokens, positions, mask, targets, weights, loss_rows=loss_rows)


def _local_num_outputs(rows: torch.Tensor, num_outputs: int | None) -> int | None:
    """The rank's rows below the global `num_outputs` are its first rows (rows are sorted). A rank that
    holds none computes all its rows' outputs instead: its loss must still reach every layer's gather."""
    if num_outputs is None:
        return None
    local = int((rows < num_outputs).sum())
    return local or None


def _shard_targets(inputs: ModelInputs, rows: torch.Tensor, group_rows: torch.Tensor, num_out: int | None):
    """(targets, weights, loss_rows) of the targets this rank owns. Target t is row t's token (x_t's row
    for block diffusion); it is owned by the rank that holds the hidden row predicting it (t itself, or
    `loss_rows[t]` for a shifted objective). A predicting row held by several ranks (clean rows: every
    rank in `bp`, one copy per CP group in `csbp`) counts for the copy in the CP group that holds row t."""
    T = inputs.targets_BL.shape[1]
    if inputs.loss_rows is None:  # hidden row t predicts target t: the held rows below T, a prefix of `rows`
        own = rows[rows < T]
        return inputs.targets_BL[:, own], inputs.weights_BL[:, own], None
    loss_rows = inputs.loss_rows
    if not bool((loss_rows == loss_rows[:1]).all()):
        raise ValueError("context/block parallelism needs loss_rows equal for every batch row (a static shift)")
    targets_T = torch.arange(T, device=rows.device)
    held = torch.isin(loss_rows[0], rows) & torch.isin(targets_T, group_rows)
    own = torch.nonzero(held).squeeze(1)
    local = torch.searchsorted(rows, loss_rows[:, own])
    if num_out is not None and own.numel() and int(local.max()) >= num_out:
        raise ValueError("a shifted target is predicted by a row whose output the model does not compute (num_outputs)")
    return inputs.targets_BL[:, own], inputs.weights_BL[:, own], local


def build_plan(
    mode: Mode,
    seq_len: int,
    block_size: int | None = None,
    cp: int = 1,
    bp: int = 1,
    rank: int = 0,
    schedule: Schedule = "dual_end",
    layout: Layout | None = None,
) -> ShardPlan:
    """The plan of `rank` (inside its CP/BP group); ValueError for layouts that cannot be split evenly.
    `layout` defaults to "sequence" for cp and must be (and defaults to) "block_diffusion" for bp/csbp."""
    layout = layout or ("sequence" if mode == "cp" else "block_diffusion")
    _check(mode, seq_len, block_size, cp, bp, rank, schedule, layout)
    L = seq_len
    if mode == "cp":
        rows = _chunk_rows(2 * L if layout == "block_diffusion" else L, cp, rank, schedule)
        shared = torch.ones_like(rows, dtype=torch.bool)
    else:
        assert block_size is not None  # checked
        noisy = _block_rows(L // block_size, block_size, bp, rank, schedule)
        clean = L + (torch.arange(L) if mode == "bp" else _chunk_rows(L, cp, rank % cp, schedule))
        rows = torch.cat([noisy, clean])
        shared = rows >= L if mode == "csbp" else torch.zeros_like(rows, dtype=torch.bool)
    return ShardPlan(mode, layout, L, block_size, cp, bp, rank, schedule, rows, shared)


def _check(mode, seq_len, block_size, cp, bp, rank, schedule, layout) -> None:
    if mode not in ("cp", "bp", "csbp") or schedule not in ("dual_end", "contiguous"):
        raise ValueError(f"unknown mode {mode!r} or schedule {schedule!r} (modes cp, bp, csbp; dual_end, contiguous)")
    if cp < 1 or bp < 1 or seq_len < 1:
        raise ValueError(f"cp, bp and seq_len must be >= 1, got cp={cp}, bp={bp}, seq_len={seq_len}")
    if mode == "cp" and bp != 1:
        raise ValueError(f"mode cp shards positions only: bp must be 1, got {bp} (use csbp for cp x bp)")
    if mode == "bp" and cp != 1:
        raise ValueError(f"mode bp keeps clean rows replicated: cp must be 1, got {cp} (use csbp for cp x bp)")
    if mode == "csbp" and bp % cp:
        raise ValueError(f"csbp needs bp a multiple of cp (each CP group covers x_0 once), got bp={bp}, cp={cp}")
    size = cp if mode == "cp" else bp
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside the {mode} group of size {size}")
    if mode == "cp":
        two = layout == "block_diffusion"
        _check_even(2 * seq_len if two else seq_len, cp, schedule, "2L layout" if two else "sequence")
        return
    if layout != "block_diffusion":
        raise ValueError(f"mode {mode} splits noisy blocks: it needs the block_diffusion layout, got {layout!r}")
    if block_size is None or block_size < 1 or seq_len % block_size:
        raise ValueError(f"mode {mode}: seq_len {seq_len} must be a positive multiple of block_size {block_size}")
    num_blocks, per = seq_len // block_size, 2 * bp if schedule == "dual_end" else bp
    if num_blocks % per:
        raise ValueError(f"{schedule} block schedule needs the {num_blocks} noisy blocks divisible by {per} (bp={bp})")
    if mode == "csbp":
        _check_even(seq_len, cp, schedule, "clean x_0")


def _check_even(num_rows: int, cp: int, schedule: Schedule, what: str) -> None:
    """Equal shards, so that the all-gather moves equal shares (all_gather_single needs them)."""
    per = 2 * cp if schedule == "dual_end" else cp
    if num_rows % per:
        raise ValueError(f"{schedule} needs the {what} ({num_rows} rows) divisible by {per} (cp={cp}) for equal shards")


def _chunk_rows(num_rows: int, parts: int, index: int, schedule: Schedule) -> torch.Tensor:
    """dual_end: chunks index and 2*parts-1-index of 2*parts; contiguous: chunk index of parts."""
    if schedule == "contiguous":
        size = num_rows // parts
        return torch.arange(index * size, (index + 1) * size)
    size = num_rows // (2 * parts)
    last = 2 * parts - 1 - index
    return torch.cat([torch.arange(index * size, (index + 1) * size), torch.arange(last * size, (last + 1) * size)])


def _block_rows(num_blocks: int, block_size: int, parts: int, index: int, schedule: Schedule) -> torch.Tensor:
    """Rows of the noisy blocks of one rank, sorted (dual_end pairs b with nb-1-b, pair p -> rank p % parts)."""
    if schedule == "contiguous":
        per = num_blocks // parts
        blocks = torch.arange(index * per, (index + 1) * per)
    else:
        pairs = torch.arange(index, num_blocks // 2, parts)
        blocks = torch.cat([pairs, num_blocks - 1 - pairs]).sort().values
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def cp_group_ranks(plan: ShardPlan) -> list[list[int]]:
    """Every CP group of a CP/BP group, as group-local ranks (build them all, in this order, on every rank)."""
    size = plan.group_size
    return [list(range(base, base + plan.cp)) for base in range(0, size, plan.cp)]


def allowed_pairs(plan: ShardPlan, mod: MaskMod, batch: int = 1) -> int:
    """How many (query, key) pairs of this rank's query rows a global mask function allows: its share
    of the attention work (`mod` from masks.mask_mod over the global rows)."""
    keys = torch.arange(plan.num_rows)
    return int(
        dense_mask(index_mapped(mod, plan.rows, keys), batch, plan.rows.numel(), keys.numel(), keys.device).sum()
    )


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
    """

    def __init__(
        self,
        inner: AttentionFn,
        plan: ShardPlan,
        group: dist.ProcessGroup | None,
        kernel: Kernel | None = None,
        transport: Transport = "collective",
    ) -> None:
        if transport not in ("collective", "ring"):
            raise ValueError(f"unknown K/V transport {transport!r} (collective or ring)")
        self.inner, self.plan, self.group = inner, plan, group  # inner: the model's backend (kept to undo)
        self.kernel = kernel  # None: dense SDPA on CPU, FlexAttention elsewhere
        self.transport = transport
        self.flex = inner if isinstance(inner, FlexBackend) else FlexBackend()
        self.gathers = bool(plan.shared.any())
        if self.gathers:
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
        if self.transport == "ring" and self.gathers:
            return self.ring(q_BHQD, k_BKRD, v_BKRD, mask)
        k_BKSD, v_BKSD = self.keys_values(k_BKRD, v_BKRD)
        kernel = self.kernel or ("dense" if q_BHQD.device.type == "cpu" else "flex")
        return sharded_attention(
            q_BHQD, k_BKSD, v_BKSD, mask, self.plan.rows[:Q], self.kv_rows, self.plan.num_rows,
            (*self.map_key, Q), kernel, self.flex,
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
    if not dist.is_initialized():
        raise ValueError(f"mode {plan.mode} exchanges K/V: initialise torch.distributed and pass the CP group")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != plan.cp or rank != plan.cp_index:
        raise ValueError(
            f"the CP process group (size {size}, this rank {rank}) does not match the plan "
            f"(cp={plan.cp}, cp index {plan.cp_index}): build it from cp_group_ranks(plan), in order"
        )


def apply_context_parallel(
    model: nn.Module, plan: ShardPlan, group: dist.ProcessGroup | None, transport: Transport = "collective"
) -> nn.Module:
    """Replace every layer's attention backend with `ContextParallelAttention` (in place; returns the model).
    Feed the model `plan.shard(inputs)`. `transport`: how shared K/V move (collective or ring)."""
    layers = getattr(model, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError("context parallelism needs a dllm Transformer (layers[i].self_attn.attend)")
    cfg = getattr(model, "cfg", None)
    if cfg is not None and getattr(cfg, "num_experts", 0):
        raise ValueError(
            "context/block parallelism does not support MoE models yet: the router's load-balancing loss "
            "is not a sum over rows, so the ranks' losses would not add up to the one-process loss"
        )
    inner = layers[0].self_attn.attend
    if isinstance(inner, ContextParallelAttention):
        raise ValueError("context parallelism is already applied to this model")
    # one object for all layers, like the model's backend
    attend = ContextParallelAttention(inner, plan, group, transport=transport)
    for layer in layers:
        layer.self_attn.attend = attend
    return model
