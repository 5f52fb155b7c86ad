"""Draw docs/figures/parallelism.png: which rank holds which rows of block diffusion's [x_t ; x_0] input
under CP, BP and CSBP (from the real `build_plan`), and the per-rank work of dual_end vs contiguous.

    PYTHONPATH=src python docs/figures/parallelism.py [--out docs/figures/parallelism.png]

Needs matplotlib (`pip install -e ".[plot]"`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from dllm.attention.masks import AttentionMask, mask_mod  # noqa: E402
from dllm.parallel.context import allowed_pairs, build_plan  # noqa: E402

L, BLOCK, RANKS = 64, 4, 4  # 16 noisy blocks, 4 ranks: dual_end gives each rank two (b, 15 - b) pairs
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
PANELS = [
    ("CP4 (position-sharded over 2L, dual_end): every row shared", "cp", 4, 1),
    ("BP4 (dual_end): noisy blocks private, every clean row on every rank", "bp", 1, 4),
    ("CSBP cp4 x bp4: noisy blocks private, x_0 sharded once over the CP group", "csbp", 4, 4),
    ("CSBP cp2 x bp4: two CP groups {0,1} {2,3}, each holds x_0 once", "csbp", 2, 4),
]


def runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted row indices -> (start, length) runs."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][0] + out[-1][1] == r:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((r, 1))
    return out


def draw_plans(ax, title: str, mode: str, cp: int, bp: int) -> None:
    for rank in range(RANKS if mode != "cp" else cp):
        plan = build_plan(mode, L, BLOCK, cp, bp, rank, "dual_end", "block_diffusion")
        for shared in (False, True):
            rows = plan.rows[plan.shared == shared].tolist()
            for start, length in runs(rows):
                ax.add_patch(
                    Rectangle(
                        (start, rank + 0.1), length, 0.8, facecolor=COLORS[rank], edgecolor="white",
                        hatch="///" if shared else None, alpha=0.55 if shared else 1.0, linewidth=0.5,
                    )
                )  # fmt: skip
        label = f"rank {rank}" + (f" (cp idx {plan.cp_index})" if mode == "csbp" else "")
        ax.text(-1.5, rank + 0.5, label, ha="right", va="center", fontsize=7)
    ax.axvline(L, color="black", linewidth=1.2)
    for b in range(0, 2 * L + 1, BLOCK):
        ax.axvline(b, color="grey", linewidth=0.2)
    ax.set_xlim(0, 2 * L)
    ax.set_ylim(RANKS, 0)
    ax.set_yticks([])
    ax.set_xticks([0, L // 2, L, L + L // 2, 2 * L])
    ax.set_xticklabels(["0", "x_t (noisy)", "L", "x_0 (clean)", "2L"], fontsize=7)
    ax.set_title(title, fontsize=8, loc="left")


def draw_work(ax) -> None:
    """Allowed (query, key) pairs of each BP4 rank's noisy rows, dual_end vs contiguous."""
    mod = mask_mod(AttentionMask("block_diffusion", block_size=BLOCK), 2 * L)
    width = 0.38
    for i, schedule in enumerate(("dual_end", "contiguous")):
        pairs = []
        for rank in range(RANKS):
            plan = build_plan("bp", L, BLOCK, 1, RANKS, rank, schedule, "block_diffusion")
            noisy = plan.rows < L
            plan = dataclasses.replace(plan, rows=plan.rows[noisy], shared=plan.shared[noisy])
            pairs.append(allowed_pairs(plan, mod))
        mean = sum(pairs) / len(pairs)
        xs = [r + (i - 0.5) * width for r in range(RANKS)]
        ax.bar(xs, [p / mean for p in pairs], width, label=f"{schedule} (max/mean {max(pairs) / mean:.2f})",
               color="#4C72B0" if i == 0 else "#BBBBBB")  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xticks(range(RANKS))
    ax.set_xticklabels([f"rank {r}" for r in range(RANKS)], fontsize=7)
    ax.set_ylabel("noisy-row work / mean", fontsize=7)
    ax.set_title("BP4 work per rank (allowed pairs of its noisy blocks), 4 blocks per rank", fontsize=8, loc="left")
    ax.legend(fontsize=7, loc="upper left")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".png"))
    args = ap.parse_args()
    fig, axes = plt.subplots(len(PANELS) + 1, 1, figsize=(9, 11), gridspec_kw={"hspace": 0.55})
    for ax, (title, mode, cp, bp) in zip(axes, PANELS, strict=False):
        draw_plans(ax, title, mode, cp, bp)
    draw_work(axes[-1])
    legend = [
        Patch(facecolor="#888888", label="private row: its K/V never leave the rank"),
        Patch(facecolor="#888888", alpha=0.55, hatch="///", label="shared row: K/V all-gathered over the CP group"),
    ]
    fig.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, 0.935), ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"Rows of [x_t ; x_0] held per rank (L = {L}, block {BLOCK}: {L // BLOCK} blocks)", y=0.96)
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(args.out)


if __name__ == "__main__":
    main()
