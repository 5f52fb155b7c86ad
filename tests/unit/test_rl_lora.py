"""An rl run with LoRA: the reference policy is the policy's base weights with its adapters off, not a copy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dllm.models import factory
from dllm.models.lora import adapted_modules, adapters_disabled
from dllm.rl.logprob import completion_logprobs
from dllm.training import grpo as grpo_mod
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir
from tests.helpers import load_spec
from tests.unit.test_rl_loop import _rl_yaml, user_reward  # noqa: F401 (a fixture)


def _storages(obj: object) -> set[int]:
    """data_ptr of every parameter and buffer of every module the object holds as an attribute."""
    modules = [v for v in vars(obj).values() if isinstance(v, nn.Module)]
    return {t.data_ptr() for m in modules for t in [*m.parameters(), *m.buffers()]}


@pytest.mark.usefixtures("user_reward")
def test_the_lora_reference_is_the_base_model_without_a_copy_and_kl_starts_at_zero(tmp_path: Path, monkeypatch):
    overrides = ("lora.rank=4", "training.steps=2", "rl.inner_updates=1", "rl.beta=0.1")
    spec, _ = resolve_run_spec(load_spec(_rl_yaml(tmp_path), *overrides))
    trainer = build_trainer(spec, prepare_run_dir(spec))
    model = trainer.model
    assert trainer.reference is None and trainer.reference_is_base and trainer._uses_reference()
    assert _storages(trainer) == {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}, "one set of weights"
    assert len(adapted_modules(model)) > 0

    # the base model: the same initial weights built without adapters
    base = factory.build_model(spec.model, None, spec.training.seed)
    base.load_state_dict(factory.initial_state(spec.model, None, spec.training.seed))
    seen: dict[str, list] = {"ro": [], "ref": []}
    real_rollout, real_ref = grpo_mod.rollout, trainer._reference_logprobs

    def rollout(*a, **k):
        seen["ro"].append(real_rollout(*a, **k))
        return seen["ro"][-1]

    def reference(ro, noisy_BP):
        seen["ref"].append((noisy_BP, real_ref(ro, noisy_BP)))
        return seen["ref"][-1][1]

    monkeypatch.setattr(grpo_mod, "rollout", rollout)
    monkeypatch.setattr(trainer, "_reference_logprobs", reference)
    first = trainer.run_round()
    assert first["kl"] == 0.0, "B = 0: the policy is its base model before the first update"
    second = trainer.run_round()
    assert second["kl"] > 0.0
    for ro, (noisy_BP, ref_BC) in zip(seen["ro"], seen["ref"], strict=True):
        with torch.no_grad():
            expected = completion_logprobs(base, noisy_BP, ro.completion_BC, trainer.policy.special.mask_id,
                                           prompt_valid_BP=ro.prompt_valid_BP)  # fmt: skip
        torch.testing.assert_close(ref_BC, expected, rtol=0, atol=0)
    with torch.no_grad():  # the adapters trained, and come back on after the reference forward
        ro, (noisy_BP, ref_BC) = seen["ro"][1], seen["ref"][1]
        policy_BC = completion_logprobs(model, noisy_BP, ro.completion_BC, trainer.policy.special.mask_id,
                                        prompt_valid_BP=ro.prompt_valid_BP)  # fmt: skip
    assert not torch.equal(policy_BC, ref_BC)
    assert all(m.adapter_enabled for m in adapted_modules(model).values())


def test_adapters_disabled_restores_them_after_an_error(tmp_path: Path):
    spec, _ = resolve_run_spec(load_spec(_rl_yaml(tmp_path), "lora.rank=4"))
    model = factory.build_model(spec.model, spec.lora, 0)
    with pytest.raises(RuntimeError), adapters_disabled(model):
        assert not any(m.adapter_enabled for m in adapted_modules(model).values())
        raise RuntimeError("boom")
    assert all(m.adapter_enabled for m in adapted_modules(model).values())
