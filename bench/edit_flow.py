"""Edit Flows: the batched alignment against a per-pair Python dynamic programme, and batched
tau-leaping against one row at a time (the same outputs, checked), both interleaved per round; the
ratios are medians over rounds. Also the edit_flow objective's prepare + loss time against MDLM's on
the same batch (the alignment and the variable-length rows are its overhead).

    python bench/edit_flow.py [--pairs 256] [--length 32] [--rows 8] [--steps 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from dllm.config.model import ModelConfig
from dllm.config.objectives import EditFlowConfig, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.edit_alignment import align, num_edits
from dllm.diffusion.objectives import MDLMObjective, TokenIds
from dllm.diffusion.objectives.edit_flow import EditFlowObjective
from dllm.models import Transformer
from dllm.sampling.edit_flow import sample_edit_flow

V = 64
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V - 3)


def levenshtein(a: list[int], b: list[int]) -> int:
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    rng = random.Random(0)
    x0 = torch.tensor([[rng.randrange(8) for _ in range(a.length)] for _ in range(a.pairs)])
    x1 = torch.tensor([[rng.randrange(8) for _ in range(a.length)] for _ in range(a.pairs)])
    lens = torch.full((a.pairs,), a.length)
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, edit_head=True, attention_backend="sdpa")).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    prompts = [[rng.randrange(V - 3) for _ in range(rng.randrange(1, 9))] for _ in range(a.rows)]

    def sample(rows, seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return sample_edit_flow(model, rows, num_steps=a.steps, anchor_id=IDS.mask_id, pad_id=IDS.pad_id,
                                num_tokens=IDS.num_tokens, max_new_tokens=24, generators=gens)  # fmt: skip

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V - 3, (a.rows, 64), generator=g)
    batch = Batch(tokens, (torch.arange(64) >= 8).expand(a.rows, 64).clone(), torch.arange(a.rows))
    ef, mdlm = EditFlowObjective(EditFlowConfig(x0="uniform"), IDS), MDLMObjective(MDLMConfig(), IDS)

    def step(obj):
        inp = obj.prepare(batch, NoiseKeys(0, a.rows))
        obj.loss(model(inp.tokens_BL, inp.positions_BL, inp.mask), inp).loss_sum.backward()

    align_r, sample_r, loss_r = [], [], []
    nfe = edits = 0
    for _ in range(a.rounds):
        t_b, (z0, z1, _) = timed(lambda: align(x0, lens, x1, lens))
        t_p, ref = timed(lambda: [levenshtein(r0, r1) for r0, r1 in zip(x0.tolist(), x1.tolist(), strict=True)])
        assert num_edits(z0, z1).tolist() == ref
        align_r.append(t_p / t_b)
        t_b, out = timed(lambda: sample(prompts, range(a.rows)))
        t_p, rows = timed(lambda: [sample([q], [s]) for s, q in enumerate(prompts)])
        assert out.completions == [r.completions[0] for r in rows]
        sample_r.append(t_p / t_b)
        nfe, edits = out.nfe, sum(out.edits_per_step)
        t_e, _ = timed(lambda: step(ef))
        t_m, _ = timed(lambda: step(mdlm))
        loss_r.append(t_e / t_m)
    print(json.dumps({
        "bench": "edit_flow", "pairs": a.pairs, "length": a.length, "rows": a.rows, "steps": a.steps,
        "align_python_over_batched": round(statistics.median(align_r), 2),
        "sample_per_row_over_batched": round(statistics.median(sample_r), 2),
        "train_step_edit_flow_over_mdlm": round(statistics.median(loss_r), 2),
        "nfe": nfe, "edits_per_forward": round(edits / max(nfe, 1), 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
