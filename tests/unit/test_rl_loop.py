"""The diffu-GRPO training loop (training/grpo.py) on a tiny random model, one process on a CPU."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from dllm.checkpoint.manager import latest_checkpoint, read_trainer_state
from dllm.cli import main as cli_main
from dllm.rl.logprob import completion_logprobs
from dllm.training import grpo as grpo_mod
from dllm.training.build import build_trainer
from dllm.training.metrics import read_metrics
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import load_spec, write_yaml

# a user reward with a spread on a random model (exact answers are all wrong there): distinct characters
USER_REWARD = "def variety(sample):\n    return len(set(sample.completion)) / 8\n"


def _rl_yaml(folder: Path, **rl: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    values = {
        "run": {"name": "grpo", "output_dir": str(folder / "runs")},
        "model": {"preset": "tiny"},
        "training": {"steps": 4, "global_batch_size": 8, "micro_batch_size": 4, "grad_clip": None},
        "logging": {"every_steps": 1, "progress": "off", "tensorboard": "off"},
        "rl": {
            "rewards": [{"name": "exact_answer"}, {"name": "rl_user_reward:variety", "weight": 0.5}],
            "group_size": 4,
            "inner_updates": 2,
            "prompts": {"task": "addition", "num_prompts": 16, "seed": 1},
            "sampler": {"gen_length": 8, "temperature": 1.0},
            **rl,
        },
    }
    return write_yaml(folder / "train.yaml", values)


@pytest.fixture
def user_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "rl_user_reward.py").write_text(USER_REWARD, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_two_rounds_write_the_rl_metrics_and_a_checkpoint_with_the_generator(tmp_path: Path, user_reward):
    spec, warnings = resolve_run_spec(load_spec(_rl_yaml(tmp_path)))
    assert warnings == []
    run_dir = prepare_run_dir(spec)
    losses = train_from_run_dir(run_dir)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [2, 4] and [r["round"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["accuracy"] <= 1.0 and 0 < r["completion_len"] <= 8
        assert r["reward_std"] > 0, "the user reward spreads the group"
        assert r["reward_mean"] == pytest.approx(r["reward_exact_answer"] + 0.5 * r["reward_rl_user_reward:variety"])
        assert 0.0 <= r["clip_fraction"] <= 1.0 and r["kl"] >= 0.0 and r["grad_norm"] > 0
    state = read_trainer_state(latest_checkpoint(run_dir / "checkpoints"))
    assert state["step"] == 4 and len(state["generators"]) == 1 and len(state["generators"][0]) > 0


def test_one_update_with_beta_0_is_a_reinforce_step(tmp_path: Path, user_reward, monkeypatch):
    """mu = 1, beta = 0: the ratio is 1 and the gradient is REINFORCE with the group mean as baseline,
    -1/B sum_b A_b * mean_t grad log p(o_bt), assembled here from the recorded rollouts and prompt mask."""
    spec, _ = resolve_run_spec(load_spec(_rl_yaml(tmp_path, beta=0.0, inner_updates=1), "training.steps=1"))
    trainer = build_trainer(spec, prepare_run_dir(spec))
    assert trainer.reference is None
    model0 = copy.deepcopy(trainer.model)
    seen: dict[str, Any] = {}
    real_rollout, real_mask = grpo_mod.rollout, trainer._mask_prompts
    monkeypatch.setattr(grpo_mod, "rollout", lambda *a, **k: seen.setdefault("ro", real_rollout(*a, **k)))
    monkeypatch.setattr(trainer, "_mask_prompts", lambda ro: seen.setdefault("noisy", real_mask(ro)))
    grads: dict[str, torch.Tensor] = {}
    real_step = trainer.optimizer.step

    def step(*a, **k):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real_step(*a, **k)

    monkeypatch.setattr(trainer.optimizer, "step", step)
    trainer.run_round()
    ro, noisy = seen["ro"], seen["noisy"]
    r_NG = ro.rewards_B.double().reshape(-1, 4)
    adv_B = ((r_NG - r_NG.mean(1, keepdim=True)) / (r_NG.std(1, keepdim=True) + 1e-4)).reshape(-1).float()
    assert adv_B.abs().sum() > 0
    logp_BC = completion_logprobs(model0, noisy, ro.completion_BC, trainer.policy.special.mask_id,
                                  prompt_valid_BP=ro.prompt_valid_BP)  # fmt: skip
    m = ro.mask_BC.float()
    loss = -(adv_B * (logp_BC * m).sum(1) / m.sum(1).clamp_min(1)).mean()
    loss.backward()
    expected = {n: p.grad for n, p in model0.named_parameters() if p.grad is not None}
    assert expected.keys() == grads.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("rl", "message"),
    [
        ({"prompts": None}, "rl.prompts: an rl run needs prompts with reference answers"),
        ({"group_size": 1}, "rl.group_size"),
        ({"rewards": [{"name": "no_such_module_xyz:score"}]}, "rl.rewards.0.name: cannot import module"),
        ({"prompts": {"path": "prompts.jsonl"}}, 'prompts.jsonl:1: expected {"prompt": "...", "answer": "..."}'),
        ({"prompts": {"task": "nope"}}, "rl.prompts.task: unknown task 'nope'"),
    ],
)
def test_bad_rl_input_is_one_line_through_launch_before_any_generation(
    tmp_path: Path, capsys, monkeypatch, user_reward, rl: dict, message: str
):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1 + 1 ="}) + "\n", encoding="utf-8")
    monkeypatch.setattr(grpo_mod, "rollout", lambda *a, **k: pytest.fail("generated before the error"))
    train_yaml = _rl_yaml(tmp_path, **rl)
    assert cli_main.main(["launch", "--config", str(train_yaml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_resume_between_rounds_is_bit_exact(tmp_path: Path, user_reward):
    """2 rounds, stop, resume for 2 more = 4 rounds in one go: the same metrics and weights (the
    generator state that draws prompts, samples and prompt masks is in the checkpoint)."""
    whole = _rl_yaml(tmp_path / "whole")
    split = _rl_yaml(tmp_path / "split")
    sched = ("scheduler.name=constant", "training.steps=8")
    spec, _ = resolve_run_spec(load_spec(whole, *sched))
    train_from_run_dir(whole_dir := prepare_run_dir(spec))
    spec, _ = resolve_run_spec(load_spec(split, *sched, "checkpointing.every_steps=4"))
    run_dir = prepare_run_dir(spec)
    trainer = build_trainer(spec, run_dir)
    trainer.cfg = trainer.cfg.model_copy(update={"steps": 4})  # stop after 2 rounds, as a killed run would
    assert len(trainer.fit()) == 2
    trainer.metrics.close()
    assert latest_checkpoint(run_dir / "checkpoints").name.endswith("4")
    assert len(train_from_run_dir(run_dir)) == 2, "resumed from step 4: two rounds left"
    drop = ("rollout_s", "update_s", "step_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(run_dir)] == [
        {k: v for k, v in r.items() if k not in drop} for r in read_metrics(whole_dir)
    ]
    a = build_trainer(load_spec(whole_dir / "config.yaml"), whole_dir).model.state_dict()
    b = build_trainer(load_spec(run_dir / "config.yaml"), run_dir).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rl_over_ranks_needs_whole_groups_per_rank_and_data_parallelism_only(tmp_path: Path):
    from dllm.config.rules import check_rl
    from dllm.errors import ConfigError

    yaml_path = _rl_yaml(tmp_path)  # 8 completions per round, groups of 4: 2 prompts
    check_rl(load_spec(yaml_path, "topology.nproc_per_node=2"))
    with pytest.raises(ConfigError, match="2 prompts per round .* do not split over 4 processes"):
        check_rl(load_spec(yaml_path, "topology.nproc_per_node=4"))
    with pytest.raises(ConfigError, match="topology: rl runs data-parallel only"):
        check_rl(load_spec(yaml_path, "topology.nproc_per_node=2", "topology.tp_size=2"))


@pytest.mark.parametrize(("poison", "bad_step"), [("reward", 3), ("gradient", 4)])
def test_a_non_finite_update_stops_the_run_with_the_supervised_one_line_error(
    tmp_path: Path, capsys, monkeypatch, user_reward, poison: str, bad_step: int
):
    """Round 1 (steps 1-2) trains and publishes step 2. In round 2 a NaN reward makes step 3's loss NaN,
    or an infinite gradient makes only step 4's gradient norm inf: the launch stops at that very step
    with the supervised trainer's one line and exit code 2, and publishes nothing after step 2."""
    calls = {"rollout": 0, "grad": 0}
    real_rollout, real_logprobs = grpo_mod.rollout, grpo_mod.completion_logprobs

    def rollout(*a, **k):
        ro = real_rollout(*a, **k)
        calls["rollout"] += 1
        if poison == "reward" and calls["rollout"] == 2:
            ro.rewards_B = ro.rewards_B * float("nan")
        return ro

    def logprobs(*a, **k):
        logp_BC = real_logprobs(*a, **k)
        if torch.is_grad_enabled():
            calls["grad"] += 1  # two micro-batches per update: calls 7 and 8 are step 4's
            if poison == "gradient" and calls["grad"] >= 7:
                logp_BC.register_hook(lambda g: g * float("inf"))  # a finite loss, an infinite gradient
        return logp_BC

    monkeypatch.setattr(grpo_mod, "rollout", rollout)
    monkeypatch.setattr(grpo_mod, "completion_logprobs", logprobs)
    train_yaml = _rl_yaml(tmp_path)
    args = ["--set", "training.steps=6", "--set", "checkpointing.every_steps=2"]
    assert cli_main.main(["launch", "--config", str(train_yaml), *args]) == 2
    err = capsys.readouterr().err.splitlines()  # the launch's own notes, then the error
    errors = [line for line in err if line.startswith("dllm: error: ")]
    assert errors == [err[-1]] and "Traceback" not in "\n".join(err), err
    what = "loss is nan and gradient norm is nan" if poison == "reward" else "gradient norm is (nan|inf)"
    stop = "; stopped without saving this step \\(the last checkpoint is intact\\)"
    assert re.match(f"dllm: error: step {bad_step}: the {what}{stop}", errors[0]), errors[0]
    run_dir = tmp_path / "runs" / "grpo"
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000002"
    assert [r["step"] for r in read_metrics(run_dir)] == [2]


def test_profiling_traces_whole_rounds_where_supervised_runs_put_theirs(tmp_path: Path, capsys, user_reward):
    """Steps 2-3 straddle two rounds of 2 updates: both rounds are profiled, one span each, into
    RUN/profile/ as the supervised trainer writes its trace."""
    profiling = ("profiling.start_step=2", "profiling.steps=2", "profiling.record_shapes=true")
    spec, _ = resolve_run_spec(load_spec(_rl_yaml(tmp_path), "training.steps=6", *profiling))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    trace = run_dir / "profile" / "trace-steps1-4-rank0.json"
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [trace.name]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::linear" in names
    assert {n for n in names if str(n).startswith("dllm step")} == {"dllm steps 1-2", "dllm steps 3-4"}
    assert f"dllm: profiler trace: {trace}" in capsys.readouterr().err
