"""Expert parallelism (EP): all_to_all traffic and step time against one process.

`--world` gloo CPU processes (one intra-op thread each) form one ep group; each trains one MDLM
step of a qwen3_moe Transformer (fp32) on its own `batch / world` rows through
`dllm.parallel.expert`, with `torch.distributed.all_to_all_single` wrapped by a counter that adds up
the bytes a rank sends to the OTHER ranks (its own chunk stays local), per kind of message:
`rows` (token rows out and expert results back, forward and the reverse exchange in the backward)
and `counts` (rows per expert, sent to each expert's owner).

- `formula_bytes`: rows a rank sends per step if routing is uniform, per MoE layer:
  2 directions (dispatch, return) x N x K x E x dtype bytes x (ep-1)/ep, N = tokens of the rank,
  K = top_k, E = hidden; forward only (`forward`) and with the backward's reverse exchange
  (`forward_backward` = twice that), times the layers. `measured_over_formula` compares the
  measured rows with the forward+backward formula (routing is not exactly uniform).
- `step_s`: median forward+backward time of an EP step (the slowest rank) and of one process on the
  whole batch (this process, one thread), and their ratio. On a CPU with fewer cores than ranks the
  ratio says little about a GPU cluster; the bytes are what carries over.

The default shape is the one of tests/distributed/test_expert_parallel.py.

    python bench/expert_parallel.py [--world 2] [--batch 4] [--seq-len 16] [--hidden 64] [--experts 4]

Shapes: N tokens of a rank, K experts per token, E hidden, X experts.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dllm.config.model import ModelConfig
from dllm.config.objectives import MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.expert import apply_expert_parallel

VOCAB = 64
IDS = TokenIds(mask_id=VOCAB - 1, eos_id=VOCAB - 2, pad_id=VOCAB - 3, num_tokens=VOCAB)
DTYPE_BYTES = 4


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        family="qwen3_moe", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_size,
        vocab_size=VOCAB, attention_backend="sdpa",
    )  # fmt: skip


def batch(args: argparse.Namespace, rows: slice) -> Batch:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB - 3, (args.batch, args.seq_len), generator=g)
    sup = torch.ones_like(tokens, dtype=torch.bool)
    return Batch(tokens[rows], sup[rows], torch.arange(args.batch)[rows])


def timed_steps(model: Transformer, rows: Batch, args: argparse.Namespace, on_step=None) -> list[float]:
    """Forward + backward `args.steps` times after one warm-up; seconds per step."""
    obj = MDLMObjective(MDLMConfig(), IDS)
    inputs = obj.prepare(rows, NoiseKeys(0, args.batch))
    times = []
    for i in range(args.steps + 1):
        if on_step is not None:
            on_step(i)
        start = time.perf_counter()
        out = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask)
        (obj.loss(out, inputs).loss_sum + 0.01 * out.aux["router_loss"]).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times[1:]


class Counter:
    """Wraps all_to_all_single: bytes this rank sends to other ranks, per message kind, in one step."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {"rows": 0, "counts": 0}
        self.enabled = False
        self.inner = dist.all_to_all_single

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if self.enabled:
            size, me = dist.get_world_size(group), dist.get_rank(group)
            splits = input_split_sizes or [input.shape[0] // size] * size
            row_bytes = input[:1].numel() * input.element_size()
            kind = "counts" if input_split_sizes is None else "rows"
            self.sent[kind] += sum(n for r, n in enumerate(splits) if r != me) * row_bytes
        return self.inner(output, input, output_split_sizes, input_split_sizes, group=group, **kw)


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    mesh = dist.device_mesh.init_device_mesh("cpu", (args.world,), mesh_dim_names=("ep",))
    model = Transformer(model_config(args))
    model.init_weights(torch.Generator().manual_seed(0))
    apply_expert_parallel(model, mesh)
    counter = Counter()
    dist.all_to_all_single = counter  # the module attribute expert.py calls through `dist.`

    def count_first(i: int) -> None:
        counter.enabled = i == 1  # the first timed step
        dist.barrier()  # ranks start each step together: the time is the step's, not a straggler's wait

    per_rank = args.batch // args.world
    times = timed_steps(model, batch(args, slice(rank * per_rank, (rank + 1) * per_rank)), args, count_first)
    dist.all_to_all_single = counter.inner
    gathered: list = [None] * args.world
    dist.all_gather_object(gathered, {"sent": counter.sent, "times": times})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    os._exit(0)  # leave without tearing gloo down from Python (see training/run.py `_keep_until_exit`)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, port, str(out)), nprocs=args.world, join=True)
        ranks = json.loads(out.read_text())
    torch.set_num_threads(1)
    one = Transformer(model_config(args))
    one.init_weights(torch.Generator().manual_seed(0))
    one_s = statistics.median(timed_steps(one, batch(args, slice(None)), args))
    ep_s = statistics.median(max(step) for step in zip(*(r["times"] for r in ranks), strict=True))
    tokens = args.batch * args.seq_len // args.world
    forward = 2 * tokens * args.top_k * args.hidden * DTYPE_BYTES * (args.world - 1) / args.world * args.layers
    rows = [r["sent"]["rows"] for r in ranks]
    result = {
        "shape": {**vars(args), "tokens_per_rank": tokens, "dtype_bytes": DTYPE_BYTES},
        "sent_bytes_per_rank": [r["sent"] for r in ranks],
        "formula_bytes": {"forward": forward, "forward_backward": 2 * forward},
        "measured_over_formula": statistics.mean(rows) / (2 * forward),
        "step_s": {"ep": ep_s, "one_process": one_s},
        "ep_over_one_process": ep_s / one_s,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
