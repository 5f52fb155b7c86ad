"""SamplerConfig rules and `resolve_sampler`: auto fields from the run, refused combinations with the reason."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dllm.config.model import ModelConfig
from dllm.config.profile import DecodeProfile, build_profile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError
from tests.helpers import tiny_train_values


def run_spec(**objective) -> RunSpec:
    return RunSpec.model_validate(tiny_train_values(objective=objective))


def profile(spec: RunSpec | None, model: ModelConfig | None = None) -> DecodeProfile:
    """The decode profile a run (or, with spec None, a model folder) records."""
    shift_logits = bool(model is not None and model.shift_logits)
    objective = spec.objective if spec is not None else None
    return build_profile(objective, shift_logits=shift_logits, max_length=256, mask_id=3, pad_id=0, eos_id=1,
                         num_tokens=64)  # fmt: skip


def test_defaults_one_block_one_token_per_step():
    cfg = SamplerConfig(gen_length=24)
    assert (cfg.block, cfg.num_blocks, cfg.total_steps) == (24, 1, 24)
    assert SamplerConfig(gen_length=24, block_length=8, steps=6).total_steps == 6


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gen_length": 10, "block_length": 4}, "must divide gen_length"),
        ({"gen_length": 8, "block_length": 4, "steps": 3}, "multiple of the number of blocks"),
        ({"gen_length": 8, "block_length": 8, "sub_block_length": 3}, "sub_block_length 3 must divide"),
        ({"gen_length": 8, "block_length": 8, "sub_block_length": 4, "steps": 3}, "multiple of the 2 sub-blocks"),
        ({"policy": "ancestral", "cache": "dual"}, "its own reverse process"),
        ({"cfg_scale": 1.0, "cache": "prefix"}, "use cache none"),
        ({"refresh_every": 2}, "refresh_every applies"),
        ({"attention": "bidirectional", "cache": "block"}, "need block attention"),
        ({"attention": "block", "cache": "dual"}, "use cache block"),
        ({"attention": "block", "policy": "uniform"}, "decodes bidirectional models"),
        ({"threshold": 0.0}, "greater than 0"),
        ({"top_p": 1.5}, "less than or equal to 1"),
    ],
)
def test_bad_sampler_combinations_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        SamplerConfig(**fields)


def test_auto_attention_and_block_length_from_a_block_run():
    cfg = resolve_sampler(SamplerConfig(gen_length=16), profile(run_spec(name="bd3lm", block_size=8), None))
    assert (cfg.attention, cfg.block_length, cfg.shift, cfg.sub_block_length) == ("block", 8, "off", None)
    with pytest.raises(ConfigError, match="trained with blocks of 8"):
        resolve_sampler(
            SamplerConfig(gen_length=16, block_length=16), profile(run_spec(name="bd3lm", block_size=8), None)
        )
    shifted = resolve_sampler(
        SamplerConfig(gen_length=16), profile(run_spec(name="bd3lm", block_size=8, shift=True), None)
    )
    assert shifted.shift == "on"


def test_fast_dllm_v2_samples_shifted_in_its_sub_blocks():
    spec = run_spec(name="fast_dllm_v2", block_size=8, sub_block_size=4)
    cfg = resolve_sampler(SamplerConfig(gen_length=16), profile(spec, None))
    assert (cfg.attention, cfg.block_length, cfg.sub_block_length, cfg.shift) == ("block", 8, 4, "on")


def test_bidirectional_runs_and_model_shift():
    cfg = resolve_sampler(SamplerConfig(cache="dual"), profile(run_spec(name="mdlm"), None))
    assert (cfg.attention, cfg.shift) == ("bidirectional", "off")
    dream = ModelConfig(family="dream", preset="tiny", vocab_size=64)
    assert resolve_sampler(SamplerConfig(), profile(None, dream)).shift == "on"  # a model folder: no objective
    assert resolve_sampler(SamplerConfig(shift="off"), profile(None, dream)).shift == "off"  # explicit wins
    with pytest.raises(ConfigError, match="need block attention.*resolved to bidirectional"):
        resolve_sampler(SamplerConfig(cache="block"), profile(run_spec(name="mdlm"), None))


def test_uniform_runs_need_the_uniform_policy_and_back():
    with pytest.raises(ConfigError, match="no mask token.*use policy uniform"):
        resolve_sampler(SamplerConfig(), profile(run_spec(name="uniform"), None))
    assert resolve_sampler(SamplerConfig(policy="uniform"), profile(run_spec(name="uniform"), None)).policy == "uniform"
    with pytest.raises(ConfigError, match="uniform decodes uniform-state models"):
        resolve_sampler(SamplerConfig(policy="uniform"), profile(run_spec(name="mdlm"), None))


def test_block_attention_without_a_known_block_length_is_refused():
    with pytest.raises(ConfigError, match="needs the model's block length"):
        resolve_sampler(SamplerConfig(gen_length=16, attention="block"), profile(None, None))


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        ({"generation": "causal", "policy": "threshold"}, "policy"),
        ({"generation": "causal", "cache": "dual"}, "cache"),
        ({"generation": "causal", "steps": 99}, "steps"),
        ({"generation": "causal", "block_length": 8, "gen_length": 16}, "block_length"),
        ({"generation": "causal", "compile": True}, "compile"),
        ({"generation": "causal", "denoise_cache": False}, "denoise_cache"),
        ({"edit_kappa": "linear"}, "edit_kappa"),  # a masked model's canvas loop
        ({"denoise_t_min": 0.1}, "denoise_t_min"),
    ],
)
def test_a_field_the_chosen_mode_does_not_read_is_refused(fields, refused):
    """Every generation mode reads its own fields (config.sampler.READS): one set to anything but its default is
    refused in one line naming it, rather than accepted and ignored."""
    with pytest.raises(ConfigError, match=f"^sampler.{refused}: no effect on ") as e:
        resolve_sampler(SamplerConfig(**fields), profile(run_spec(name="mdlm"), None))
    assert "\n" not in str(e.value)
    defaults = {k: SamplerConfig.model_fields[k].default for k in fields if k != "generation"}
    resolve_sampler(SamplerConfig(**{**fields, **defaults}), profile(run_spec(name="mdlm"), None))  # defaults: fine


def test_the_fields_each_mode_reads_cover_the_sampler():
    from dllm.config.sampler import READS

    every = set(SamplerConfig.model_fields)
    assert set().union(*READS.values()) == every  # no field is read by no mode
    assert READS["causal"] < READS["canvas"]  # causal decoding reads a subset: the shared base and top-k/p
