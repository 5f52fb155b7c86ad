"""rl/rewards.py and config/rl.py: registered rewards, user rewards by `module:function`, config errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dllm.config.loading import validate_config
from dllm.config.rl import RewardConfig, RLConfig
from dllm.errors import ConfigError
from dllm.evaluation.tasks import Example, Task, load_task
from dllm.rl.rewards import ExactAnswer, FormatMatch, LengthPenalty, Rewards, Sample

ADD = Task("addition3", [Example("12 + 30 =", " 42")], 8)


def sample(completion: str, task: Task = ADD, example: Example | None = None, num_tokens: int = 4) -> Sample:
    ex = example or task.examples[0]
    return Sample(ex.prompt, completion, num_tokens, ex, task)


def rl(**kw) -> RLConfig:
    return validate_config(RLConfig, {"rewards": [{"name": "exact_answer"}], **kw}, source="rl.yaml", base_dir=None)


def test_exact_answer_cuts_at_the_stop_string_and_uses_the_verifier():
    reward = ExactAnswer(RewardConfig(name="exact_answer"))
    assert reward(sample(" 42\n7 + 1 = 8")) == 1.0  # the answer is the text before the first newline
    assert reward(sample(" 42 ")) == 1.0 and reward(sample(" 43")) == 0.0 and reward(sample("4\n2")) == 0.0
    countdown = load_task("countdown", 1, seed=0)
    ex = countdown.examples[0]
    target = ex.prompt.split()[-2]
    assert reward(sample(ex.answer, countdown, ex)) == 1.0
    assert reward(sample(f" ({ex.answer.strip()})\nmore", countdown, ex)) == 1.0  # another right expression
    assert reward(sample(f" {target}", countdown, ex)) == 0.0  # the target itself is not a given number


def test_format_and_length_penalty():
    full = FormatMatch(RewardConfig(name="format", pattern=r"\d+"))
    anywhere = FormatMatch(RewardConfig(name="format", pattern=r"\d+", match="search"))
    assert full(sample(" 42\n")) == 1.0 and full(sample("42 apples")) == 0.0
    assert anywhere(sample("42 apples")) == 1.0 and anywhere(sample("none")) == 0.0
    pen = LengthPenalty(RewardConfig(name="length_penalty", target_tokens=4, per_token=0.5))
    assert pen(sample("", num_tokens=3)) == 0.0 and pen(sample("", num_tokens=4)) == 0.0
    assert pen(sample("", num_tokens=7)) == pytest.approx(-1.5)


def test_weighted_sum_of_terms(tmp_path: Path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent("""
        def short(sample):
            return len(sample.completion) < 4

        NOT_A_FUNCTION = 3

        def bad(sample):
            return "high"
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = rl(rewards=[{"name": "exact_answer", "weight": 2.0}, {"name": "my_rewards:short", "weight": 0.5},
                      {"name": "length_penalty", "target_tokens": 2, "per_token": 0.25}])  # fmt: skip
    rewards = Rewards(cfg.rewards)
    total, parts = rewards.score([sample(" 42", num_tokens=3), sample(" 41 and more", num_tokens=2)])
    assert parts["exact_answer"].tolist() == [1.0, 0.0] and parts["my_rewards:short"].tolist() == [1.0, 0.0]
    assert parts["length_penalty"].tolist() == [-0.25, 0.0]
    assert total.tolist() == [2.0 + 0.5 - 0.25, 0.0]
    with pytest.raises(ConfigError, match=r"rl\.rewards\.0\.name: module 'my_rewards' has no 'nope'"):
        Rewards([RewardConfig(name="my_rewards:nope")])
    with pytest.raises(ConfigError, match=r"rl\.rewards\.0\.name: reward 'my_rewards:NOT_A_FUNCTION' is a int"):
        Rewards([RewardConfig(name="my_rewards:NOT_A_FUNCTION")])
    with pytest.raises(ConfigError, match=r"reward 'my_rewards:bad' returned 'high'; a reward must return a finite"):
        Rewards([RewardConfig(name="my_rewards:bad")]).score([sample(" 42")])


def test_a_reward_that_cannot_be_imported_is_one_config_error_naming_the_field():
    cfg = rl(rewards=[{"name": "format", "pattern": "x"}, {"name": "no_such_module_xyz.sub:fn"}])
    with pytest.raises(ConfigError) as info:
        Rewards(cfg.rewards)
    msg = str(info.value)
    assert msg.startswith("rl.rewards.1.name: cannot import module 'no_such_module_xyz.sub'") and "PYTHONPATH" in msg
    assert "\n" not in msg and info.value.exit_code == 2


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"group_size": 1}, r"rl.yaml: group_size: Input should be greater than or equal to 2"),
        ({"rewards": []}, r"rl.yaml: rewards: List should have at least 1 item"),
        ({"rewards": [{"name": "exact"}]}, r"rewards.0.name: unknown reward 'exact': use one of exact_answer, format, "
                                           r"length_penalty, or a user function as module:function"),
        ({"rewards": [{"name": "os.system"}]}, r"rewards.0.name: unknown reward 'os.system'"),
        ({"rewards": [{"name": "format"}]}, r"rewards.0: reward format needs a pattern"),
        ({"rewards": [{"name": "format", "pattern": "("}]}, r"rewards.0: pattern '\(' is not a regular expression"),
        ({"rewards": [{"name": "exact_answer", "pattern": "x"}]}, r"pattern applies to reward format only"),
        ({"rewards": [{"name": "length_penalty"}]}, r"reward length_penalty needs target_tokens"),
        ({"p_mask_prompt": 1.0}, r"p_mask_prompt: Input should be less than 1"),
        ({"inner_updates": 0}, r"inner_updates: Input should be greater than or equal to 1"),
        ({"beta": -0.1}, r"beta: Input should be greater than or equal to 0"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(values, message):
    with pytest.raises(ConfigError, match=message):
        rl(**values)


def test_config_defaults_and_user_names():
    cfg = rl(rewards=[{"name": "pkg.mod:fn", "weight": 0.5}])
    assert (cfg.group_size, cfg.p_mask_prompt, cfg.clip_eps, cfg.beta, cfg.inner_updates) == (8, 0.15, 0.2, 0.04, 12)
    assert cfg.rewards[0].name == "pkg.mod:fn"


def test_every_rl_field_has_a_one_line_description():
    schema = RLConfig.model_json_schema()
    for obj_name, obj in {"RLConfig": schema, **schema["$defs"]}.items():
        assert obj["description"].strip() and obj["additionalProperties"] is False, obj_name
        for prop, body in obj["properties"].items():
            assert body.get("description", "").strip() and "\n" not in body["description"], (obj_name, prop)
