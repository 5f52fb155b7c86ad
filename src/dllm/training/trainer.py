"""Supervised training. `train_step` runs one optimizer step over this rank's micro-batches; the loop
around it (progress, metrics, the NaN/Inf stop, profiling, checkpoints, resume) is training/loop.py's.

The loss of a step is sum(weighted token losses) / (global number of supervised tokens), so it is
the same number whatever the number of ranks and micro-batches. Gradients are averaged over ranks
by FSDP/DDP, so each rank's loss is scaled by the world size to turn that average into the sum the
normalisation needs (see `train_step`).

Context/block parallelism (`plan`, parallel/context.py): the ranks of a context group read the same
micro-batches, prepare them identically (noise is keyed by sample id) and each keeps its rows
(`plan.shard`); every target is owned by exactly one rank of its group.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dllm.config.base import MAX_SEED
from dllm.config.untrusted import count
from dllm.data.loader import Batch, StepLoader
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import ModelInputs, Objective
from dllm.models.output import CanvasConditioned, ModelOutput, SelfConditioned
from dllm.parallel.apply import grad_sync
from dllm.parallel.context import ShardPlan
from dllm.parallel.dims import all_reduce_sum
from dllm.training.loop import TrainLoop, TrainParts, Unit
from dllm.training.mfu import FlopsMeter

MAX_GROUP_SIZE = 2**31
"""The largest noise group (the global batch size) a checkpoint may record."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepStats:
    loss: float
    masked_ce: float
    grad_norm: float
    lr: float
    aux_loss: float
    num_targets: int
    times_s: dict[str, float]
    num_head_rows: int = 0
    """Hidden rows the loss sent through the LM head, all ranks (the head's share of the FLOPs)."""
    certainty: dict[str, float] | None = None
    """With certainty forcing: the share of the loss's rows predicted right and their mean tempered entropy."""


@dataclass
class Step(Unit):
    """One supervised step as the loop sees it, with what its metrics record reads."""

    stats: StepStats
    batches: list[Batch]
    data_s: float


class Trainer(TrainLoop[Step]):
    """Supervised training: the unit of the loop (training/loop.py) is one optimizer step."""

    def __init__(
        self,
        parts: TrainParts,
        *,
        objective: Objective,
        loader: StepLoader,
        aux_loss_coef: float = 0.0,
        plan: ShardPlan | None = None,
        flops: FlopsMeter | None = None,
    ) -> None:
        super().__init__(parts)
        self.objective, self.loader = objective, loader
        self.aux_loss_coef = aux_loss_coef
        self.plan = plan  # this rank's context/block shard plan (None: whole sequences)
        self.flops = flops  # FLOP/s and MFU in the metrics
        self.noise = NoiseKeys(self.cfg.seed, group_size=self.cfg.global_batch_size)
        self.autocast_dtype = _DTYPES[self.cfg.autocast_dtype]
        self.tokens_per_step = self.cfg.global_batch_size * loader.seq_len

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        noise = {"seed": self.noise.seed, "group_size": self.noise.group_size}
        return {**super().state_dict(), "loader": self.loader.state_dict(), "noise": noise}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        super().load_state_dict(state)
        noise = state["noise"]
        seed, group_size = count(noise["seed"], "noise.seed", MAX_SEED), noise["group_size"]
        self.noise = NoiseKeys(seed, count(group_size, "noise.group_size", MAX_GROUP_SIZE, lower=1))

    # -- one step ---------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self, micro_batches: list[Batch]) -> StepStats:
        times = {"forward": 0.0, "backward": 0.0}
        local_targets = sum(self.objective.normalizer(b) for b in micro_batches)
        counts = torch.tensor([float(local_targets)], dtype=torch.float64, device=self.device)
        counts = all_reduce_sum(counts, self.env)
        # the `group` x `tp` ranks of a context group and its tensor-parallel peers count the same
        # micro-batches: the world sum counts each target group x tp times (integers in float64: exact)
        global_targets = max(float(counts.item()) / (self.dims.group * self.dims.tp), 1.0)
        # FSDP/DDP average gradients over the W = dp x group ranks of one tensor-parallel index:
        # grad = (1/W) sum_w scale * d(loss_sum_w). The loss sums of a group's ranks add up to its
        # micro-batches' loss sum (each target owned once), so sum_w d(loss_sum_w) = d(sum over the
        # global batch); scale = W / global_targets makes grad the gradient of that sum / global_targets
        # (W = dp without context parallelism; tensor-parallel ranks hold shards of one gradient)
        scale = self.dims.grad_ranks / global_targets
        # loss, masked CE, masked count, and certainty forcing's entropy sum and count of rows predicted right
        sums = torch.zeros(5, dtype=torch.float64, device=self.device)
        aux_sum = 0.0
        lr = self.lr_schedule.apply(self.optimizer, self.step)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with grad_sync(self.model, last):
                t0 = time.perf_counter()
                inputs = self.objective.prepare(batch.to(self.device), self.noise)
                if self.plan is not None:
                    inputs = self.plan.shard(inputs)  # this rank's rows; positions and the mask stay global
                with self._autocast():
                    model_out = run_model(self.model, inputs)
                    out = self.objective.loss(model_out, inputs)
                total = out.loss_sum * scale
                aux = model_out.aux.get("router_loss")
                if aux is not None:  # MoE load balancing: a mean over micro-batches (and ranks, by DDP/FSDP)
                    total = total + self.aux_loss_coef * aux / len(micro_batches)
                    aux_sum += float(aux.detach())
                t1 = time.perf_counter()
                total.backward()
                times["forward"] += t1 - t0
                times["backward"] += time.perf_counter() - t1
            sums[0] += out.loss_sum.detach().double()
            sums[1] += out.metrics.get("masked_ce_sum", torch.zeros(())).double()
            sums[2] += out.metrics.get("num_masked", torch.zeros(())).double()
            sums[3] += out.metrics.get("certain_entropy_sum", torch.zeros(())).double()
            sums[4] += out.metrics.get("num_certain", torch.zeros(())).double()
        t0 = time.perf_counter()
        grad_norm = self.optimizer_step()
        times["optimizer"] = time.perf_counter() - t0
        sums = all_reduce_sum(sums, self.env) / self.dims.tp  # tensor-parallel ranks hold the same sums
        self.step += 1
        return StepStats(
            loss=float(sums[0] / global_targets),
            masked_ce=float(sums[1] / sums[2].clamp_min(1)),
            grad_norm=grad_norm,
            lr=lr,
            aux_loss=aux_sum / len(micro_batches),
            num_targets=int(global_targets),
            times_s=times,
            num_head_rows=int(sums[2]),
            certainty=None if getattr(self.objective, "certainty", None) is None else {
                "certain_frac": round(float(sums[4] / sums[2].clamp_min(1)), 4),
                "certain_entropy": round(float(sums[3] / sums[4].clamp_min(1)), 4),
            },
        )  # fmt: skip

    # -- the unit of the loop ---------------------------------------------------------------------
    def run_unit(self) -> Step:
        t0 = time.perf_counter()
        batches = self.loader.next_step()
        data_s = time.perf_counter() - t0
        stats = self.train_step(batches)
        compute_s = stats.times_s["forward"] + stats.times_s["backward"]
        checked = [(stats.loss, stats.grad_norm)]
        return Step(stats.loss, checked, self.tokens_per_step, compute_s, stats, batches, data_s)

    def report(self, unit: Step, step_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        perf = self._perf(unit.batches, unit.stats, step_s)
        return {**self._record(unit.stats, unit.data_s, step_s, unit.num_tokens / step_s), **perf}, perf

    def _perf(self, batches: list[Batch], stats: StepStats, step_s: float) -> dict[str, Any]:
        """Model FLOPs per token, FLOP/s and MFU of this step (empty without a FlopsMeter)."""
        if self.flops is None:
            return {}
        self.flops.observe(self.objective, batches[0], self.noise)
        return self.flops.measure(self.cfg.global_batch_size, stats.num_head_rows, step_s)

    def _record(self, stats: StepStats, t_data: float, step_s: float, tps: float) -> dict[str, Any]:
        return {
            "loss": stats.loss,
            "masked_ce": stats.masked_ce,
            "grad_norm": stats.grad_norm,
            **({"aux_loss": stats.aux_loss} if stats.aux_loss else {}),
            **(stats.certainty or {}),
            "lr": stats.lr,
            "num_targets": stats.num_targets,
            "epoch": round(self.loader.epoch, 4),
            "tokens": self.step * self.tokens_per_step,
            "tokens_per_s": round(tps, 1),
            "step_s": round(step_s, 4),
            "data_s": round(t_data, 4),
            **{f"{k}_s": round(v, 4) for k, v in stats.times_s.items()},
        }


def run_model(model: nn.Module, inputs: ModelInputs) -> ModelOutput:
    """THE model call of training: one forward (a detached first pass before it for self-conditioned
    rows, Chen et al. 2022 "Analog Bits": the second pass sees the first one's predicted ids, or for a
    canvas after a clean prefix (DiffusionGemma) the first pass's canvas logits)."""
    rows = inputs.self_cond_rows_B
    tokens: torch.Tensor | SelfConditioned | CanvasConditioned = inputs.tokens_BL
    # the first pass runs even when no row of this rank's batch is drawn (its rows then add exactly 0): the
    # forward holds collectives (FSDP's all-gathers, expert and context parallelism's exchanges), so every
    # rank must run the same passes whatever its own draws
    if rows is not None:
        with torch.no_grad():
            tokens = _conditioned(model(tokens, inputs.positions_BL, inputs.mask), inputs, rows)
    return model(tokens, inputs.positions_BL, inputs.mask)


def _conditioned(first: ModelOutput, inputs: ModelInputs, rows: torch.Tensor) -> SelfConditioned | CanvasConditioned:
    """The second pass's tokens: the canvas rows' logits for a prefix_canvas model, else the argmax ids."""
    if inputs.mask.kind == "prefix_canvas":
        canvas_BLE = first.hidden_BLE[:, inputs.mask.input_clean_rows :]  # a context rank holds some rows
        logits = ModelOutput(canvas_BLE, first.head, logit_softcap=first.logit_softcap).logits()
        return CanvasConditioned(inputs.tokens_BL, logits, rows)
    guess_BL = _argmax_tokens(first)
    return SelfConditioned(inputs.tokens_BL, torch.where(rows[:, None], guess_BL, torch.full_like(guess_BL, -1)))


def _argmax_tokens(out: ModelOutput, rows_per_chunk: int = 4) -> torch.Tensor:
    """The most likely token per position, a few rows of logits at a time."""
    chunks = [ModelOutput(h, out.head).logits().argmax(-1) for h in out.hidden_BLE.split(rows_per_chunk)]
    return torch.cat(chunks)
