"""Edit Flows batching: what a batch of 16 buys over one row, in training and in sampling.

In one process, on the editflow-smoke shapes (byte-tokenised sums "12 + 7 =" -> " 19" + EOS, rows of
16, the tiny preset with the edit head unless --preset says otherwise), interleaved per round:
- training: one optimizer step of the edit_flow objective (prepare: alignment, x_t, the remaining
  edits; forward; loss; backward; AdamW) at micro-batch 16 and at 1, as supervised tokens per second;
- sampling: `sample_edit_flow` (--steps tau-leaping steps) of 16 prompts at once and of one prompt,
  as sequences per second; the batched outputs are checked equal to the one-row ones (same seeds);
- the ceiling of each: the plain model forward + backward (training) and forward (sampling) on the
  same shapes, with no edit-flow logic. On a CPU with 2 cores a batch of 16 rows is not 16 times
  cheaper per row than one row: when the plain model's ratio is below the target, that is the most
  this machine allows, and the edit-flow ratio is read against it.
Ratios are medians over rounds; one JSON line with the targets (training >= 6x per token, sampling
>= 4x per sequence) and whether they are met.

    python bench/edit_flows.py [--rounds 7] [--steps 16] [--preset tiny] [--run RUN]

--run RUN samples from a trained run (e.g. runs/editflow-smoke) instead of a random model, so the
edits per step are those of a real answer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.data import TokenizerConfig
from dllm.config.model import ModelConfig
from dllm.config.objectives import EditFlowConfig
from dllm.data.loader import Batch
from dllm.data.synthetic import addition_example
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import TokenIds
from dllm.diffusion.objectives.edit_flow import EditFlowObjective
from dllm.models import Transformer
from dllm.sampling.edit_flow import sample_edit_flow
from dllm.tokenization import build_tokenizer

SEQ = 16
BIG, SMALL = 16, 1
TRAIN_TARGET, SAMPLE_TARGET = 6.0, 4.0


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def sums_batch(tok, ids: TokenIds, rng: random.Random, rows: int, offset: int) -> Batch:
    """Rows of prompt + completion + EOS (the completion and EOS supervised), padded to SEQ."""
    tokens = torch.full((rows, SEQ), ids.pad_id)
    sup = torch.zeros(rows, SEQ, dtype=torch.bool)
    for r in range(rows):
        ex = addition_example(rng, 19)
        p, c = tok.encode(ex["prompt"]), [*tok.encode(ex["completion"]), ids.eos_id]
        tokens[r, : len(p) + len(c)] = torch.tensor(p + c)
        sup[r, len(p) : len(p) + len(c)] = True
    return Batch(tokens, sup, torch.arange(offset, offset + rows))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--run", type=Path, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    tok = build_tokenizer(TokenizerConfig(kind="byte"))
    ids = TokenIds(mask_id=tok.mask_id, eos_id=tok.eos_id, pad_id=tok.pad_id, num_tokens=tok.vocab_size)
    if a.run is not None:
        from dllm.checkpoint.loading import load_for_inference

        sampler_model = load_for_inference(a.run).model
    else:
        sampler_model = None
    cfg = ModelConfig(preset=a.preset, vocab_size=320, edit_head=True, attention_backend="sdpa")
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    sampler_model = sampler_model or model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    obj = EditFlowObjective(EditFlowConfig(), ids)
    rng = random.Random(0)
    batches = {n: [sums_batch(tok, ids, rng, n, 1000 * i) for i in range(4)] for n in (BIG, SMALL)}

    def train_step(n: int, i: int, update: bool = True) -> int:
        """One micro-batch of n rows (forward, loss, backward), then the optimizer step when `update`."""
        batch = batches[n][i % 4]
        inp = obj.prepare(batch, NoiseKeys(i, n))
        obj.loss(model(inp.tokens_BL, inp.positions_BL, inp.mask), inp).loss_sum.backward()
        if update:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return batch.num_targets

    def accumulated(i: int) -> int:  # 16 micro-batches of one row, one optimizer step (the same global batch)
        return sum(train_step(SMALL, i * BIG + j, update=j == BIG - 1) for j in range(BIG))

    def plain_step(n: int, i: int) -> None:  # the same rows through the bare model: no alignment, no edit loss
        batch = batches[n][i % 4]
        L = batch.tokens_BL.shape[1]
        out = model(batch.tokens_BL, torch.arange(L).expand(n, L), AttentionMask("bidirectional"))
        out.hidden_BLE.square().mean().backward()
        opt.zero_grad(set_to_none=True)

    prompts = [tok.encode(addition_example(rng, 19)["prompt"]) for _ in range(BIG)]

    def sample(rows: list[list[int]], seeds: list[int]):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return sample_edit_flow(sampler_model, rows, num_steps=a.steps, anchor_id=ids.mask_id, pad_id=ids.pad_id,
                                num_tokens=ids.num_tokens, max_new_tokens=8, generators=gens,
                                temperature=0.0)  # fmt: skip

    sampler_model.eval()

    @torch.no_grad()
    def plain_forward(n: int) -> None:
        width = 4 + max(map(len, prompts))  # anchor + prompt + a 3-token answer
        rows = torch.full((n, width), ids.pad_id)
        for b in range(n):
            rows[b, : 4 + len(prompts[b])] = torch.tensor([ids.mask_id, *prompts[b], 0, 0, 0])
        L = rows.shape[1]
        for _ in range(a.steps):
            sampler_model(rows, torch.arange(L).expand(n, L), AttentionMask("bidirectional"))

    for i in range(2):  # warm-up
        train_step(BIG, i), accumulated(i), plain_step(BIG, i), plain_step(SMALL, i)
    train_r, plain_r, sample_r, fwd_r = [], [], [], []
    edits = answers = 0
    for rnd in range(a.rounds):
        t0 = time.perf_counter()
        tok_big = train_step(BIG, rnd)
        t_big = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok_small = accumulated(rnd)
        t_small = time.perf_counter() - t0
        train_r.append((tok_big / t_big) / (tok_small / t_small))
        t_big = timed(lambda r=rnd: plain_step(BIG, r))
        t_small = timed(lambda r=rnd: [plain_step(SMALL, r * BIG + j) for j in range(BIG)])
        plain_r.append(t_small / t_big)  # the same rows either way: time ratio = per-token throughput ratio
        seeds = list(range(rnd * BIG, (rnd + 1) * BIG))
        t0 = time.perf_counter()
        out = sample(prompts, seeds)
        t_big = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = [sample([p], [s]) for p, s in zip(prompts, seeds, strict=True)]
        t_small = time.perf_counter() - t0
        assert out.completions == [r.completions[0] for r in rows], "batched sampling differs from one row at a time"
        sample_r.append(t_small / t_big)  # 16 sequences each way
        edits, answers = edits + sum(out.edits_per_step), answers + BIG
        fwd_r.append(timed(lambda: [plain_forward(SMALL) for _ in range(BIG)]) / timed(lambda: plain_forward(BIG)))
    runs = {"train": train_r, "train_ceiling": plain_r, "sample": sample_r, "sample_ceiling": fwd_r}
    med = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    print(json.dumps({
        "bench": "edit_flows", "preset": a.preset, "rows": f"{BIG} vs {SMALL}", "seq_len": SEQ, "steps": a.steps,
        "sampler_model": str(a.run) if a.run else "random", "rounds": a.rounds, "threads": torch.get_num_threads(),
        "train_tokens_per_s_ratio": med["train"], "train_target": TRAIN_TARGET,
        "train_met": med["train"] >= TRAIN_TARGET,
        "train_ceiling_plain_fwd_bwd_ratio": med["train_ceiling"],
        "sample_seqs_per_s_ratio": med["sample"], "sample_target": SAMPLE_TARGET,
        "sample_met": med["sample"] >= SAMPLE_TARGET,
        "sample_ceiling_plain_fwd_ratio": med["sample_ceiling"],
        "edits_per_answer": round(edits / answers, 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
