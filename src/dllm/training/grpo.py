"""The diffu-GRPO training loop (d1, Zhao et al. 2025): generation rounds of mu inner updates each.

A round draws N prompts (training.global_batch_size / rl.group_size) from the prompt set, samples G
completions of each through THE sampling loop (rl/rollout.py), scores them, normalises the rewards
within each group (rl/grpo.py), and runs mu = rl.inner_updates optimizer steps on those completions.
Inner update k draws its own prompt mask (rl/logprob.py); the old policy's and the reference's
log-probs under mask k are computed before the round's first update, so each ratio compares one
estimator with itself. training.steps counts optimizer steps (rounds x mu), so the LR schedule, the
metrics and the checkpoints count them as the supervised trainer does; checkpoints fall between rounds.

All randomness of a round (which prompts, the sampling noise, the prompt masks) comes from one
generator seeded by training.seed; its state is part of the trainer state.
Shapes: B completions (N prompts x G), P prompt length, C completion length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dllm.checkpoint.manager import CheckpointManager
from dllm.config.rl import RLConfig
from dllm.config.sampler import SamplerConfig
from dllm.config.training import LoggingConfig, TrainingConfig
from dllm.errors import CheckpointError
from dllm.evaluation.tasks import Task
from dllm.parallel.dims import DistEnv
from dllm.parallel.grad_norm import clip_grad_norm
from dllm.rl.grpo import group_advantages, grpo_loss
from dllm.rl.logprob import completion_logprobs, mask_prompt
from dllm.rl.rewards import Rewards
from dllm.rl.rollout import Rollouts, rollout
from dllm.sampling.generate import SpecialIds
from dllm.tokenization import Tokenizer
from dllm.training.lr import LRSchedule
from dllm.training.metrics import MetricsLogger
from dllm.training.progress import Progress


@dataclass(frozen=True)
class Policy:
    """What the loop needs to sample from the model and score it."""

    tokenizer: Tokenizer
    special: SpecialIds
    sampler: SamplerConfig
    """Resolved against the run's decode profile (config.rules.resolve_sampler)."""
    shift: bool
    """The decode profile's shift: completion token j is read from row j - 1."""


class GRPOTrainer:
    def __init__(
        self,
        *,
        model: nn.Module,
        reference: nn.Module | None,
        optimizer: torch.optim.Optimizer,
        lr_schedule: LRSchedule,
        checkpoints: CheckpointManager,
        metrics: MetricsLogger,
        cfg: TrainingConfig,
        rl: RLConfig,
        log_cfg: LoggingConfig,
        env: DistEnv,
        device: torch.device,
        identity: dict[str, Any],
        task: Task,
        rewards: Rewards,
        policy: Policy,
    ) -> None:
        self.model, self.reference, self.optimizer, self.lr_schedule = model, reference, optimizer, lr_schedule
        self.checkpoints, self.metrics, self.cfg, self.rl, self.log_cfg = checkpoints, metrics, cfg, rl, log_cfg
        self.env, self.device, self.identity = env, device, identity
        self.task, self.rewards, self.policy = task, rewards, policy
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self.step = 0

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_schedule": self.lr_schedule.state_dict(),
            "generator": self.generator.get_state().tolist(),
            "identity": self.identity,
            "world_size": self.env.world_size,
        }

    def resume(self, path: Any) -> None:
        state = self.checkpoints.load(path, self.model, self.optimizer)
        try:
            self.lr_schedule.load_state_dict(state["lr_schedule"])
            self.generator.set_state(torch.tensor(state["generator"], dtype=torch.uint8))
            self.step = int(state["step"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not an rl checkpoint or damaged ({type(e).__name__}: {e})") from None

    # -- one round --------------------------------------------------------------------------------
    def num_prompts(self) -> int:
        return self.cfg.global_batch_size // self.rl.group_size

    def run_round(self) -> dict[str, float]:
        """Generate, score, and take rl.inner_updates optimizer steps; returns the round's metrics."""
        t0 = time.perf_counter()
        order = torch.randperm(len(self.task.examples), generator=self.generator, device=self.device).tolist()
        examples = [self.task.examples[i] for i in order[: self.num_prompts()]]
        p = self.policy
        ro = rollout(self.model, examples, self.task, p.tokenizer, p.sampler, p.special, self.rl.group_size,
                     self.rewards, self.generator)  # fmt: skip
        advantages_B = group_advantages(ro.rewards_B, self.rl.group_size).to(self.device)
        t1 = time.perf_counter()
        noisy = [self._mask_prompts(ro) for _ in range(self.rl.inner_updates)]  # one prompt mask per update
        olds = [self._frozen_logprobs(self.model, ro, n) for n in noisy]
        refs = [self._frozen_logprobs(self.reference, ro, n) if self._uses_reference() else None for n in noisy]
        sums: dict[str, float] = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0}
        lr = 0.0
        for k in range(self.rl.inner_updates):
            lr = self.lr_schedule.apply(self.optimizer, self.step)
            stats = self._update(ro, noisy[k], olds[k], refs[k], advantages_B)
            for key, value in stats.items():
                sums[key] += value / self.rl.inner_updates
            self.step += 1
        t2 = time.perf_counter()
        rewards = ro.rewards_B
        record = {
            **sums,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            **{f"reward_{name}": float(v.mean()) for name, v in ro.parts.items()},
            "accuracy": float(ro.correct_B.float().mean()),
            "completion_len": float(ro.mask_BC.sum(-1).float().mean()),
            "lr": lr,
            "round": self.step // self.rl.inner_updates,
            "nfe": ro.counters.nfe,
            "rollout_s": round(t1 - t0, 4),
            "update_s": round(t2 - t1, 4),
        }
        return record

    def _uses_reference(self) -> bool:
        return self.rl.beta > 0 and self.reference is not None

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
        return torch.cat([self._logprobs(model, ro, noisy_BP, slice(lo, min(lo + mb, B))) for lo in range(0, B, mb)])

    def _update(self, ro: Rollouts, noisy_BP: torch.Tensor, old_BC: torch.Tensor, ref_BC: torch.Tensor | None,
                advantages_B: torch.Tensor) -> dict[str, float]:  # fmt: skip
        """One optimizer step over the round's completions, micro_batch_size rows per forward. The loss
        is the mean over all B sequences, so each micro-batch's mean is weighted by its share of rows."""
        B = ro.completion_BC.shape[0]
        mb = self.cfg.micro_batch_size
        loss_sum, clip_sum, kl_sum, tokens = 0.0, 0.0, 0.0, 0.0
        for lo in range(0, B, mb):
            rows = slice(lo, min(lo + mb, B))
            logp_BC = self._logprobs(self.model, ro, noisy_BP, rows)
            out = grpo_loss(logp_BC, old_BC[rows], None if ref_BC is None else ref_BC[rows], advantages_B[rows],
                            ro.mask_BC[rows], clip_eps=self.rl.clip_eps, beta=self.rl.beta)  # fmt: skip
            share = (rows.stop - rows.start) / B
            (out.loss * share).backward()
            n = float(ro.mask_BC[rows].sum())
            loss_sum += float(out.loss.detach()) * share
            clip_sum += float(out.clip_fraction) * n
            kl_sum += float(out.kl_mean) * n
            tokens += n
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        grad_norm = clip_grad_norm(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(tokens, 1.0)
        return {"loss": loss_sum, "clip_fraction": clip_sum / tokens, "kl": kl_sum / tokens,
                "grad_norm": float(grad_norm)}  # fmt: skip

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[float]:
        """Run rounds up to `training.steps` optimizer steps; returns each round's mean loss."""
        progress = Progress(self.log_cfg, self.cfg.steps, self.step, enabled=self.env.is_main)
        self.metrics.start(self.step)
        losses: list[float] = []
        try:
            while self.step < self.cfg.steps:
                t0 = time.perf_counter()
                record = self.run_round()
                losses.append(record["loss"])
                step_s = time.perf_counter() - t0
                tokens = self.cfg.global_batch_size * self.policy.sampler.gen_length
                progress.update(self.step, record["loss"], tokens / step_s, record)
                self.metrics.log(self.step, {**record, "step_s": round(step_s, 4)})
                if self.checkpoints.should_save(self.step, self.cfg.steps):
                    self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict())
        finally:
            progress.close()
        return losses
