"""DFlash speculative decoding on CPU: acceptance (tau), target forwards per token, speed vs AR decoding.

Trains (or reuses from --work-dir) a causal target, 4 layers x 256 wide (objective ar), on the
demo-style corpus (sentences and sums, packed rows), and one 1-layer DFlash drafter per block size
b in --blocks (objective dflash_distillation, the target frozen; loss ce by default: the target's
greedy tokens, which greedy verification checks). As DFlash trains its drafters, their
text is what the target itself writes (--drafter-data regenerated): each corpus record cut after a
random number of words, continued by the target's greedy decoding to its EOS (the corpus itself, where
the target's greedy sums differ from the data's, costs 0.6-0.8 accepted tokens per round at b = 8).
Then, on held-out corpus prompts
(a record's first word), greedy decoding of up to --new-tokens tokens, a row ending at its EOS:

- `tau_offline`: the mean tokens gained per verify round, measured without a verify loop: the
  target's own greedy continuation S is computed once; each round the drafter proposes from the
  context of S before the anchor (extend/propose, its cached decoding path) and keeps the longest
  prefix equal to S, plus the target's token. Under greedy decoding this is exactly what the
  speculative loop accepts, so it cross-checks the loop's tau.
- with the causal loop (`dllm.sampling.generate` with a drafter, generation causal): tau,
  target forwards per generated token (`forwards_per_token_b1`: one prompt per call; `..._one_batch`:
  all prompts in one call, a forward counted once for its rows), and wall time against AR decoding with the KV cache
  (the same loop without a drafter) at batch 1 and 8: `speedup_b1` from the fastest call of each of
  --repeats interleaved rounds (the machine's quiet moments), `speedup_b1_median` the median of the
  per-round ratios (what a busy shared machine sees), plus whether the outputs equal AR's token for
  token (lossless).

- the same timing with a perfect drafter at the real one's cost (`speedup_b1_oracle_drafter`: every
  draft right, the drafter's forward still paid): the most any drafter of this size gains here.
- the CPU's ceiling for the pair (`step_costs`): one AR step, one verify forward of b tokens and one
  drafter round (extend + proposal) timed alone; tau x AR step / (verify + drafter) bounds the batch-1
  speedup; and where a batch-1 round's time goes (`phase_profile`: target forwards, drafter, the rest
  of the loop, microseconds per round).

One JSON line per block size, then a summary line with the targets (tau >= 3 at b = 8; >= 1.8x the
AR tokens/s at batch 1) and the ceilings.

    python bench/speculative.py [--work-dir /tmp/dllm-bench-speculative] [--blocks 4 8 12 16] [--retrain]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dllm.attention.masks import AttentionMask
from dllm.checkpoint.loading import load_drafter_run, load_for_inference
from dllm.config.loading import validate_config
from dllm.config.prepare import PrepareSpec
from dllm.config.sampler import SamplerConfig
from dllm.config.spec import RunSpec
from dllm.data.prepare import prepare
from dllm.inference.engine import generate
from dllm.models.capture import capture_layers
from dllm.models.dflash import DFlashDrafter
from dllm.recipes import demo_text, write_jsonl
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.causal import Target
from dllm.sampling.results import Counters, GenerationResult
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir

SEQ_LEN = 128
DEVICE = torch.device("cpu")  # --device: where the pair trains and decodes (timings synchronise a GPU)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def causal_sampler(tok, new_tokens: int) -> tuple[SamplerConfig, SpecialIds]:
    """Greedy causal decoding of up to `new_tokens` per row, a row ending at its EOS."""
    return SamplerConfig(generation="causal", gen_length=new_tokens), SpecialIds(tok.mask_id, tok.pad_id, tok.eos_id)


def decode(
    target, prompts: list[list[int]], decoding: tuple[SamplerConfig, SpecialIds], drafter=None
) -> GenerationResult:
    """AR decoding (no drafter) or speculative decoding through the one causal loop."""
    return generate(target, prompts, *decoding, drafter=drafter)


TARGET_LAYERS = [0, 1, 2, 3]


def build_data(work: Path) -> None:
    if (work / "prepared" / "manifest.json").is_file():
        return
    write_jsonl(work / "train.jsonl", demo_text(20000, seed=0))
    values = {"tokenizer": {"kind": "byte"}, "sources": [{"path": "train.jsonl"}], "output": "prepared",
              "seq_len": SEQ_LEN, "layout": "packed"}  # fmt: skip
    prepare(validate_config(PrepareSpec, values, source="bench", base_dir=work), work, overwrite=True)


def regenerate(work: Path, target_run: Path, num_records: int, max_new: int = 64, batch: int = 64) -> Path:
    """The drafter's training data as DFlash trains it: the target's own greedy continuations. Each of the
    first `num_records` corpus records is cut after a random number of its words (at least one) and the
    target continues it to its EOS; a record is prefix + continuation. Prepared into `prepared-regen`."""
    out = work / f"prepared-regen-{num_records}"
    if (out / "manifest.json").is_file():
        return out
    import random

    loaded = load_for_inference(run=target_run, device=DEVICE)
    target, tok = loaded.model, loaded.tokenizer
    rng = random.Random(1)
    prefixes = []
    for r in demo_text(num_records, seed=0):
        words = r["text"].split()
        prefixes.append(" ".join(words[: rng.randint(1, max(1, len(words) - 1))]) + " ")
    order = sorted(range(len(prefixes)), key=lambda i: len(prefixes[i]))  # batches of similar lengths
    texts = [""] * len(prefixes)
    decoding = causal_sampler(tok, max_new)
    t0 = time.perf_counter()
    for i in range(0, len(order), batch):
        rows = order[i : i + batch]
        result = decode(target, [tok.encode(prefixes[j]) for j in rows], decoding)
        for j, seq in zip(rows, result.sequences, strict=True):
            texts[j] = prefixes[j] + tok.decode(seq)
    print(f"# regenerated {len(texts)} records with the target in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    write_jsonl(work / f"regen-{num_records}.jsonl", [{"text": t} for t in texts])
    values = {"tokenizer": {"kind": "byte"}, "sources": [{"path": f"regen-{num_records}.jsonl"}], "output": out.name,
              "seq_len": SEQ_LEN, "layout": "packed"}  # fmt: skip
    prepare(validate_config(PrepareSpec, values, source="bench", base_dir=work), work, overwrite=True)
    return out


def train(work: Path, name: str, objective: dict[str, Any], steps: int, lr: float, model: dict | None,
          data: str = "prepared") -> Path:  # fmt: skip
    run = work / "runs" / name
    if (run / "checkpoints" / "latest").is_file():
        return run
    values = {
        "run": {"name": name, "output_dir": str(work / "runs")},
        **({"model": model} if model else {}),
        "tokenizer": {"kind": "byte"},
        "data": {"path": str(work / data), "seq_len": SEQ_LEN},
        "objective": objective,
        "training": {"steps": steps, "global_batch_size": 16, "micro_batch_size": 16, "device": DEVICE.type, "seed": 0},
        "optimizer": {"lr": lr},
        "scheduler": {"warmup_steps": 50},
        "checkpointing": {"every_steps": steps, "keep_last_n": 1},
        "logging": {"progress": "off", "tensorboard": "off", "every_steps": 50},
    }
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="bench", base_dir=work))
    t0 = time.perf_counter()
    losses = train_from_run_dir(prepare_run_dir(spec))
    print(f"# trained {name}: {steps} steps in {time.perf_counter() - t0:.0f}s, loss {losses[0]:.3f} -> "
          f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", file=sys.stderr)  # fmt: skip
    return run


def train_drafter(work: Path, target_run: Path, b: int, args: argparse.Namespace) -> Path:
    """The 1-layer DFlash drafter of block size b (trained once, then reused from the work folder)."""
    data, suffix = "prepared", f"-a{args.anchors}"
    if args.drafter_data == "regenerated":  # as DFlash trains: on what the target itself writes
        data, suffix = regenerate(work, target_run, args.regen_records).name, f"-regen{args.regen_records}"
    objective = {"name": "dflash_distillation", "target": str(target_run), "target_layer_ids": TARGET_LAYERS,
                 "block_size": b, "num_layers": 1, "num_anchors": args.anchors, "loss": args.loss}  # fmt: skip
    # "-docs": trained since a packed row's draft blocks read only their own document's context
    name = f"drafter-b{b}-s{args.drafter_steps}-{args.loss}{suffix}-docs"
    return train(work, name, objective, args.drafter_steps, 3e-3, None, data=data)


def add_drafter_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--drafter-steps", type=int, default=2000)
    ap.add_argument("--anchors", type=int, default=64, help="objective.num_anchors of the drafters")
    ap.add_argument("--loss", choices=["ce", "kl"], default="ce",
                    help="objective.loss of the drafters: ce (the target's greedy tokens) for greedy decoding, as "
                         "here; kl (its distribution) for sampled decoding")  # fmt: skip
    ap.add_argument("--drafter-data", choices=["regenerated", "corpus"], default="regenerated",
                    help="the drafters' training text: the target's own greedy continuations of corpus prefixes "
                         "(as DFlash trains), or the corpus itself")  # fmt: skip
    ap.add_argument("--regen-records", type=int, default=20000, help="corpus records the target continues")


def prompts_of(tok, n: int) -> list[list[int]]:
    """Held-out records (another seed), cut after their first word."""
    texts = [r["text"] for r in demo_text(n, seed=12345)]
    return [tok.encode(t.split()[0] + " ") for t in texts]


@torch.inference_mode()
def tau_offline(target, drafter: DFlashDrafter, prompts: list[list[int]], greedy: list[list[int]], eos: int,
                max_new: int) -> dict[str, Any]:  # fmt: skip
    """Accepted-prefix rounds of the drafter against the target's greedy continuations (with their
    EOS, for rows that ended before `max_new` tokens), one row at a time."""
    b = drafter.block_size
    rounds = gained = 0
    for prompt, cont in zip(prompts, greedy, strict=True):
        seq = torch.tensor([prompt + cont + ([eos] if len(cont) < max_new else [])], device=DEVICE)
        P, L = len(prompt), seq.shape[1]
        with capture_layers(target, drafter.target_layer_ids) as cap:
            target(seq, torch.arange(L, device=DEVICE)[None], AttentionMask("causal"))
        feats = cap.features()
        state = drafter.start(1, L + 2 * b)
        drafter.extend(state, feats[:, :P], torch.arange(P, device=DEVICE)[None])
        p = P  # the anchor: the first generated token (the prefill's); the tokens after it come from rounds
        while p < L - 1:
            drafts = drafter.propose(state, seq[:, p], torch.tensor([p], device=DEVICE))[0].argmax(-1)
            # as the loop does: the verified positions' features (a position's never change under greedy)
            drafter.extend(state, feats[:, p : p + b], torch.arange(p, min(p + b, L), device=DEVICE)[None])
            truth = seq[0, p + 1 : p + b]
            n = int((drafts[: len(truth)] == truth).long().cumprod(0).sum())
            step = min(n + 1, L - 1 - p)
            rounds, gained, p = rounds + 1, gained + step, p + step
    return {"tau_offline": round(gained / rounds, 3), "rounds_offline": rounds}


def timed(fns: dict[str, Any], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call in each of `repeats` interleaved rounds (every variant once per round, so a
    slow spell of the machine hits all of them)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples[k].append(time.perf_counter() - t0)
    return samples


def ratios(samples: dict[str, list[float]], base: str, other: str) -> tuple[float, float]:
    """(best-of ratio base/other: the two fastest calls, the machine's quiet moments; the median of the
    per-round ratios: what a run on a busy machine sees)."""
    per_round = sorted(a / b for a, b in zip(samples[base], samples[other], strict=True))
    return min(samples[base]) / min(samples[other]), per_round[len(per_round) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/dllm-bench-speculative"))
    ap.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 12, 16])
    ap.add_argument("--target-steps", type=int, default=450)
    add_drafter_args(ap)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default torch's); 1 keeps timings sane on a shared CPU")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host (the pair trains there too)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    work = args.work_dir.absolute()
    if args.retrain and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    build_data(work)
    arch = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 4, "max_seq_len": 512}
    target_run = train(work, "target", {"name": "ar"}, args.target_steps, 2e-3, arch)
    drafter_runs = {b: train_drafter(work, target_run, b, args) for b in args.blocks}
    loaded = load_for_inference(run=target_run, device=DEVICE)
    target, tok = loaded.model, loaded.tokenizer
    prompts = prompts_of(tok, args.prompts)
    # rows end at EOS, as real decoding does: past it a target writes text unlike its corpus
    decoding = causal_sampler(tok, args.new_tokens)
    greedy = decode(target, prompts, decoding).sequences
    summary: dict[str, Any] = {"bench": "speculative_summary", "device": str(DEVICE)}
    for b in args.blocks:
        drafter, _, _ = load_drafter_run(run=drafter_runs[b], device=DEVICE)
        drafter.attach(target)  # the very module the AR baseline runs
        line: dict[str, Any] = {"bench": "speculative", "block_size": b, "new_tokens": args.new_tokens,
                                "prompts": len(prompts)}  # fmt: skip
        line.update(tau_offline(target, drafter, prompts, greedy, tok.eos_id, args.new_tokens))
        line.update(measure(target, drafter, prompts, decoding, tok.mask_id, args.repeats))
        print(json.dumps(line), flush=True)
        summary[f"tau_b{b}"] = line.get("tau", line["tau_offline"])
        if "speedup_b1" in line:
            summary[f"speedup_b1_b{b}"], summary[f"speedup_b8_b{b}"] = line["speedup_b1"], line["speedup_b8"]
            summary[f"speedup_b1_median_b{b}"] = line["speedup_b1_median"]
            summary[f"ceiling_b{b}"] = line["speedup_b1_ceiling"]
            summary[f"speedup_b1_oracle_drafter_b{b}"] = line["speedup_b1_oracle_drafter"]
    if 8 in args.blocks:
        summary["tau_b8_target_3"] = summary["tau_b8"] >= 3
    speedups = {b: summary[f"speedup_b1_b{b}"] for b in args.blocks if f"speedup_b1_b{b}" in summary}
    if speedups:  # the target asks for 1.8x at batch 1 with the drafter of the best block size
        best = max(speedups, key=speedups.__getitem__)
        summary.update({"speedup_b1_best": speedups[best], "speedup_b1_best_block": best,
                        "speedup_b1_target_1.8": speedups[best] >= 1.8,
                        "speedup_b1_ceiling_best_block": summary[f"ceiling_b{best}"]})  # fmt: skip
    print(json.dumps(summary), flush=True)


def step_costs(target, drafter, prompt: list[int], mask_id: int, kept: int, repeats: int = 30) -> dict[str, float]:
    """Seconds of one AR step (1 token against the KV cache, as AR decoding runs it), one verify forward
    (b tokens, capturing the drafter's target layers) and one drafter round (the `kept` verified
    positions' features, then the proposal: one forward) at batch 1, after a prompt (the fastest of
    `repeats`; nothing committed, so every call sees the same cache). A round costs verify + propose and
    gains tau tokens, so with nothing else to pay speculative decoding reaches at most tau x ar / (verify +
    propose) of AR's tokens/s. On a CPU an AR step streams the weights for one token (memory-bound) and a
    verify forward of b tokens adds their compute (b = 8: about 1.6-1.9 AR steps)."""
    b = drafter.block_size
    ar = Target(target, 1, len(prompt) + 2 * b, Counters(), (), mask_id)
    runner = Target(target, 1, len(prompt) + 2 * b, Counters(), drafter.target_layer_ids, mask_id)
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad(), runner.capturing():
        ar.forward(ids)
        ar.commit(torch.tensor([len(prompt)], device=DEVICE))
        _, features = runner.forward(ids)
        runner.commit(torch.tensor([len(prompt)], device=DEVICE))
        state = drafter.start(1, len(prompt) + 2 * b)
        drafter.extend(state, features, torch.arange(len(prompt), device=DEVICE)[None])
        block_features = features[:, -kept:]
        anchor, pos = ids[:, -1], torch.tensor([len(prompt) - 1], device=DEVICE)
        calls = {
            "ar_step_s": lambda: ar.forward(ids[:, -1:]),
            "verify_s": lambda: runner.forward(ids[:, -1:].expand(1, b).contiguous()),
            "propose_s": lambda: (
                drafter.extend(state, block_features, pos[:, None] + torch.arange(kept, device=DEVICE)),
                drafter.propose(state, anchor, pos),
            ),
        }
        return {k: min(v) for k, v in timed(calls, repeats).items()}


def phase_profile(target, drafter, prompts, decoding, repeats: int) -> dict[str, float]:
    """Where a batch-1 round's time goes (every prompt alone, the fastest of `repeats` passes): target
    forwards (the verify, and the prefill spread over the rounds), the drafter (extend + propose) and the
    rest of the loop, in microseconds per round, and one AR step's microseconds for scale."""
    import dllm.sampling.speculative as spec_mod

    spent = {"target_forward": 0.0, "drafter": 0.0}
    rounds = [0]

    def timed_call(fn, key):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t0

        return call

    class TimedTarget(Target):
        forward = timed_call(Target.forward, "target_forward")

    propose, extend = drafter.propose, drafter.extend

    def counted_propose(*a):
        rounds[0] += 1
        return propose(*a)

    best: dict[str, float] | None = None
    spec_mod.Target = TimedTarget
    drafter.propose, drafter.extend = timed_call(counted_propose, "drafter"), timed_call(extend, "drafter")
    try:
        for _ in range(repeats):
            spent.update(target_forward=0.0, drafter=0.0)
            rounds[0] = 0
            t0 = time.perf_counter()
            for p in prompts:
                decode(target, [p], decoding, drafter)
            total = time.perf_counter() - t0
            if best is None or total < best["total"]:
                best = {"total": total, **spent, "rounds": rounds[0]}
    finally:
        spec_mod.Target = Target
        del drafter.propose, drafter.extend
    assert best is not None
    n = best["rounds"]
    out = {f"{k}_us_per_round": round(best[k] / n * 1e6, 1) for k in ("target_forward", "drafter")}
    out["loop_us_per_round"] = round((best["total"] - best["target_forward"] - best["drafter"]) / n * 1e6, 1)
    return out


def measure(target, drafter, prompts, decoding, mask_id, repeats: int) -> dict[str, Any]:
    """tau, forwards per token, losslessness and tokens/s vs AR with the KV cache at batch 1 and 8."""
    out: dict[str, Any] = {}
    spec_all = decode(target, prompts, decoding, drafter)
    ar_all = decode(target, prompts, decoding)
    c = spec_all.counters.as_dict()
    out.update(tau=round(c["tau"], 3), forwards_per_token_one_batch=round(c["forwards_per_token"], 4),
               acceptance_rate=round(c["acceptance_rate"], 3),
               lossless=spec_all.sequences == ar_all.sequences)  # fmt: skip
    # timed after the longest row's prompt and first 16 tokens: at least b positions of context to draft from
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]) + len(ar_all.sequences[i]))
    kept = max(1, min(drafter.block_size, round(c["tau"])))  # the verified positions a round keeps
    costs = step_costs(target, drafter, prompts[longest] + ar_all.sequences[longest][:16], mask_id, kept)
    out["verify_over_ar_step"] = round(costs["verify_s"] / costs["ar_step_s"], 2)
    out["propose_over_ar_step"] = round(costs["propose_s"] / costs["ar_step_s"], 2)
    # the CPU's ceiling for this pair: tau tokens per (verify + propose), against one token per AR step
    out["speedup_b1_ceiling"] = round(c["tau"] * costs["ar_step_s"] / (costs["verify_s"] + costs["propose_s"]), 3)
    out["ar_step_us"] = round(costs["ar_step_s"] * 1e6, 1)
    out.update(phase_profile(target, drafter, prompts, decoding, repeats))
    ones = [decode(target, [p], decoding, drafter).counters for p in prompts]
    out["forwards_per_token_b1"] = round(sum(c.nfe for c in ones) / sum(c.tokens_committed for c in ones), 4)
    # the bound of a perfect drafter at the same cost: every draft right, everything else paid as measured
    eos_id = decoding[1].eos_id
    oracle = [OracleDrafter(drafter, p + s + [eos_id]) for p, s in zip(prompts, ar_all.sequences, strict=True)]
    for batch in (1, 8):
        chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        calls = {
            "ar": lambda chunks=chunks: [decode(target, ch, decoding) for ch in chunks],
            "spec": lambda chunks=chunks: [decode(target, ch, decoding, drafter) for ch in chunks],
        }
        if batch == 1:  # the perfect drafter in the same rounds, against the same AR calls
            calls["oracle"] = lambda: [decode(target, [p], decoding, o) for o, p in zip(oracle, prompts, strict=True)]
        samples = timed(calls, repeats)
        tokens = ar_all.counters.tokens_committed  # the same for both: lossless
        out[f"ar_tokens_per_s_b{batch}"] = round(tokens / min(samples["ar"]), 1)
        out[f"spec_tokens_per_s_b{batch}"] = round(tokens / min(samples["spec"]), 1)
        best, median = ratios(samples, "ar", "spec")
        out[f"speedup_b{batch}"], out[f"speedup_b{batch}_median"] = round(best, 3), round(median, 3)
        if batch == 1:
            out["speedup_b1_oracle_drafter"] = round(ratios(samples, "ar", "oracle")[0], 3)
    counters = [decode(target, [p], decoding, o).counters for o, p in zip(oracle, prompts, strict=True)]
    out["tau_oracle_drafter"] = round(sum(c.rounds + c.accepted for c in counters) / sum(c.rounds for c in counters), 3)
    return out


class OracleDrafter:
    """A perfect drafter for one prompt at the real drafter's cost: runs the drafter's extend/propose (paying
    for them) and proposes the target's own greedy continuation instead of what the drafter said."""

    def __init__(self, drafter, sequence: list[int]) -> None:
        self.drafter, self.block_size, self.target_layer_ids = drafter, drafter.block_size, drafter.target_layer_ids
        self.sequence = torch.tensor(sequence + [sequence[-1]] * drafter.block_size, device=DEVICE)

    def start(self, batch_size: int, max_length: int):
        return self.drafter.start(batch_size, max_length)

    def extend(self, state, features_BNF, positions_BN) -> None:
        self.drafter.extend(state, features_BNF, positions_BN)

    def propose(self, state, anchor_B, anchor_pos_B):
        logits = self.drafter.propose(state, anchor_B, anchor_pos_B)
        at = anchor_pos_B[:, None] + 1 + torch.arange(self.block_size - 1, device=DEVICE)
        right = self.sequence[at.clamp_max(len(self.sequence) - 1)]
        return torch.full_like(logits, -1e4).scatter_(-1, right[..., None], 0.0)


if __name__ == "__main__":
    main()
