"""Byte and shape counters of bench/context_parallel.py: they wrap the collectives and attention calls of
dllm.parallel.context_attention (all-gather, reduce-scatter, the ring's batch_isend_irecv, the routed
exchange's all_to_all_single) in one process and record what each call sends.

A collective's sent bytes are what any bandwidth-optimal algorithm puts on the wire per rank: all-gather
(n-1) x its input, reduce-scatter (n-1)/n x its input; batch_isend_irecv the isend tensors;
all_to_all_single its input (the routed exchange never sends to itself).
"""

from __future__ import annotations

import torch.distributed as dist

from dllm.parallel import context_attention


class Counters:
    """Wraps the two collectives and the ring's batch_isend_irecv that context_attention.py calls; records
    (phase, kind, group size, sent bytes), and the attention calls' shapes."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.records: list[tuple[str, str, int, int]] = []
        self.attention: list[dict[str, int]] = []

    def install(self) -> None:
        gather, scatter = context_attention._ALL_GATHER, context_attention._REDUCE_SCATTER
        attend, partial = context_attention.sharded_attention, context_attention.partial_attention
        p2p, to_all = context_attention._BATCH_ISEND_IRECV, context_attention._ALL_TO_ALL

        def all_to_all(out, inp, *args, group=None, **kw):  # the routed exchange: every row sent goes to a peer
            n, sent = dist.get_world_size(group), inp.numel() * inp.element_size()
            self.records.append((self.phase, "all_to_all", n, sent))
            return to_all(out, inp, *args, group=group, **kw)

        def batch_isend_irecv(ops):
            sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            self.records.append((self.phase, "p2p", len(ops), sent))
            return p2p(ops)

        def partial_attention(q_BHQD, k_BKSD, *args, **kw):  # one ring step (forward, and its recompute)
            B, H, Q, D = q_BHQD.shape
            self.attention.append({"B": B, "H": H, "K": k_BKSD.shape[1], "Q": Q, "S": k_BKSD.shape[2], "D": D})
            return partial(q_BHQD, k_BKSD, *args, **kw)

        def all_gather(out, inp, *args, group=None, **kw):
            n = dist.get_world_size(group)
            self.records.append((self.phase, "all_gather", n, (n - 1) * inp.numel() * inp.element_size()))
            return gather(out, inp, *args, group=group, **kw)

        def reduce_scatter(out, inp, *args, group=None, **kw):
            n = dist.get_world_size(group)
            self.records.append((self.phase, "reduce_scatter", n, (n - 1) * inp.numel() * inp.element_size() // n))
            return scatter(out, inp, *args, group=group, **kw)

        def sharded_attention(q_BHQD, k_BKSD, *args, **kw):
            B, H, Q, D = q_BHQD.shape
            self.attention.append({"B": B, "H": H, "K": k_BKSD.shape[1], "Q": Q, "S": k_BKSD.shape[2], "D": D})
            return attend(q_BHQD, k_BKSD, *args, **kw)

        context_attention._ALL_GATHER, context_attention._REDUCE_SCATTER = all_gather, reduce_scatter
        context_attention.sharded_attention = sharded_attention
        context_attention._BATCH_ISEND_IRECV, context_attention.partial_attention = batch_isend_irecv, partial_attention
        context_attention._ALL_TO_ALL = all_to_all

    def reset(self) -> None:
        self.phase, self.records, self.attention = "forward", [], []

    def sent(self, phase: str) -> tuple[int, int]:
        """(bytes, calls) of one phase."""
        hits = [r for r in self.records if r[0] == phase]
        return sum(r[3] for r in hits), len(hits)
