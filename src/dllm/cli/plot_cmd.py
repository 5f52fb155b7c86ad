"""`dllm plot RUN [RUN ...]`: curves of metrics.jsonl records, one panel per metric, runs overlaid."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dllm.cli.common import check_output_file, info, write_file
from dllm.errors import CheckpointError, UserError
from dllm.training.metrics import read_metrics


def plot(
    runs: list[Path] = typer.Argument(..., help="Run folders (RUN/metrics.jsonl), e.g. runs/latest."),
    output: Path = typer.Option(Path("plot.png"), "--output", "-o", help="Image to write (.png, .svg, .pdf)."),
    metric: str = typer.Option("loss", "--metric", "-m", help="Comma-separated metrics: loss,lr,tokens_per_s,..."),
    smooth: int = typer.Option(1, "--smooth", min=1, help="Moving average over N records (1: raw)."),
) -> None:
    """Plot metrics of one or more runs (matplotlib, pip install 'dllm[plot]')."""
    names = [m.strip() for m in metric.split(",") if m.strip()]
    if not names:
        raise UserError("--metric: name at least one metric, e.g. --metric loss,lr")
    check_output_file(output, reads=[("the run", run) for run in runs], parents=True)
    series = {_label(run, runs): read_metrics(_run_folder(run)) for run in runs}
    available = sorted({k for recs in series.values() for r in recs for k, v in r.items() if _is_number(v)} - {"step"})
    unknown = [m for m in names if m not in available]
    if unknown:
        raise UserError(f"--metric {','.join(unknown)}: not in these runs' metrics; they have {', '.join(available)}")
    render(series, names, smooth, output)
    info(f"wrote {output}")


def _run_folder(run: Path) -> Path:
    if not (run / "metrics.jsonl").is_file():
        raise CheckpointError(f"{run}: not a run folder (no metrics.jsonl); train with `dllm launch` first")
    return run


def _label(run: Path, runs: list[Path]) -> str:
    """The run folder's name (with its parent when two runs share a name; `latest` resolved)."""
    resolved = run.resolve()
    same = [r for r in runs if r.resolve().name == resolved.name]
    return resolved.name if len(same) == 1 else f"{resolved.parent.name}/{resolved.name}"


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def moving_average(values: list[float], n: int) -> list[float]:
    """Trailing mean over the last `n` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def render(series: dict[str, list[dict[str, Any]]], metrics: list[str], smooth: int, output: Path) -> None:
    """One panel per metric (shared step axis), one line per run."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("dllm plot needs matplotlib: pip install 'dllm[plot]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(metrics), 1, figsize=(7, 2.6 * len(metrics)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], metrics, strict=True):
        plotted: list[float] = []
        for label, records in series.items():
            points = [(r["step"], float(r[name])) for r in records if _is_number(r.get(name))]
            if points:
                steps, values = zip(*points, strict=True)
                plotted += moving_average(list(values), smooth)
                ax.plot(steps, plotted[-len(steps) :], label=label, linewidth=1.4)
        ax.set_ylabel(name + (f" (avg {smooth})" if smooth > 1 else ""))
        ax.grid(alpha=0.3)
        if name in ("loss", "masked_ce") and min(plotted) > 0 and max(plotted) >= 10 * min(plotted):  # decades
            ax.set_yscale("log")
    axes[0, 0].legend(loc="best", fontsize="small")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    try:  # the format from the name, not from the temp file's
        write_file(output, lambda tmp: fig.savefig(tmp, dpi=110, format=output.suffix[1:] or "png"))
    except ValueError as e:
        raise UserError(f"{output}: cannot write the plot ({e})") from None
    finally:
        plt.close(fig)
