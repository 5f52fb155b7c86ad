"""Context parallelism (CP), block parallelism (BP) and context-sharded block parallelism (CSBP): the plan.

The model keeps its single-device contract; parallelism is applied from outside in three pieces. This
file holds the first, the plan; context_attention.py holds the other two, the K/V exchange and the
attention that uses it:

1. `ShardPlan` (static per run): which global rows of the objective's model input this rank holds
   (`rows`, sorted) and which of them are SHARED over its CP process group (their K/V are
   all-gathered in the forward, their K/V gradients reduce-scattered back in the backward) or
   PRIVATE (K/V stay local). Rows index the objective's layout: length L for MDLM, 2L = [x_t ; x_0]
   for block diffusion (rows < L noisy, rows >= L clean), 2L = [clean ; canvas] for DiffusionGemma's
   `prefix_canvas` (rows < L clean, rows >= L the canvas, whose blocks play the noisy blocks' part).
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
   `prefix_canvas` cuts its rows the same way (cp: the 2L rows; bp, csbp: canvas blocks dealt, clean rows
   replicated or CP-sharded), but moves K/V by static per-layer-kind routes (context_routes.py): the rows
   a peer's queries can reach, a sliding window's worth for sliding-window layers, and the canvas rows
   next to its blocks (training aligns canvas blocks per batch row, so a block may straddle two ranks).
   The clean rows replicated over CP groups (bp: every rank; csbp: one copy per CP group) own their
   targets (the encoder's next-token loss) once: clean row x in the copy of CP group x mod (bp / cp)
   (`owned`).
   Ranks here are indices inside one CP/BP group (0 .. group_size-1), not world ranks: the data-
   parallel placement of these groups on the mesh is the integration step's (ParallelDims).
2. `gather_rows` / `ring_shift` (context_attention.py): the shared K/V of a CP group, all-gathered
   (reduce-scattered back in the backward) or passed around the group as a ring, with
   torch.distributed collectives only (gloo and NCCL).
3. `ContextParallelAttention` (context_attention.py) replaces each layer's `self_attn.attend`
   (`apply_context_parallel`): keys = the CP group's shared K/V (global rows known statically from the
   peers' plans) + local private K/V; attention at global indices via `attention.backends.sharded`.

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

Not supported yet (refused): MoE models whose router's load-balancing loss enters the loss (a product
of two means over all tokens, not a sum over rows; with router_aux_loss_coef 0, as DiffusionGemma's SFT
requires, routing is per token and sharding is exact); self-conditioning outside prefix_canvas (there the
detached first pass is sharded like the second: each rank conditions its own canvas rows on their own
logits); masks with `query_offset` (cached decoding); a shifted objective whose `loss_rows` differ between
batch rows.

Shapes: B batch, L rows of the model input (2L for block diffusion), R rows held, T targets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from dllm.attention.masks import MaskMod, dense_mask, index_mapped
from dllm.diffusion.objectives.base import ModelInputs

Mode = Literal["cp", "bp", "csbp"]
Schedule = Literal["dual_end", "contiguous"]
Layout = Literal["sequence", "block_diffusion", "prefix_canvas"]
TWO_HALVES = ("block_diffusion", "prefix_canvas")  # layouts of 2L rows


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
    """Per held row: K/V all-gathered over the CP group (True) or kept local (False) (bool [R]);
    prefix_canvas: the rows held once per CP group (every row in cp, the clean rows in csbp)."""
    owned: torch.Tensor | None = None
    """prefix_canvas: per held row, whether this rank counts its target (bool [R]); None: every held row's."""

    @property
    def num_rows(self) -> int:
        """Rows of the global model input: L, or 2L for the block-diffusion and prefix_canvas layouts."""
        return 2 * self.seq_len if self.layout in TWO_HALVES else self.seq_len

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
        canvas = self.layout == "prefix_canvas"
        if inputs.self_cond_rows_B is not None and not canvas:
            raise ValueError("context/block parallelism does not support self-conditioning (a second model pass)")
        num_rows = inputs.tokens_BL.shape[1]
        if num_rows != self.num_rows:
            raise ValueError(
                f"shard plan is for {self.num_rows} rows ({self.layout}, L={self.seq_len}), inputs have {num_rows}"
            )
        m = inputs.mask
        if canvas and (m.kind != "prefix_canvas" or m.num_clean != self.seq_len or m.canvas_start):
            raise ValueError(
                f"a prefix_canvas plan needs a prefix_canvas mask with num_clean {self.seq_len} and canvas_start 0 "
                f"(training's layout), got {m.kind} {m.num_clean} {m.canvas_start}"
            )
        rows = self.rows.to(inputs.tokens_BL.device)
        num_out = _local_num_outputs(rows, m.num_outputs)
        held_clean = int((self.rows < self.seq_len).sum()) if canvas else None  # the model embeds the rest as canvas
        mask = dataclasses.replace(m, num_outputs=num_out, held_clean_rows=held_clean)
        group_rows = torch.cat([self.peer(r).rows for r in self.cp_group]).to(rows.device)
        targets, weights, loss_rows = _shard_targets(inputs, rows, group_rows, num_out)
        if self.owned is not None:  # a replicated clean row counts its target on one rank only
            weights = weights * self.owned.to(weights.device, weights.dtype)
        tokens, positions = inputs.tokens_BL[:, rows], inputs.positions_BL[:, rows]
        # self-conditioning (prefix_canvas): the first pass is sharded like the second, and a canvas row's
        # conditioning reads only its own logits, so every rank conditions its own rows (trainer.run_model)
        return ModelInputs(tokens, positions, mask, targets, weights, loss_rows, inputs.self_cond_rows_B)


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
    `layout` defaults to "sequence" for cp and "block_diffusion" for bp/csbp (which also take
    "prefix_canvas")."""
    layout = layout or ("sequence" if mode == "cp" else "block_diffusion")
    _check(mode, seq_len, block_size, cp, bp, rank, schedule, layout)
    L = seq_len
    if mode == "cp":
        rows = _chunk_rows(2 * L if layout in TWO_HALVES else L, cp, rank, schedule)
        shared = torch.ones_like(rows, dtype=torch.bool)
    else:
        assert block_size is not None  # checked
        blocks = _block_rows(L // block_size, block_size, bp, rank, schedule)  # noisy blocks, canvas blocks
        clean = torch.arange(L) if mode == "bp" else _chunk_rows(L, cp, rank % cp, schedule)
        if layout == "prefix_canvas":  # [clean ; canvas]
            rows = torch.cat([clean, L + blocks])
            shared = rows < L if mode == "csbp" else torch.zeros_like(rows, dtype=torch.bool)
        else:  # [x_t ; x_0]
            rows = torch.cat([blocks, L + clean])
            shared = rows >= L if mode == "csbp" else torch.zeros_like(rows, dtype=torch.bool)
    owned = None
    if layout == "prefix_canvas":  # clean row x counts in the copy of CP group x mod (bp / cp) (cp mode: 1 group)
        groups, group = (1, 0) if mode == "cp" else (bp // cp, rank // cp)
        owned = (rows >= L) | (rows % groups == group)
    return ShardPlan(mode, layout, L, block_size, cp, bp, rank, schedule, rows, shared, owned)


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
    if layout not in ("sequence", *TWO_HALVES):
        raise ValueError(f"unknown layout {layout!r} (sequence, block_diffusion, prefix_canvas)")
    if mode == "cp":
        two = layout in TWO_HALVES
        _check_even(2 * seq_len if two else seq_len, cp, schedule, "2L layout" if two else "sequence")
        return
    if layout not in TWO_HALVES:
        raise ValueError(
            f"mode {mode} splits noisy blocks: it needs the block_diffusion or prefix_canvas layout, got {layout!r}"
        )
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
