"""Tensor and sequence parallelism of the native Transformer, with DTensor
(torch.distributed.tensor.parallel), applied from outside: the model code stays single-device.

Layout over a 1-D tensor-parallel mesh of T ranks (Megatron-LM, Shoeybi et al. 2019; sequence
parallelism: Korthikanti et al. 2022):
- q/k/v, gate and up projections column-wise (each rank computes H/T query heads, K/T key/value
  heads and mlp_size/T of the MLP width); the output and down projections row-wise, so each block
  needs one all-reduce (or, with sequence parallelism, one reduce-scatter) after attention and one
  after the MLP, and one all-gather before each (sequence parallel) in forward, mirrored in backward;
- the token embedding vocabulary-parallel (rows of the table sharded; the partial lookups summed);
  the output head's weight sharded by vocabulary too (the tied embedding is that same table), and
  the cross-entropy of models/chunked_ce.py computes the softmax over the sharded vocabulary with
  three small all-reduces per chunk, so full logits never exist on any rank;
- with sequence parallelism, the norms and the residual stream between blocks hold L/T positions
  per rank; the embedding output is split after the learned positions and the embedding norm are
  added, and the final norm's output is gathered back, so the objective sees whole sequences.

Norm weights, learned positions, biases of row-wise layers and everything not listed stay
replicated; their gradients are the same on every rank of the group (DTensor reduces the partial
input gradients of the column-wise layers).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a dllm.models.Transformer, dense MLPs) in place over `tp_mesh`. The sizes were
    checked by config.rules.check_tensor_parallel: T divides the heads, key/value heads, the MLP width
    and the vocabulary, and (sequence parallel) the rows of every rank's input."""
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    parallelize_module(model, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if model.lm_head is not None:  # untied head: its weight is read by `head()`, sharded by vocabulary
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel()})
    for block in model.layers:
        plan: dict = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if block.mlp.gate_proj is None:
            del plan["mlp.gate_proj"]
        if sequence_parallel:
            # norms on L/T rows; attention and MLP gather their input once (one DTensor flows into
            # all of q/k/v, so the backward reduce-scatters the three input gradients together)
            none4 = (None,) * 4
            plan |= {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_layouts=(Shard(1), *none4), desired_input_layouts=(Replicate(), *none4)
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        none4 = (None,) * 4
        parallelize_module(
            model.layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), *none4), desired_input_layouts=(Shard(1), *none4), use_local_output=True
            ),
        )
        parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})
        parallelize_module(
            model,
            tp_mesh,
            {"norm": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())},
        )
        model.trim_last_block = False  # a rank's rows are not the first `num_outputs` positions
