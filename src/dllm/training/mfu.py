"""Throughput in model FLOPs: FLOPs per token, achieved FLOP/s and model FLOPs utilisation (MFU).

The FLOP count is dllm.models.flops (dense matmuls 6N, attention, the head on the rows in the loss)
for the layout the objective trains, read once from a prepared micro-batch (so every objective,
present or future, is counted by what it actually feeds the model). MFU divides the achieved FLOP/s
by the bf16 dense peak of the detected accelerator times the number of devices; on a CPU or an
accelerator not in the table only FLOP/s is reported.
"""

from __future__ import annotations

from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import ModelInputs, Objective
from dllm.models.flops import Layout, train_flops

PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    # dense (no sparsity) bf16 tensor-core peak per GPU, vendors' datasheets; most specific name first
    ("A100", 312e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("B200", 2250e12),
)


def peak_of(device_name: str) -> float | None:
    """The bf16 peak FLOP/s of a GPU named `device_name` (torch.cuda.get_device_name), None if unknown."""
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def peak_flops(device: torch.device) -> float | None:
    """The bf16 peak of the training device; None on a CPU (FLOP/s only, no MFU)."""
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def layout_of(batch: Batch, inputs: ModelInputs) -> Layout:
    """The layout an objective made of `batch`: rows per sequence, row length, last-layer queries."""
    B, L = batch.tokens_BL.shape
    rows, row_len = inputs.tokens_BL.shape
    return Layout(seq_len=L, row_len=row_len, rows=rows // B, last_queries=inputs.mask.num_outputs)


class FlopsMeter:
    """Per step: model FLOPs per token, FLOP/s and MFU (when the peak is known)."""

    def __init__(self, cfg: ModelConfig, peak_per_device: float | None, num_devices: int) -> None:
        self.cfg = cfg
        self.peak = None if peak_per_device is None else peak_per_device * num_devices
        self.layout: Layout | None = None

    def observe(self, objective: Objective, batch: Batch, noise: NoiseKeys) -> None:
        """Read the layout once from one prepared micro-batch (noise is keyed, so this draws nothing)."""
        if self.layout is None:
            self.layout = layout_of(batch, objective.prepare(batch, noise))

    def measure(self, num_sequences: int, num_head_rows: int, step_s: float) -> dict[str, Any]:
        """Fields of the metrics record for a step over `num_sequences` sequences (all ranks)."""
        assert self.layout is not None, "observe() a micro-batch first"
        flops = train_flops(self.cfg, self.layout, num_sequences, num_head_rows)
        per_s = flops / max(step_s, 1e-9)
        record: dict[str, Any] = {
            "flops_per_token": round(flops / (num_sequences * self.layout.seq_len)),
            "flops_per_s": float(f"{per_s:.4g}"),
        }
        if self.peak is not None:
            record["mfu"] = round(per_s / self.peak, 4)
        return record
