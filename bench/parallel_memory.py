"""Per-rank memory and communication of each parallel layout, measured next to an analytic estimate.

Every topology trains ONE step of a small llama-like model (hidden E 256, 4 layers, H 8 query heads
and K 4 key/value heads of width D 32, gated MLP I 704, vocabulary V 512, tied head, fp32) on MDLM,
B 2 rows of L 128 tokens per data-parallel rank, assembled as training assembles it:
TopologyConfig -> ParallelDims -> build_meshes, build_cp_group, build_plan -> model on meta ->
apply_parallelism(activation_checkpointing=...) -> materialize -> after_materialize; the loss is
scaled as the trainer scales it; AdamW from training/optim.py. Expert parallelism uses a qwen3_moe
model of the same shape (X 4 experts of width Ie 256, top K 2, per-head q/k norms). Every topology of
one world size runs in one spawn of gloo CPU processes (1, 2, 4), one thread each.

MEASURED per rank:
- param / grad / optimizer bytes: the local storage (DTensor -> to_local()) of every parameter, its
  gradient and AdamW's state tensors (exp_avg, exp_avg_sq, step) after the step;
- activation bytes: parallel.checkpointing.saved_activation_bytes around forward + loss;
- sent bytes per axis (fsdp, tp, cp, ep): `CollectiveMeter`, a TorchDispatchMode around forward,
  backward and the optimizer step. It sees torch.distributed's collectives as c10d ops (FSDP2,
  context and expert parallelism, the chunked cross-entropy) and DTensor's functional collectives
  (tensor parallelism: DTensor ops are handed back to DTensor, whose collectives on local tensors
  come back to the mode). Wrapping Python functions would miss both the c10d calls that modules bound
  at import time and DTensor's. Each collective's process group (an argument of the op) names the
  axis, by the group's name or else its world ranks (`axis_groups`). A collective of n ranks sends
  what a bandwidth-optimal algorithm puts on the wire per rank: all-gather (n-1) x its input,
  reduce-scatter (n-1)/n x its input, all-reduce 2 (n-1)/n x the tensor, all-to-all its rows for
  the other ranks. No gradient clipping (its norm all-reduces are a few scalars).

ANALYTIC, from the model config, the topology and N (this rank's supervised rows, an input of the
batch like B and L). Per rank: T tensor-parallel ranks, c context-parallel ranks, F = dp x c ranks
FSDP2 shards over (for experts: their dp / ep replicas), P = L / c positions held, S the rows of the
residual stream (P / T with sequence parallelism, else P), Hq = H / T, Hk = K / T, It = I / T,
Vt = V / T, n = B P tokens, A = n K routed rows, nl layers; fp32 elements of 4 bytes.
- Parameters: every tensor of the model, from the config (`param_specs`). Tensor parallelism cuts
  q/k/v/gate/up and the embedding (= the tied head) by rows, o_proj/down_proj by columns; expert
  parallelism cuts the experts by ep; FSDP2 then cuts dim 0 of what is left into F torch.chunk
  pieces (rank 0 holds the largest). grad = param; optimizer = 2 x param + 4 bytes per tensor (step).
- Activations: what autograd keeps for the backward, per layer, x B elements:
    none:  4 S E + 2 S        both norms' x (the block input, and the mid-block residual), x-hat, 1/rms
         + 2 P E              the q/k/v and the MLP input (norm outputs; gathered under SP)
         + 2 P Hq D + 2 c P Hk D + Hq P   q after RoPE and the attention output (the o_proj input is a
                              view of it); k after RoPE and v (under CP the gathered K/V of all keys); lse
         + 4 P It             gate, act(gate), up, act(gate) x up
         [qk-norm: + P (Hq + Hk)(2 D + 1) + P Hq D: q, k, their x-hat and 1/rms; the attention output
          then comes back head-major, so the o_proj input is a copy]
         [MoE instead of the MLP, per layer (not x B): router n X + n K (int64 ids, probs) + n + X;
          one process, per routed row (3 E + 4 Ie) + 1 fp32 + 2 int64 ids (input, gate_up out, act,
          act x up, expert out, x weight; weight); EP, per received row R (2 E + 4 Ie) fp32 + 1 int64,
          per own row 2 E + 1 fp32 + 2 int64, with R = A (uniform routing)]
    selective: S E + P (2 Hq + 2 Hk) D + Hq P + 2 P E + 2 P It   block input; the outputs of the
              matmuls (q, k, v, o, gate, up, down) and of attention (out, lse); + the functional
              collectives' outputs under TP (2 P E; SP: 2 (S + P) E); everything else is recomputed
    full:  S E                the block input
  and once: final norm B (2 S E + S); RoPE tables 2 B P D; the chunked CE's gradients N E + Vt E;
  the supervised-row mask B P bool; the loss.
- Sent bytes per step:
    fsdp: per parameter tensor (F - 1) x its shard x (2 all-gathers, forward and backward, for a
          block's; 1 for the root's, which FSDP2 keeps unsharded from forward to backward; + 1
          reduce-scatter of the gradient)
    tp:   no SP, all-reduces 2 (T-1)/T x [(1 + nl (2 + 5)) B P E + N E + 3 N]: the embedding's
          partial sums; per block o_proj and down_proj forward, the input gradients of q, k, v, gate
          and up backward; the CE's d hidden and its per-row max and sums (one chunk here)
          SP: per block 8 gathers/scatters (T-1)/T x B P E (before attention and the MLP, after them,
          mirrored in the backward); the embedding's all-reduce and its backward gather, the final
          norm's gather; the norm weights' gradients (2 nl + 1) x E all-reduced; the same CE traffic
          full recompute replays the collectives before each block's down_proj (checkpoint stops
          once it has what the backward needs): + nl all-reduces (SP: + 3 nl gathers/scatters)
    cp:   nl x 2 x (c-1) x 2 B Hk P D: K and V all-gathered forward, their gradients reduce-scattered
          backward (+ 1 gather when checkpointing recomputes attention)
    ep:   nl x [4 A (ep-1)/ep E (token rows out and back, forward and backward) + (ep-1)/ep X int64
          counts], uniform routing

Target: measured / analytic within 10% for every quantity; a `note` says why where not. Expert
traffic and expert activations follow the router's choices (`received_over_uniform`).

    PYTHONPATH=src python bench/parallel_memory.py [--cases 1proc dp2 ...]

One JSON line on stdout; a table on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from dllm.config.model import ModelConfig
from dllm.config.objectives import MDLMConfig
from dllm.config.training import OptimizerConfig, TopologyConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.apply import after_materialize, apply_parallelism
from dllm.parallel.checkpointing import saved_activation_bytes
from dllm.parallel.context import build_plan
from dllm.parallel.dims import DistEnv, ParallelDims
from dllm.training.build import materialize
from dllm.training.optim import build_optimizer
from dllm.training.trainer import run_model

VOCAB = 512
IDS = TokenIds(mask_id=VOCAB - 1, eos_id=VOCAB - 2, pad_id=VOCAB - 3, num_tokens=VOCAB)
BATCH, SEQ = 2, 128  # rows per data-parallel rank (micro-batch), sequence length
DENSE = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=VOCAB)
MOE = dict(DENSE, family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
AUX_COEF = 0.01  # the router's load-balancing loss coefficient (MoE)
F32 = 4  # bytes of a float32: parameters, gradients, optimizer states and activations (fp32 training)
I64, BOOL = 8, 1
TOLERANCE = 0.10
_CP2 = {"mode": "cp", "cp_size": 2}


@dataclass(frozen=True)
class Case:
    """One topology: its world size, TopologyConfig fields, model and activation checkpointing."""

    world: int
    topology: dict = field(default_factory=dict)
    moe: bool = False
    """The qwen3_moe model (else the dense llama one)."""
    ac: str = "none"
    """training.activation_checkpointing: none, selective or full."""


CASES: dict[str, Case] = {
    "1proc": Case(1),
    "1proc-selective": Case(1, ac="selective"),
    "1proc-full": Case(1, ac="full"),
    "moe-1proc": Case(1, moe=True),
    "dp2": Case(2),
    "tp2": Case(2, {"tp_size": 2}),
    "tp2-sp": Case(2, {"tp_size": 2, "sequence_parallel": True}),
    "cp2": Case(2, {"context": _CP2}),
    "ep2-moe": Case(2, {"ep_size": 2}, moe=True),
    "dp2xtp2": Case(4, {"tp_size": 2}),
    "dp2xtp2-selective": Case(4, {"tp_size": 2}, ac="selective"),
    "dp2xtp2-full": Case(4, {"tp_size": 2}, ac="full"),
    "tp2xcp2": Case(4, {"tp_size": 2, "context": _CP2}),
}


def model_config(case: Case) -> ModelConfig:
    return ModelConfig(**(MOE if case.moe else DENSE))


# --------------------------------------------------------------------------------------------------
# the layout of one rank (from the config and the topology only)


@dataclass(frozen=True)
class Layout:
    """What the analytic estimates need: the model config, the parallel sizes, the rank's rows."""

    cfg: ModelConfig
    dims: ParallelDims
    ac: str
    """training.activation_checkpointing: none, selective or full."""
    batch: int
    """B: rows of this rank's micro-batch."""
    seq: int
    """L: the sequence length."""
    loss_rows: int
    """N: supervised (masked) positions this rank computes the loss on (an input, like B and L)."""

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def cp(self) -> int:
        return self.dims.cp if self.dims.mode == "cp" else 1

    @property
    def fsdp(self) -> int:
        """Ranks FSDP2 (topology.data_parallel fsdp, the default) shards the dense parameters over."""
        return self.dims.grad_ranks

    @property
    def edp(self) -> int:
        """Ranks FSDP2 shards each expert over (its replicas)."""
        return self.dims.dp // self.dims.ep if self.dims.ep > 1 else self.fsdp


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: its name and full shape, and how the layouts cut it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    """Dimension tensor parallelism shards (0 column-wise / vocabulary, 1 row-wise), None: replicated."""
    expert: bool = False
    """Sharded by expert parallelism along dim 0 (and FSDP2 over the expert's replicas)."""
    block: bool = True
    """In a transformer block (FSDP2 unit of its own), else in the root unit (embedding, final norm)."""


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter tensor of the native Transformer, from its config (pre-norm, RoPE, no biases:
    the llama and qwen3 layouts this bench uses)."""
    E, H, K, D, V = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.vocab_size
    specs = [ParamSpec("embed_tokens.weight", (V, E), tp_dim=0, block=False)]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        specs += [
            ParamSpec(p + "input_layernorm.weight", (E,)),
            ParamSpec(p + "self_attn.q_proj.weight", (H * D, E), tp_dim=0),
            ParamSpec(p + "self_attn.k_proj.weight", (K * D, E), tp_dim=0),
            ParamSpec(p + "self_attn.v_proj.weight", (K * D, E), tp_dim=0),
            ParamSpec(p + "self_attn.o_proj.weight", (E, H * D), tp_dim=1),
            ParamSpec(p + "post_attention_layernorm.weight", (E,)),
        ]
        if cfg.qk_norm:
            specs += [ParamSpec(p + "self_attn.q_norm.weight", (D,)), ParamSpec(p + "self_attn.k_norm.weight", (D,))]
        if cfg.num_experts:
            X, Ie = cfg.num_experts, cfg.expert_size
            specs += [
                ParamSpec(p + "mlp.gate.weight", (X, E)),
                ParamSpec(p + "mlp.experts.gate_up_proj", (X, 2 * Ie, E), expert=True),
                ParamSpec(p + "mlp.experts.down_proj", (X, E, Ie), expert=True),
            ]
        else:
            I = cfg.mlp_size  # noqa: E741
            specs += [
                ParamSpec(p + "mlp.gate_proj.weight", (I, E), tp_dim=0),
                ParamSpec(p + "mlp.up_proj.weight", (I, E), tp_dim=0),
                ParamSpec(p + "mlp.down_proj.weight", (E, I), tp_dim=1),
            ]
    specs.append(ParamSpec("norm.weight", (E,), block=False))
    if not cfg.tie_embeddings:
        specs.append(ParamSpec("lm_head.weight", (V, E), tp_dim=0, block=False))
    return specs


def _chunk(size: int, parts: int) -> int:
    """Rows rank 0 holds when `size` rows are cut `torch.chunk`-wise into `parts` (the largest share)."""
    return -(-size // parts)


def local_shape(spec: ParamSpec, lay: Layout) -> tuple[int, ...]:
    """Rank 0's local shape: tensor parallelism cuts tp_dim, expert parallelism the experts, then
    FSDP2 cuts dim 0 of what is left (over the data-parallel x context ranks, or the expert's replicas)."""
    shape = list(spec.shape)
    if spec.tp_dim is not None and lay.tp > 1:
        shape[spec.tp_dim] = _chunk(shape[spec.tp_dim], lay.tp)
    if spec.expert and lay.dims.ep > 1:
        shape[0] //= lay.dims.ep
    shards = lay.edp if spec.expert else lay.fsdp
    if shards > 1:
        shape[0] = _chunk(shape[0], shards)
    return tuple(shape)


def analytic_memory(lay: Layout) -> dict[str, int]:
    """Parameter, gradient, optimizer-state and activation bytes of one rank (see the module doc)."""
    specs = param_specs(lay.cfg)
    param = sum(math.prod(local_shape(s, lay)) for s in specs) * F32
    # AdamW: exp_avg and exp_avg_sq shaped as the parameter, plus a float32 scalar `step` per tensor
    return {
        "param": param,
        "grad": param,
        "optimizer": 2 * param + F32 * len(specs),
        "activation": analytic_activation(lay),
    }


def analytic_activation(lay: Layout) -> int:
    """Bytes the forward and loss keep for the backward on one rank (see the module doc, "Activations")."""
    cfg = lay.cfg
    if cfg.num_experts and lay.ac != "none":
        raise ValueError("the MoE estimate covers activation_checkpointing none only")
    B, E, D, V, T = lay.batch, cfg.hidden_size, cfg.dim_per_head, cfg.vocab_size, lay.tp
    P = lay.seq // lay.cp  # positions of the sequence this rank holds
    S = P // T if lay.dims.sequence_parallel else P  # rows of the residual stream between the matmuls
    block = {"none": _block_none, "selective": _block_selective, "full": _block_full}[lay.ac](lay, P, S)
    final_norm = B * (2 * S * E + S) * F32  # x, x-hat, 1/rms
    rope = B * 2 * P * D * F32  # cos and signed sin [B, 1, P, D], shared by the layers
    loss = (lay.loss_rows + _chunk(V, T)) * E * F32  # the chunked CE's d loss / d hidden rows and / d head
    loss += B * P * BOOL + F32  # the supervised-row mask, the loss
    return cfg.num_layers * block + final_norm + rope + loss


def _block_full(lay: Layout, P: int, S: int) -> int:
    """Full recompute: a block keeps its input only."""
    return lay.batch * S * lay.cfg.hidden_size * F32


def _block_selective(lay: Layout, P: int, S: int) -> int:
    """The selective policy keeps the block input and the outputs of matmuls, attention and
    functional collectives; everything else is recomputed from them."""
    cfg = lay.cfg
    E, D, T = cfg.hidden_size, cfg.dim_per_head, lay.tp
    Hq, Hk, I = cfg.num_heads // T, cfg.kv_heads // T, _chunk(cfg.mlp_size, T)  # noqa: E741
    kept = S * E  # the block input
    kept += P * (Hq + 2 * Hk) * D + P * Hq * D + Hq * P  # q, k, v projections; attention out and lse
    kept += 2 * P * E + 2 * P * I  # o_proj and down_proj outputs; gate and up outputs
    if T > 1:  # the collectives' outputs: two all-reduces, or (sequence parallel) two gathers + two scatters
        kept += 2 * (S * E + P * E) if lay.dims.sequence_parallel else 2 * P * E
    return lay.batch * kept * F32


def _block_none(lay: Layout, P: int, S: int) -> int:
    """Everything autograd saves in one pre-norm block."""
    cfg = lay.cfg
    B, E, D, T = lay.batch, cfg.hidden_size, cfg.dim_per_head, lay.tp
    Hq, Hk = cfg.num_heads // T, cfg.kv_heads // T
    keys = P * lay.cp  # K/V rows each rank attends over (context parallel: the gathered ones)
    kept = 4 * S * E + 2 * S  # both norms: x, x-hat, 1/rms
    kept += 2 * P * E  # the attention and MLP inputs (norm outputs, gathered under sequence parallelism)
    kept += 2 * P * Hq * D + 2 * keys * Hk * D + Hq * P  # q and attention out; k and v; lse
    if cfg.qk_norm:  # per-head norms keep q and k, their x-hat and 1/rms; the attention output is copied
        kept += P * (Hq + Hk) * (2 * D + 1) + P * Hq * D
    total = B * kept * F32
    if cfg.num_experts:
        return total + _moe_none(lay, P)
    return total + B * 4 * P * _chunk(cfg.mlp_size, T) * F32  # gate, act(gate), up, act(gate) * up


def _moe_none(lay: Layout, P: int) -> int:
    """Router and experts of one MoE layer: n tokens, A = n K routed rows (R = A received under EP)."""
    cfg = lay.cfg
    E, X, K, Ie = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size
    n = lay.batch * P
    A = n * K
    router = n * X * F32 + n * K * (I64 + F32) + n * F32 + X * F32  # probs, top-k ids and probs, their sum
    if lay.dims.ep == 1:
        # per routed row: its input, gate_up out, act, act * up, the expert output, it x weight; weight; ids
        return router + A * ((3 * E + 4 * Ie) * F32 + F32 + 2 * I64)
    R = A  # rows an owner receives, if routing is uniform
    # input rows, gate_up out, act, act * up, the outputs in arrival order; that order
    received = R * ((2 * E + 4 * Ie) * F32 + I64)
    returned = A * (2 * E * F32 + F32 + 2 * I64)  # expert outputs, x weight; weight; token and sort ids
    return router + received + returned


def analytic_comm(lay: Layout) -> dict[str, int]:
    """Bytes one rank sends per step per axis (see the module doc)."""
    return {"fsdp": _fsdp_bytes(lay), "tp": _tp_bytes(lay), "cp": _cp_bytes(lay), "ep": _ep_bytes(lay)}


def _fsdp_bytes(lay: Layout) -> int:
    total = 0
    for spec in param_specs(lay.cfg):
        n = lay.edp if spec.expert else lay.fsdp
        if n <= 1:
            continue
        shard = math.prod(local_shape(spec, lay)) * F32
        gathers = 2 if spec.block else 1  # blocks re-gather for the backward; the root stays unsharded
        total += (n - 1) * shard * (gathers + 1)  # + the reduce-scatter: (n-1)/n of the padded n shards
    return total


def _tp_bytes(lay: Layout) -> int:
    T = lay.tp
    if T == 1:
        return 0
    cfg = lay.cfg
    B, E, P, N = lay.batch, cfg.hidden_size, lay.seq // lay.cp, lay.loss_rows
    ar = 2 * (T - 1) / T  # all-reduce: reduce-scatter + all-gather
    ag = (T - 1) / T  # all-gather / reduce-scatter of a whole [B, P, E]
    rows = B * P * E
    # full recompute replays a block's forward up to its last kept input (checkpoint's early stop):
    # the collectives before the down projection (o_proj all-reduce; or gather, scatter, gather)
    replay = lay.ac == "full"
    if lay.dims.sequence_parallel:
        blocks = cfg.num_layers * (8 + 3 * replay) * ag * rows
        outside = ar * rows + ag * rows + ag * rows  # embedding all-reduce and its backward gather, final gather
        norms = (2 * cfg.num_layers + 1) * ar * E
    else:
        blocks = cfg.num_layers * (2 + 5 + replay) * ar * rows
        outside = ar * rows
        norms = 0
    ce = ar * (N * E + 3 * N)
    return round((blocks + outside + norms + ce) * F32)


def _cp_bytes(lay: Layout) -> int:
    if lay.cp == 1:
        return 0
    cfg = lay.cfg
    kv = 2 * lay.batch * (cfg.kv_heads // lay.tp) * (lay.seq // lay.cp) * cfg.dim_per_head * F32
    passes = 2 + (lay.ac != "none")  # all-gather forward, reduce-scatter backward (+ the recompute's gather)
    return cfg.num_layers * passes * (lay.cp - 1) * kv


def _ep_bytes(lay: Layout) -> int:
    ep = lay.dims.ep
    if ep == 1:
        return 0
    cfg = lay.cfg
    A = lay.batch * lay.seq * cfg.num_experts_per_tok
    rows = 4 * A * (ep - 1) / ep * cfg.hidden_size * F32  # dispatch and return, forward and backward
    counts = (ep - 1) / ep * cfg.num_experts * I64
    return round(cfg.num_layers * (rows + counts))


# --------------------------------------------------------------------------------------------------
# measurement


# collective op -> (what it sends, its argument that holds the data); see `_sent_bytes`
_COLLECTIVES: dict[str, tuple[str, str]] = {
    # torch.distributed (c10d ops): FSDP2, context and expert parallelism, the chunked cross-entropy
    "_allgather_base_": ("gather", "input_tensor"),
    "allgather_": ("gather", "input_tensors"),
    "allgather_coalesced_": ("gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("gather", "inputs"),
    "_reduce_scatter_base_": ("scatter", "input_tensor"),
    "reduce_scatter_": ("scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("scatter", "inputs"),
    "allreduce_": ("reduce", "tensors"),
    "allreduce_coalesced_": ("reduce", "tensors"),
    "alltoall_base_": ("exchange", "input"),
    "alltoall_": ("exchange", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("p2p", "tensors"),
    "recv_": ("none", "tensors"),
    # functional collectives (DTensor: tensor parallelism), and their autograd variants
    "all_gather_into_tensor": ("gather", "input"),
    "all_gather_into_tensor_coalesced": ("gather", "inputs"),
    "reduce_scatter_tensor": ("scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("scatter", "inputs"),
    "all_reduce": ("reduce", "input"),
    "all_reduce_coalesced": ("reduce", "inputs"),
    "all_to_all_single": ("exchange", "input"),
    "broadcast": ("broadcast", "input"),
}
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


class CollectiveMeter(TorchDispatchMode):
    """Bytes this rank sends per axis and phase, from every collective it issues: torch.distributed's
    (c10d ops) and the functional collectives DTensor issues. A DTensor op is passed on to DTensor
    (NotImplemented), whose collectives on local tensors then come back here. Each collective's
    process group is read from its arguments and looked up in `axes` (`axis_groups`)."""

    def __init__(self, axes: dict[Any, str]) -> None:
        super().__init__()
        self.axes = axes
        self.phase = "setup"
        self.sent: dict[str, dict[str, float]] = {}
        self.calls: dict[str, int] = {}
        self.received_rows = 0
        """Rows this rank received through all-to-alls with split sizes in the forward (expert dispatch
        and return)."""

    @contextlib.contextmanager
    def during(self, phase: str):
        self.phase = phase
        try:
            yield
        finally:
            self.phase = "setup"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in _NAMESPACES and func._schema.name.split("::")[1] not in _NOT_COLLECTIVES:
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        op = func._schema.name.split("::")[1]
        named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
        group = named.get("process_group", named.get("group_name"))
        if isinstance(group, str):
            pg = dist.distributed_c10d._resolve_process_group(group)
        else:
            pg = torch._C._distributed_c10d.ProcessGroup.unbox(group)
        axis = self.axes.get(pg.group_name) or self.axes.get(tuple(dist.get_process_group_ranks(pg)), "other")
        kind = _COLLECTIVES[op][0]
        if "|" in axis:  # one group of ranks serves two axes: an all-to-all is expert traffic
            axis = "ep" if kind == "exchange" and "ep" in axis else axis.split("|")[0]
        per = self.sent.setdefault(axis, {})
        per[self.phase] = per.get(self.phase, 0.0) + _sent_bytes(op, named, pg.size(), pg.rank())
        key = f"{axis}:{self.phase}:{op}"
        self.calls[key] = self.calls.get(key, 0) + 1
        if kind == "exchange" and self.phase == "forward" and named.get("output_split_sizes"):
            self.received_rows += sum(named["output_split_sizes"])


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x)  # a list (of lists) of tensors


def _sent_bytes(op: str, args: dict, n: int, rank: int) -> float:
    """What this rank puts on the wire with a bandwidth-optimal algorithm (ring or direct), n ranks:
    all-gather (n-1) x its input; reduce-scatter (n-1)/n x its input; all-reduce 2 (n-1)/n x the
    tensor (a reduce-scatter and an all-gather); all-to-all its rows for the other ranks; broadcast
    (n-1)/n x the tensor (a pipelined chain, per rank); send the tensor."""
    kind, name = _COLLECTIVES[op]
    data = args[name]
    if n == 1 or kind == "none":
        return 0.0
    if kind == "exchange":
        if isinstance(data, torch.Tensor):
            splits = args.get("input_split_sizes") or [data.shape[0] // n] * n
            row = data[:1].numel() * data.element_size()
            return float((sum(splits) - splits[rank]) * row)
        return float(_nbytes(data) - _nbytes(data[rank]))
    factor = {"gather": n - 1, "scatter": (n - 1) / n, "reduce": 2 * (n - 1) / n, "broadcast": (n - 1) / n}
    return factor.get(kind, 1) * _nbytes(data)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def axis_groups(dims: ParallelDims, meshes, cp_group) -> dict[Any, str]:
    """Process group name, and tuple of world ranks, -> the axis it carries (names joined by | when one
    group of ranks serves two axes). The ranks catch the groups DTensor and FSDP2 make for sub-meshes
    of their own (a tensor-parallel weight's mesh seen through FSDP2 has other group names)."""
    axes: dict[Any, list[str]] = {}

    def add(group, axis: str) -> None:
        if group is not None and dist.get_world_size(group) > 1:
            for key in (group.group_name, tuple(dist.get_process_group_ranks(group))):
                axes.setdefault(key, []).append(axis)

    if meshes is not None:
        if meshes.fsdp.ndim == 1:
            add(meshes.fsdp.get_group(), "fsdp")
        add(meshes.tp.get_group(), "tp")
        if meshes.ep is not None:
            add(meshes.ep["edp"].get_group(), "fsdp")
            add(meshes.ep["ep"].get_group(), "ep")
    add(cp_group, "cp")
    return {key: "|".join(dict.fromkeys(a)) for key, a in axes.items()}


def _global_batch(dp: int) -> Batch:
    rows = BATCH * dp
    tokens = torch.randint(0, VOCAB - 3, (rows, SEQ), generator=torch.Generator().manual_seed(7))
    return Batch(tokens, torch.ones(rows, SEQ, dtype=torch.bool), torch.arange(rows))


def _rows(batch: Batch, rows: slice) -> Batch:
    return Batch(batch.tokens_BL[rows], batch.loss_mask_BL[rows], batch.sample_ids_B[rows])


def measure_case(rank: int, world: int, case: Case) -> dict:
    """One training step of `case` on this rank, assembled as training does; its memory, traffic and
    the analytic estimates of its layout."""
    cfg = model_config(case)
    topo = TopologyConfig(nproc_per_node=world, **case.topology)
    dims = ParallelDims.from_topology(topo, world)
    meshes = dims.build_meshes(torch.device("cpu"))
    cp_group = dims.build_cp_group(rank) if world > 1 else None
    plan = None
    if dims.group > 1:
        ctx = topo.context
        plan = build_plan(
            ctx.mode, SEQ, None, ctx.cp_size, ctx.bp_size, dims.group_rank(rank), ctx.schedule, "sequence"
        )
    reference = Transformer(cfg)
    reference.init_weights(torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = Transformer(cfg)
    model = apply_parallelism(model, dims, meshes, topo, False, plan, cp_group, activation_checkpointing=case.ac)
    materialize(model, reference.state_dict() if rank == 0 else {}, torch.device("cpu"), DistEnv(rank, rank, world))
    model = after_materialize(model, meshes, topo)
    optimizer = build_optimizer(model, OptimizerConfig())

    obj = MDLMObjective(MDLMConfig(), IDS)
    batch = _global_batch(dims.dp)
    scale = dims.grad_ranks / obj.normalizer(batch)  # the trainer's: FSDP averages over grad_ranks
    d = dims.dp_index(rank)
    inputs = obj.prepare(_rows(batch, slice(d * BATCH, (d + 1) * BATCH)), NoiseKeys(0, batch.tokens_BL.shape[0]))
    if plan is not None:
        inputs = plan.shard(inputs)
    lay = Layout(cfg, dims, case.ac, BATCH, SEQ, int((inputs.weights_BL > 0).sum()))

    meter = CollectiveMeter(axis_groups(dims, meshes, cp_group))
    held: dict[str, torch.Tensor] = {}

    def forward_loss() -> torch.Tensor:
        out = run_model(model, inputs)
        loss = obj.loss(out, inputs).loss_sum * scale
        aux = out.aux.get("router_loss")
        held["loss"] = loss if aux is None else loss + AUX_COEF * aux
        return held["loss"]

    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    with meter:
        with meter.during("forward"):
            activation = saved_activation_bytes(forward_loss, exclude=model)
        with meter.during("backward"):
            held.pop("loss").backward()
        with meter.during("optimizer"):
            optimizer.step()
    step_s = time.perf_counter() - start
    params = list(model.parameters())
    states = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    measured = {
        "param": _bytes(params),
        "grad": _bytes(p.grad for p in params),
        "optimizer": _bytes(states),
        "activation": activation,
    }
    sent = {axis: {ph: round(v) for ph, v in phases.items()} for axis, phases in meter.sent.items()}
    return {
        "measured": measured,
        "analytic": analytic_memory(lay),
        "sent": sent,
        "analytic_sent": analytic_comm(lay),
        "calls": meter.calls,
        "received_rows": meter.received_rows,
        "loss_rows": lay.loss_rows,
        "step_s": step_s,
    }


def _worker(rank: int, world: int, cases: dict[str, Case], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name, case in cases.items():
        results[name] = measure_case(rank, world, case)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    os._exit(0)  # leave without tearing gloo down from Python (see training/run.py `_keep_until_exit`)


def run_world(world: int, cases: dict[str, Case]) -> dict[str, list[dict]]:
    """Every case of one world size in one spawn of gloo processes: per case, the ranks' results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(world, cases, port, str(out)), nprocs=world, join=True)
        ranks = json.loads(out.read_text())
    return {name: [r[name] for r in ranks] for name in cases}


QUANTITIES = ("param", "grad", "optimizer", "activation")
AXES = ("fsdp", "tp", "cp", "ep")
NOTES = {
    "ep2-moe": (
        "expert rows depend on routing: the activation and ep estimates assume uniform routing (each "
        "owner receives A = B L K rows per layer, (ep-1)/ep of every rank's rows cross); "
        "received_over_uniform is what the router did"
    ),
}


def _entry(measured: list[float], analytic: list[float]) -> dict:
    """Rank 0's measured and analytic values and their ratio; the max over ranks and the worst ratio
    when the ranks differ."""
    ratios = [m / a if a else (1.0 if m == 0 else math.inf) for m, a in zip(measured, analytic, strict=True)]
    out = {"measured": round(measured[0]), "analytic": round(analytic[0]), "ratio": round(ratios[0], 4)}
    if len(set(measured)) > 1 or len(set(analytic)) > 1:
        worst = max(ratios, key=lambda r: abs(r - 1))
        out |= {
            "measured_max": round(max(measured)),
            "analytic_max": round(max(analytic)),
            "worst_ratio": round(worst, 4),
        }
    return out


def summarize(name: str, ranks: list[dict]) -> dict:
    """One topology's JSON: memory and sent bytes per axis (measured, analytic, ratio) and notes."""
    case = CASES[name]
    row: dict[str, Any] = {"world": case.world, "topology": case.topology, "moe": case.moe, "ac": case.ac}
    row["loss_rows"] = [r["loss_rows"] for r in ranks]
    row["memory"] = {
        q: _entry([r["measured"][q] for r in ranks], [r["analytic"][q] for r in ranks]) for q in QUANTITIES
    }
    sent = {}
    for axis in [*AXES, "other"]:
        measured = [sum(r["sent"].get(axis, {}).values()) for r in ranks]
        analytic = [r["analytic_sent"].get(axis, 0) for r in ranks]
        if any(measured) or any(analytic):
            sent[axis] = _entry(measured, analytic) | {k: round(v) for k, v in ranks[0]["sent"].get(axis, {}).items()}
    row["sent_bytes"] = sent
    notes = [NOTES[name]] if name in NOTES else []
    if case.moe and case.topology.get("ep_size", 1) > 1:
        cfg = model_config(case)
        A = BATCH * SEQ * cfg.num_experts_per_tok
        # the forward's all-to-alls per layer: the dispatch brings R rows, the return the rank's own A
        row["received_over_uniform"] = [round((r["received_rows"] / cfg.num_layers - A) / A, 4) for r in ranks]
    off = [
        f"{k}: {v.get('worst_ratio', v['ratio'])}"
        for k, v in [*row["memory"].items(), *sent.items()]
        if abs(v.get("worst_ratio", v["ratio"]) - 1) > TOLERANCE
    ]
    if off:
        notes.append("outside 10%: " + ", ".join(off))
    if notes:
        row["note"] = "; ".join(notes)
    row["step_s"] = round(max(r["step_s"] for r in ranks), 3)
    return row


def summary(topologies: dict[str, dict]) -> dict:
    """Worst relative error of each quantity over the topologies and ranks, and the activation ratios
    of selective and full checkpointing to none."""
    errors: dict[str, float] = {}
    for row in topologies.values():
        for key, entry in [*row["memory"].items(), *((f"sent_{a}", e) for a, e in row["sent_bytes"].items())]:
            err = abs(entry.get("worst_ratio", entry["ratio"]) - 1)
            errors[key] = round(max(errors.get(key, 0.0), err), 4)
    out: dict[str, Any] = {"max_rel_error": errors, "all_within_10pct": all(e <= TOLERANCE for e in errors.values())}
    ratios = {}
    for base in ("1proc", "dp2xtp2"):
        if base in topologies and all(f"{base}-{m}" in topologies for m in ("selective", "full")):
            none = topologies[base]["memory"]["activation"]
            ratios[base] = {
                m: {
                    "measured": round(
                        topologies[f"{base}-{m}"]["memory"]["activation"]["measured"] / none["measured"], 4
                    ),
                    "analytic": round(
                        topologies[f"{base}-{m}"]["memory"]["activation"]["analytic"] / none["analytic"], 4
                    ),
                }
                for m in ("selective", "full")
            }
    out["activation_vs_none"] = ratios
    return out


def run(names: list[str]) -> dict:
    """Measure the named topologies (one spawn per world size) and build the bench's JSON."""
    chosen = {n: CASES[n] for n in names}
    raw: dict[str, list[dict]] = {}
    for world in sorted({c.world for c in chosen.values()}):
        raw.update(run_world(world, {n: c for n, c in chosen.items() if c.world == world}))
    topologies = {name: summarize(name, raw[name]) for name in names}
    return {"bench": "parallel_memory", "topologies": topologies, "summary": summary(topologies)}


def _report(result: dict) -> None:
    """A human-readable table on stderr."""
    for name, row in result["topologies"].items():
        cells = [f"{k}={v.get('worst_ratio', v['ratio'])}" for k, v in row["memory"].items()]
        cells += [f"sent_{k}={v.get('worst_ratio', v['ratio'])}" for k, v in row["sent_bytes"].items()]
        act = row["memory"]["activation"]["measured"] / 2**20
        print(f"{name:18s} act {act:6.2f} MiB  measured/analytic: {' '.join(cells)}", file=sys.stderr)
        if "note" in row:
            print(f"{'':18s} note: {row['note']}", file=sys.stderr)
    print(json.dumps(result["summary"], indent=1), file=sys.stderr)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES), help="topologies (default: all)")
    args = p.parse_args(argv)
    result = run(args.cases)
    _report(result)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
