"""The diffu-GRPO trainer (d1, Zhao et al. 2025): generation rounds of mu inner updates each, as the units
of the shared loop (training/loop.py: progress, metrics, the NaN/Inf stop, profiling, checkpoints, resume).

A round draws N prompts (training.global_batch_size / rl.group_size) from the prompt set, samples G
completions of each through THE sampling loop (rl/rollout.py), scores them, normalises the rewards
within each group (rl/grpo.py), and runs mu = rl.inner_updates optimizer steps on those completions.
Inner update k draws its own prompt mask (rl/logprob.py); the old policy's and the reference's
log-probs under mask k are computed before the round's first update, so each ratio compares one
estimator with itself. training.steps counts optimizer steps (rounds x mu), so the LR schedule, the
metrics and the checkpoints count them as the supervised trainer does; checkpoints fall between rounds.

Over several processes (DDP or FSDP2), each data-parallel rank draws its own N / dp prompts (rank-disjoint:
one permutation per round, keyed by training.seed and the round, cut into dp slices in rank order),
samples their G completions locally, so a group never straddles ranks and its advantages are computed
where it was generated. The loss is normalised by the global count of sequences (the loss is a mean
over sequences, rl/grpo.py), so dp ranks holding the union of the prompts give the one-process gradient;
the metrics are gathered over ranks. The sampling noise and the prompt masks come from a generator per
rank, keyed by training.seed and the rank; every rank's state is in the checkpoint (resume on as many ranks).
Shapes: B completions (N prompts x G; this rank's), P prompt length, C completion length.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from dllm.config.rl import RLConfig
from dllm.config.sampler import SamplerConfig
from dllm.config.untrusted import count
from dllm.errors import CheckpointError
from dllm.evaluation.tasks import Task
from dllm.models.lora import adapters_disabled
from dllm.parallel.apply import grad_sync, unwrap
from dllm.parallel.dims import all_reduce_sum
from dllm.rl.grpo import group_advantages, grpo_loss
from dllm.rl.logprob import completion_logprobs, mask_prompt
from dllm.rl.rewards import Rewards
from dllm.rl.rollout import Rollouts, rollout
from dllm.sampling.canvas import SpecialIds
from dllm.seeding import mix_key
from dllm.tokenization import Tokenizer
from dllm.training.loop import TrainLoop, TrainParts, Unit

MAX_WORLD_SIZE = 2**20
"""The most processes an rl checkpoint may record (a bound on what is read back, not on runs)."""


@dataclass(frozen=True)
class Policy:
    """What the loop needs to sample from the model and score it."""

    tokenizer: Tokenizer
    special: SpecialIds
    sampler: SamplerConfig
    """Resolved against the run's decode profile (config.rules.resolve_sampler)."""
    shift: bool
    """The decode profile's shift: completion token j is read from row j - 1."""


@dataclass
class Round(Unit):
    """One generation round as the loop sees it: rl.inner_updates optimizer steps."""

    record: dict[str, Any]
    """The round's metrics (training/loop.py adds its wall time)."""


class GRPOTrainer(TrainLoop[Round]):
    """diffu-GRPO: the unit of the loop (training/loop.py) is one generation round."""

    logs_every_unit = True  # one record per round, as rl runs have always logged (logging.every_steps is not read)
    damaged = "{path}: not an rl checkpoint or damaged ({error})"

    def __init__(
        self,
        parts: TrainParts,
        *,
        reference: nn.Module | None,
        reference_is_base: bool = False,
        rl: RLConfig,
        task: Task,
        rewards: Rewards,
        policy: Policy,
    ) -> None:
        super().__init__(parts)
        self.reference, self.rl = reference, rl
        # with LoRA: the reference is the policy's own base weights, its adapters off (no second copy)
        self.reference_is_base = reference_is_base
        self.task, self.rewards, self.policy = task, rewards, policy
        self.steps_per_unit = rl.inner_updates
        self.dp_rank = self.dims.dp_index(self.env.rank)
        seed = mix_key(self.cfg.seed, zlib.crc32(b"rl.generate"), self.dp_rank)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A collective: every rank's generator state, in rank order (the main rank writes them all)."""
        generators = [g.tolist() for g in self._gather(self.generator.get_state().to(self.device))]
        return {**super().state_dict(), "generators": generators}

    def check_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        super().check_checkpoint(path, state)
        world_size = count(state.get("world_size"), "world_size", MAX_WORLD_SIZE, lower=1)
        if world_size != self.env.world_size:
            raise CheckpointError(
                f"{path}: an rl checkpoint of {world_size} processes (one generation RNG each); "
                f"resume it with --nproc-per-node {world_size}, not {self.env.world_size}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        row = state["generators"][self.env.rank]
        if not isinstance(row, list):
            raise TypeError(f"generators[{self.env.rank}] is not a list of bytes")
        state_bytes = [count(b, f"generators[{self.env.rank}] byte", 255) for b in row]
        self.generator.set_state(torch.tensor(state_bytes, dtype=torch.uint8))

    # -- one round --------------------------------------------------------------------------------
    def num_prompts(self) -> int:
        """Prompts this rank generates for per round (config/rules.py check_rl: dp divides them)."""
        return self.cfg.global_batch_size // self.rl.group_size // self.dims.dp

    def draw_prompts(self, round_index: int) -> list:
        """This rank's prompts of a round: slice `dp_rank` of one permutation keyed by the seed and the
        round, the same on every rank (so the slices are disjoint and their union is one process's draw)."""
        g = torch.Generator().manual_seed(mix_key(self.cfg.seed, zlib.crc32(b"rl.prompts"), round_index))
        order = torch.randperm(len(self.task.examples), generator=g).tolist()
        n = self.num_prompts()
        return [self.task.examples[i] for i in order[self.dp_rank * n : (self.dp_rank + 1) * n]]

    def run_unit(self) -> Round:
        """Generate, score, and take rl.inner_updates optimizer steps."""
        t0 = time.perf_counter()
        examples = self.draw_prompts(self.step // self.rl.inner_updates)
        p = self.policy
        with gathered_weights(self.model):  # ranks may stop decoding after different numbers of forwards
            ro = rollout(unwrap(self.model), examples, self.task, p.tokenizer, p.sampler, p.special,
                         self.rl.group_size, self.rewards, self.generator)  # fmt: skip
        advantages_B = group_advantages(ro.rewards_B, self.rl.group_size).to(self.device)
        t1 = time.perf_counter()
        updates, lr = self._updates(ro, advantages_B)
        t2 = time.perf_counter()
        means: dict[str, float] = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0}
        for stats in updates:
            for key, value in stats.items():
                means[key] += value / self.rl.inner_updates
        record = {
            **means,
            **self._rollout_metrics(ro),
            "lr": lr,
            "round": self.step // self.rl.inner_updates,
            "nfe": ro.counters.nfe,
            "rollout_s": round(t1 - t0, 4),
            "update_s": round(t2 - t1, 4),
        }
        checked = [(u["loss"], u["grad_norm"]) for u in updates]
        tokens = self.cfg.global_batch_size * p.sampler.gen_length
        return Round(means["loss"], checked, tokens, t2 - t1, record)

    def run_round(self) -> dict[str, Any]:
        """One round on its own (outside `fit`: nothing checked, logged or saved); its metrics."""
        return self.run_unit().record

    def report(self, unit: Round, step_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        return {**unit.record, "step_s": round(step_s, 4)}, unit.record

    def _updates(self, ro: Rollouts, advantages_B: torch.Tensor) -> tuple[list[dict[str, float]], float]:
        """The round's rl.inner_updates optimizer steps (each its own prompt mask; the old policy's and the
        reference's log-probs under every mask first); their statistics and the last one's learning rate."""
        noisy = [self._mask_prompts(ro) for _ in range(self.rl.inner_updates)]  # one prompt mask per update
        olds = [self._frozen_logprobs(self.model, ro, n) for n in noisy]
        refs = [self._reference_logprobs(ro, n) if self._uses_reference() else None for n in noisy]
        updates, lr = [], 0.0
        for k in range(self.rl.inner_updates):
            lr = self.lr_schedule.apply(self.optimizer, self.step)
            updates.append(self._update(ro, noisy[k], olds[k], refs[k], advantages_B))
            self.step += 1
        return updates, lr

    def _rollout_metrics(self, ro: Rollouts) -> dict[str, float]:
        """Rewards, accuracy and completion length over every rank's completions."""
        rewards = torch.cat(self._gather(ro.rewards_B.float().to(self.device)))  # every rank's, in rank order
        parts = {name: torch.cat(self._gather(v.float().to(self.device))) for name, v in ro.parts.items()}
        correct = torch.cat(self._gather(ro.correct_B.float().to(self.device)))
        lengths = torch.cat(self._gather(ro.mask_BC.sum(-1).float()))
        return {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            **{f"reward_{name}": float(v.mean()) for name, v in parts.items()},
            "accuracy": float(correct.mean()),
            "completion_len": float(lengths.mean()),
        }

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (the same shape on each), in rank order; [t] in one process."""
        if not self.env.distributed:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.env.world_size)]
        dist.all_gather(out, t.contiguous())
        return out

    def _uses_reference(self) -> bool:
        return self.rl.beta > 0 and (self.reference is not None or self.reference_is_base)

    def _reference_logprobs(self, ro: Rollouts, noisy_BP: torch.Tensor) -> torch.Tensor:
        """The reference policy's log-probs [B, C]: the frozen copy's, or (LoRA) the policy's with its adapters off."""
        if not self.reference_is_base:
            return self._frozen_logprobs(self.reference, ro, noisy_BP)
        with adapters_disabled(unwrap(self.model)):
            return self._frozen_logprobs(self.model, ro, noisy_BP)

    def _mask_prompts(self, ro: Rollouts) -> torch.Tensor:
        """The prompts with d1's random prompt masking, drawn from the run's generator: one draw per inner
        update, shared by its old, reference and current log-probs [B, P]."""
        special = self.policy.special
        return mask_prompt(ro.prompt_BP, special.mask_id, self.rl.p_mask_prompt, self.generator, ro.prompt_valid_BP)

    def _logprobs(self, model: nn.Module | None, ro: Rollouts, noisy_BP: torch.Tensor,
                  rows: slice = slice(None)) -> torch.Tensor:  # fmt: skip
        """log p(completion | noisy prompt) [rows, C] (rl/logprob.py); differentiable when grad is enabled."""
        assert model is not None
        return completion_logprobs(model, noisy_BP[rows], ro.completion_BC[rows], self.policy.special.mask_id,
                                   prompt_valid_BP=ro.prompt_valid_BP[rows], shift=self.policy.shift)  # fmt: skip

    @torch.no_grad()
    def _frozen_logprobs(self, model: nn.Module | None, ro: Rollouts, noisy_BP: torch.Tensor) -> torch.Tensor:
        """The old policy's or the reference's log-probs [B, C], micro_batch_size rows per forward."""
        B, mb = ro.completion_BC.shape[0], self.cfg.micro_batch_size
        out_BC = torch.cat([self._logprobs(model, ro, noisy_BP, slice(lo, min(lo + mb, B))) for lo in range(0, B, mb)])
        if isinstance(model, FSDPModule):  # FSDP2 keeps the root's weights gathered after a forward (until a backward)
            model.reshard()
        return out_BC

    def _update(self, ro: Rollouts, noisy_BP: torch.Tensor, old_BC: torch.Tensor, ref_BC: torch.Tensor | None,
                advantages_B: torch.Tensor) -> dict[str, float]:  # fmt: skip
        """One optimizer step over the round's completions, micro_batch_size rows per forward. The loss
        is the mean over the sequences of all ranks: each micro-batch's mean weighs its rows / the global
        row count, times the ranks DDP/FSDP2 average the gradients over (their mean becomes the sum)."""
        B = ro.completion_BC.shape[0]
        mb = self.cfg.micro_batch_size
        rows_t = torch.tensor([float(B)], dtype=torch.float64, device=self.device)
        global_rows = float(all_reduce_sum(rows_t, self.env).item())
        scale = self.dims.grad_ranks / global_rows
        sums = torch.zeros(
            4, dtype=torch.float64, device=self.device
        )  # loss x rows, clipped tokens, kl x tokens, tokens
        for lo in range(0, B, mb):
            rows = slice(lo, min(lo + mb, B))
            with grad_sync(self.model, rows.stop == B):  # reduce the gradients once, after the last micro-batch
                logp_BC = self._logprobs(self.model, ro, noisy_BP, rows)
                ref = None if ref_BC is None else ref_BC[rows]
                out = grpo_loss(logp_BC, old_BC[rows], ref, advantages_B[rows], ro.mask_BC[rows],
                                clip_eps=self.rl.clip_eps, beta=self.rl.beta)  # fmt: skip
                (out.loss * (rows.stop - rows.start) * scale).backward()
            n = float(ro.mask_BC[rows].sum())
            stats = (float(out.loss.detach()) * (rows.stop - rows.start), float(out.clip_fraction) * n,
                     float(out.kl_mean) * n, n)  # fmt: skip
            sums += torch.tensor(stats, dtype=torch.float64, device=self.device)
        grad_norm = self.optimizer_step()
        sums = all_reduce_sum(sums, self.env)
        tokens = max(float(sums[3]), 1.0)
        return {"loss": float(sums[0]) / global_rows, "clip_fraction": float(sums[1]) / tokens,
                "kl": float(sums[2]) / tokens, "grad_norm": grad_norm}  # fmt: skip


@contextlib.contextmanager
def gathered_weights(model: nn.Module) -> Iterator[None]:
    """FSDP2: the full weights on every rank for the duration (each forward then runs without a collective,
    so ranks may run different numbers of them, as decoding does when rows stop early); resharded after.
    Anything else: nothing to do."""
    if not isinstance(model, FSDPModule):
        yield
        return
    fsdp = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = [m for m in fsdp if m is not model]  # the root's own setting is FSDP2's to keep
    for m in inner:
        m.set_reshard_after_forward(False, recurse=False)
    for m in fsdp:
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp:
            m.reshard()
        for m in inner:
            m.set_reshard_after_forward(True, recurse=False)
