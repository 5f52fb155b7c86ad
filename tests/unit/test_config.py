"""Config: RunSpec/PrepareSpec sections, YAML loading, overrides, error messages, rules, templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import BaseModel, ValidationError

from dllm.config.base import Section
from dllm.config.data import TokenizerConfig
from dllm.config.loading import (
    apply_overrides,
    dump_config,
    format_validation_error,
    load_config,
    validate_config,
)
from dllm.config.model import MODEL_PRESETS, ModelConfig
from dllm.config.prepare import JsonlSourceConfig, PrepareSpec
from dllm.config.rules import round_up
from dllm.config.sampler import SamplerConfig
from dllm.config.spec import RunSpec
from dllm.config.templates import _section_class, commented_yaml, section_classes
from dllm.config.training import LoggingConfig
from dllm.data.prepare import prepare
from dllm.errors import ConfigError, UserError
from dllm.training import preflight as preflight_mod
from dllm.training.preflight import resolve_run_spec
from tests.helpers import PREPARE, tiny_train_values, write_corpus, write_yaml

# --------------------------------------------------------------------------------------------------
# helpers


def _sections(cls: type[BaseModel], seen: set[type[BaseModel]] | None = None) -> set[type[BaseModel]]:
    """`cls` and every section class reachable from its fields."""
    seen = set() if seen is None else seen
    seen.add(cls)
    for field in cls.model_fields.values():
        for sub in section_classes(field.annotation):
            if sub not in seen:
                _sections(sub, seen)
    return seen


ALL_SECTIONS = sorted(_sections(RunSpec) | _sections(PrepareSpec) | {SamplerConfig}, key=lambda c: c.__name__)


def _spec(root: Path, **sections: dict[str, Any]) -> RunSpec:
    """A tiny RunSpec whose relative paths resolve against `root`."""
    return validate_config(RunSpec, tiny_train_values(**sections), source="train.yaml", base_dir=root)


def _load_text(tmp_path: Path, text: str, cls: type[BaseModel] = RunSpec, overrides: list[str] | None = None):
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config(cls, path, overrides)


def _config_error(tmp_path: Path, text: str, cls: type[BaseModel] = RunSpec, overrides: list[str] | None = None):
    with pytest.raises(ConfigError) as info:
        _load_text(tmp_path, text, cls, overrides)
    return str(info.value)


TRAIN_TEXT = """\
run:
  name: t
model:
  preset: tiny
data:
  path: data/prepared
  seq_len: 32
training:
  steps: 4
  global_batch_size: 8
  micro_batch_size: 4
logging:
  every_steps: 1
"""


@pytest.fixture(scope="module")
def artifact_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with data/prepared (byte tokenizer, seq_len 32), shared read-only by this module."""
    root = tmp_path_factory.mktemp("cfg_artifact")
    write_corpus(root / "data" / "train.jsonl")
    write_yaml(root / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, root / "prepare.yaml"), root)
    return root


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


# --------------------------------------------------------------------------------------------------
# sections: docs, strictness, immutability


def test_every_section_is_strict_and_frozen():
    assert {c.__name__ for c in ALL_SECTIONS} >= {
        "RunSpec",
        "RunConfig",
        "ModelConfig",
        "TokenizerConfig",
        "DataConfig",
        "MDLMConfig",
        "BD3LMConfig",
        "FastDLLMv2Config",
        "UniformConfig",
        "LoraConfig",
        "TrainingConfig",
        "OptimizerConfig",
        "SchedulerConfig",
        "CheckpointingConfig",
        "LoggingConfig",
        "TopologyConfig",
        "PrepareSpec",
        "JsonlSourceConfig",
        "SamplerConfig",
    }
    for cls in ALL_SECTIONS:
        assert issubclass(cls, Section), cls
        assert cls.model_config.get("extra") == "forbid", cls
        assert cls.model_config.get("frozen") is True, cls


@pytest.mark.parametrize("cls", ALL_SECTIONS, ids=lambda c: c.__name__)
def test_unknown_key_is_rejected(cls: type[BaseModel]):
    with pytest.raises(ValidationError) as info:
        cls.model_validate({"no_such_field": 1})
    assert any(e["type"] == "extra_forbidden" and e["loc"] == ("no_such_field",) for e in info.value.errors())


def test_loaded_spec_is_immutable(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT)
    with pytest.raises(ValidationError):
        spec.training = spec.training  # type: ignore[misc]
    with pytest.raises(ValidationError):
        spec.training.steps = 99  # type: ignore[misc]
    with pytest.raises(ValidationError):
        spec.model.hidden_size = 1  # type: ignore[misc]
    assert spec.training.steps == 4 and spec.model.hidden_size == MODEL_PRESETS["tiny"]["hidden_size"]


def _check_descriptions(cls: type[BaseModel], where: str) -> list[str]:
    problems = []
    for name, field in cls.model_fields.items():
        desc = (field.description or "").strip()
        if not desc or "\n" in desc:
            problems.append(f"{where}.{name}: {field.description!r}")
        for sub in section_classes(field.annotation):
            problems += _check_descriptions(sub, f"{where}.{name}")
    return problems


@pytest.mark.parametrize("cls", [RunSpec, PrepareSpec, SamplerConfig], ids=lambda c: c.__name__)
def test_every_field_has_one_line_description(cls: type[BaseModel]):
    assert _check_descriptions(cls, cls.__name__) == []


@pytest.mark.parametrize("cls", [RunSpec, PrepareSpec, SamplerConfig], ids=lambda c: c.__name__)
def test_json_schema_describes_every_property(cls: type[BaseModel]):
    schema = cls.model_json_schema()
    objects = {cls.__name__: schema, **schema.get("$defs", {})}
    count = 0
    for obj_name, obj in objects.items():
        assert obj.get("additionalProperties") is False, obj_name
        assert obj.get("description", "").strip(), obj_name
        for prop, body in obj["properties"].items():
            desc = body.get("description", "")
            assert desc.strip() and "\n" not in desc, f"{obj_name}.{prop}: {desc!r}"
            count += 1
    expected = sum(len(c.model_fields) for c in _sections(cls))
    assert count == expected


# --------------------------------------------------------------------------------------------------
# individual sections


def test_minimal_run_spec_fills_defaults(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT)
    assert spec.objective.name == "mdlm" and spec.optimizer.name == "adamw"
    assert spec.tokenizer.kind == "byte" and spec.tokenizer.path is None
    assert spec.topology.world_size == 1 and spec.topology.dp_size == -1
    assert spec.model.vocab_size is None  # filled by resolve_run_spec
    assert spec.data.shuffle is True
    assert spec.optimizer.betas == (0.9, 0.95)


def test_required_sections(tmp_path: Path):
    msg = _config_error(tmp_path, "run:\n  name: t\n")
    assert "required field is missing" in msg and ("data" in msg or "training" in msg)


def test_preset_fills_unset_fields_and_explicit_values_win():
    tiny = ModelConfig(preset="tiny")
    for key, value in MODEL_PRESETS["tiny"].items():
        assert getattr(tiny, key) == value
    mixed = ModelConfig.model_validate({"preset": "tiny", "hidden_size": 128, "num_kv_heads": None})
    assert mixed.hidden_size == 128  # explicit wins
    assert mixed.num_kv_heads is None  # an explicit null also wins over the preset's 2
    assert mixed.num_layers == MODEL_PRESETS["tiny"]["num_layers"]  # unset -> from the preset
    assert ModelConfig().hidden_size == 256  # no preset: field defaults
    with pytest.raises(ValidationError, match="unknown preset 'huge'"):
        ModelConfig(preset="huge")


def test_preset_through_override_keeps_explicit_fields(tmp_path: Path):
    text = TRAIN_TEXT.replace("  preset: tiny\n", "  preset: tiny\n  num_layers: 3\n")
    spec = _load_text(tmp_path, text, overrides=["model.preset=demo"])
    assert spec.model.hidden_size == MODEL_PRESETS["demo"]["hidden_size"]
    assert spec.model.num_layers == 3


def test_model_shape_checks():
    with pytest.raises(ValidationError, match="not divisible by num_heads"):
        ModelConfig(hidden_size=66, num_heads=4)
    assert ModelConfig(hidden_size=66, num_heads=4, head_dim=16).dim_per_head == 16
    with pytest.raises(ValidationError, match="not a multiple of num_kv_heads"):
        ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValidationError, match="must be even for RoPE"):
        ModelConfig(hidden_size=60, num_heads=4)
    cfg = ModelConfig(hidden_size=96, num_heads=4)
    assert cfg.kv_heads == 4 and cfg.dim_per_head == 24 and cfg.mlp_size == 256 and cfg.mlp_size % 64 == 0
    assert ModelConfig(intermediate_size=100).mlp_size == 100


def test_tokenizer_config_path_rules(tmp_path: Path):
    with pytest.raises(ValidationError, match="kind 'hf' needs path"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValidationError, match="kind 'byte' takes no path"):
        TokenizerConfig(kind="byte", path=tmp_path)
    assert TokenizerConfig(kind="hf", path=tmp_path).path == tmp_path
    with pytest.raises(ValidationError):
        TokenizerConfig(kind="sentencepiece")  # type: ignore[arg-type]


def test_run_name_pattern():
    for bad in ["", "-x", "a/b", "a b", "../x"]:
        with pytest.raises(ValidationError):
            RunSpec.model_validate({**tiny_train_values(), "run": {"name": bad}})
    assert RunSpec.model_validate({**tiny_train_values(), "run": {"name": "a.b_c-1"}}).run.name == "a.b_c-1"


@pytest.mark.parametrize(
    ("section", "values"),
    [
        ("training", {"steps": 0}),
        ("training", {"global_batch_size": -8}),
        ("training", {"device": "tpu"}),
        ("training", {"autocast_dtype": "float64"}),
        ("training", {"grad_clip": 0}),
        ("optimizer", {"lr": 0}),
        ("optimizer", {"weight_decay": -0.1}),
        ("optimizer", {"betas": [0.9]}),
        ("scheduler", {"min_lr_ratio": 1.5}),
        ("scheduler", {"warmup_steps": -1}),
        ("objective", {"eps": 1.0}),
        ("objective", {"schedule": "sqrt"}),
        ("checkpointing", {"keep_last_n": 0}),
        ("checkpointing", {"resume": "always"}),
        ("logging", {"progress": "fancy"}),
        ("topology", {"nproc_per_node": 0}),
        ("topology", {"backend": "mpi"}),
        ("data", {"seq_len": 0}),
    ],
)
def test_field_constraints(section: str, values: dict[str, Any]):
    with pytest.raises(ValidationError) as info:
        RunSpec.model_validate(tiny_train_values(**{section: values}))
    assert info.value.errors()[0]["loc"][0] == section


def test_grad_clip_null_disables():
    spec = RunSpec.model_validate(tiny_train_values(training={"grad_clip": None}))
    assert spec.training.grad_clip is None


@pytest.mark.parametrize("field", ["tensorboard", "progress"])
def test_yaml_off_boolean_is_accepted(tmp_path: Path, field: str):
    text = TRAIN_TEXT + f"  {field}: off\n"
    spec = _load_text(tmp_path, text)
    assert getattr(spec.logging, field) == "off"
    # the same through an override (parsed as YAML too)
    spec = _load_text(tmp_path, TRAIN_TEXT, overrides=[f"logging.{field}=off"])
    assert getattr(spec.logging, field) == "off"


def test_yaml_on_boolean_is_accepted_for_tensorboard(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT + "  tensorboard: on\n")
    assert spec.logging.tensorboard == "on"
    assert LoggingConfig(tensorboard=True).tensorboard == "on"  # type: ignore[arg-type]
    assert LoggingConfig(tensorboard=False).tensorboard == "off"  # type: ignore[arg-type]


def test_yaml_on_boolean_is_accepted_for_progress(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT + "  progress: on\n")
    assert spec.logging.progress != "off"


def test_sampler_config_rules():
    cfg = SamplerConfig()
    assert (cfg.gen_length, cfg.block, cfg.total_steps) == (32, 32, 32)  # block_length, steps unset: gen_length
    assert SamplerConfig(gen_length=64, block_length=16, steps=8).steps == 8
    with pytest.raises(ValidationError, match="must divide gen_length"):
        SamplerConfig(gen_length=30, block_length=8, steps=30)
    with pytest.raises(ValidationError, match="multiple of the number of blocks"):
        SamplerConfig(gen_length=64, block_length=16, steps=6)
    with pytest.raises(ValidationError):
        SamplerConfig(temperature=-0.1)
    with pytest.raises(ValidationError):
        SamplerConfig(policy="entropic")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        SamplerConfig(gen_length=0)
    with pytest.raises(ValidationError):
        SamplerConfig(nfe=3)  # type: ignore[call-arg]


def test_prepare_spec(tmp_path: Path):
    path = write_yaml(tmp_path / "prepare.yaml", PREPARE)
    spec = load_config(PrepareSpec, path)
    assert spec.output == (tmp_path / "data" / "prepared").absolute()
    assert spec.sources == [JsonlSourceConfig(path="data/train.jsonl")]
    assert spec.sources[0].text_field == "text" and spec.append_eos and not spec.add_bos
    assert spec.tokenizer == TokenizerConfig()
    with pytest.raises(ValidationError):
        PrepareSpec.model_validate({**PREPARE, "sources": []})
    with pytest.raises(ValidationError):
        PrepareSpec.model_validate({**PREPARE, "seq_len": 1})
    with pytest.raises(ValidationError):
        PrepareSpec.model_validate({**PREPARE, "layout": "padded"})


# --------------------------------------------------------------------------------------------------
# relative paths


def test_relative_paths_resolve_against_config_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    sub = tmp_path / "project" / "conf"
    sub.mkdir(parents=True)
    (sub / "tok").mkdir()
    values = tiny_train_values(tokenizer={"kind": "hf", "path": "tok"})
    values["run"]["output_dir"] = "../out"
    path = write_yaml(sub / "train.yaml", values)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_config(RunSpec, path)
    assert spec.data.path == sub / "data" / "prepared"
    assert spec.data.path.is_absolute()
    assert spec.tokenizer.path == sub / "tok"
    assert spec.run.output_dir.resolve() == (tmp_path / "project" / "out").resolve()
    # a relative config path is anchored at the working directory, then made absolute
    monkeypatch.chdir(tmp_path / "project")
    rel = load_config(RunSpec, Path("conf") / "train.yaml")
    assert rel.data.path.is_absolute() and rel.data.path.resolve() == (sub / "data" / "prepared").resolve()


def test_default_output_dir_and_absolute_paths(tmp_path: Path):
    absolute = tmp_path / "elsewhere" / "art"
    values = tiny_train_values(data={"path": str(absolute)})
    spec = load_config(RunSpec, write_yaml(tmp_path / "train.yaml", values))
    assert spec.data.path == absolute
    assert spec.run.output_dir == tmp_path / "runs"  # the default is resolved too


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = load_config(RunSpec, write_yaml(tmp_path / "t.yaml", tiny_train_values(data={"path": "~/art"})))
    assert spec.data.path == tmp_path / "home" / "art"


def test_paths_stay_relative_without_a_file():
    spec = RunSpec.model_validate(tiny_train_values())
    assert spec.data.path == Path("data/prepared") and spec.run.output_dir == Path("runs")


# --------------------------------------------------------------------------------------------------
# overrides


def test_apply_overrides_parses_yaml_values_and_creates_sections():
    data = {"training": {"steps": 4}, "checkpointing": None}
    out = apply_overrides(
        data,
        [
            "training.steps=50",
            "training.grad_clip=null",
            "logging.progress=off",
            "optimizer.betas=[0.8, 0.9]",
            "run.name=abc",
            "checkpointing.every_steps=3",
            "training.seed=",
            "model.preset = tiny",
        ],
    )
    assert out["training"] == {"steps": 50, "grad_clip": None, "seed": None}
    assert out["logging"] == {"progress": "off"}
    assert out["optimizer"] == {"betas": [0.8, 0.9]}
    assert out["run"] == {"name": "abc"}
    assert out["checkpointing"] == {"every_steps": 3}
    assert out["model"] == {"preset": "tiny"}
    assert data == {"training": {"steps": 4}, "checkpointing": None}  # the input is not modified


def test_yes_no_on_off_stay_words_where_a_field_takes_words(tmp_path: Path):
    """Only true and false are booleans (YAML 1.2): a field of words takes on/off/yes/no as written, in a file
    and through --set; a boolean field still reads them (and true/false) as booleans."""
    for word in ("on", "off"):
        assert _load_text(tmp_path, f"causal_context: {word}\n", SamplerConfig).causal_context == word
        assert _load_text(tmp_path, "", SamplerConfig, [f"causal_context={word}"]).causal_context == word
    assert apply_overrides({}, ["run.name=no", "a.b=[yes, On, TRUE]"]) == {"run": {"name": "no"},
                                                                           "a": {"b": ["yes", "On", True]}}  # fmt: skip
    for raw, want in (("true", True), ("yes", True), ("on", True), ("False", False), ("no", False), ("off", False)):
        assert _load_text(tmp_path, TRAIN_TEXT, overrides=[f"training.compile={raw}"]).training.compile is want
    assert _load_text(tmp_path, TRAIN_TEXT + "  tensorboard: on\n").logging.tensorboard == "on"


def test_apply_overrides_keeps_unparseable_yaml_as_text():
    assert apply_overrides({}, ["run.name=[oops"]) == {"run": {"name": "[oops"}}
    assert apply_overrides({}, ["a.b=x=y"]) == {"a": {"b": "x=y"}}


@pytest.mark.parametrize("item", ["training.steps", "=5", "training..steps=5", ".steps=1", "training.=1"])
def test_apply_overrides_rejects_bad_keys(item: str):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, [item])


def test_apply_overrides_rejects_descending_into_a_value():
    with pytest.raises(ConfigError, match="training.steps is not a section"):
        apply_overrides({"training": {"steps": 4}}, ["training.steps.x=1"])


def test_overrides_apply_when_loading(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT, overrides=["training.steps=9", "model.hidden_size=128"])
    assert spec.training.steps == 9 and spec.model.hidden_size == 128


# --------------------------------------------------------------------------------------------------
# error messages: file:line: dotted.path: message


def test_unknown_field_message_has_file_line_and_path(tmp_path: Path):
    text = TRAIN_TEXT.replace("  micro_batch_size: 4\n", "  micro_batch_size: 4\n  sed: 3\n")
    msg = _config_error(tmp_path, text)
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:12: training.sed: unknown field")
    assert "\n" not in msg


def test_wrong_type_message_shows_value(tmp_path: Path):
    msg = _config_error(tmp_path, TRAIN_TEXT.replace("steps: 4", "steps: abc"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:9: training.steps: ")
    assert "(got 'abc')" in msg


def test_missing_field_points_at_parent_line(tmp_path: Path):
    msg = _config_error(tmp_path, TRAIN_TEXT.replace("  seq_len: 32\n", ""))
    assert msg == f"{tmp_path / 'c.yaml'}:5: data.seq_len: required field is missing"


def test_missing_section_has_no_line(tmp_path: Path):
    text = TRAIN_TEXT.split("training:")[0]
    msg = _config_error(tmp_path, text)
    assert msg.startswith(f"{tmp_path / 'c.yaml'}: training: required field is missing")


def test_section_validator_message(tmp_path: Path):
    msg = _config_error(tmp_path, TRAIN_TEXT.replace("preset: tiny", "preset: huge"))
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:3: model: unknown preset 'huge'")
    assert "Value error" not in msg


def test_more_problems_are_counted(tmp_path: Path):
    text = TRAIN_TEXT.replace("steps: 4", "steps: -1").replace("micro_batch_size: 4", "micro_batch_size: 0")
    msg = _config_error(tmp_path, text)
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:9: training.steps: ")
    assert msg.endswith("(and 1 more problem(s))")


def test_list_item_error_line(tmp_path: Path):
    text = "sources:\n  - path: a.jsonl\n  - text_field: x\noutput: o\nseq_len: 8\n"
    msg = _config_error(tmp_path, text, PrepareSpec)
    assert msg == f"{tmp_path / 'c.yaml'}:3: sources.1.path: required field is missing"


def test_top_level_validator_error(tmp_path: Path):
    msg = _config_error(tmp_path, "gen_length: 30\nblock_length: 8\n", SamplerConfig)
    assert msg == f"{tmp_path / 'c.yaml'}: (top level): block_length 8 must divide gen_length 30"


def test_override_error_names_the_override(tmp_path: Path):
    msg = _config_error(tmp_path, TRAIN_TEXT, overrides=["training.steps=abc"])
    assert msg.startswith("--set training.steps: ") and "(got 'abc')" in msg
    msg = _config_error(tmp_path, TRAIN_TEXT, overrides=["training.stepz=3"])
    assert msg.startswith("--set training.stepz: unknown field")


def test_yaml_syntax_and_shape_errors(tmp_path: Path):
    msg = _config_error(tmp_path, "run:\n  name: t\ndata: [1\n")
    assert msg.startswith(f"{tmp_path / 'c.yaml'}:4: invalid YAML")
    assert "must be a mapping" in _config_error(tmp_path, "- 1\n- 2\n")
    assert "required field is missing" in _config_error(tmp_path, "")  # empty file = empty mapping
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(RunSpec, tmp_path / "missing.yaml")


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError) and ConfigError.exit_code == 2


def test_format_validation_error_directly():
    with pytest.raises(ValidationError) as info:
        RunSpec.model_validate(tiny_train_values(training={"steps": "x"}))
    assert format_validation_error(info.value, "src", None).startswith("src: training.steps: ")
    node = yaml.compose(yaml.safe_dump(tiny_train_values(training={"steps": "x"}), sort_keys=False))
    text = format_validation_error(info.value, "src", node)
    assert text.startswith("src:") and ": training.steps: " in text
    line = int(text.split(":")[1])
    dumped = yaml.safe_dump(tiny_train_values(training={"steps": "x"}), sort_keys=False).splitlines()
    assert dumped[line - 1].strip().startswith("steps:")
    assert format_validation_error(info.value, "src", node, {"training.steps"}).startswith("--set training.steps: ")


# --------------------------------------------------------------------------------------------------
# dump and templates


def test_dump_config_round_trips(tmp_path: Path):
    spec = _load_text(tmp_path, TRAIN_TEXT, overrides=["optimizer.betas=[0.8, 0.99]"])
    text = dump_config(spec)
    data = yaml.safe_load(text)
    # every section and default is written out, paths are absolute
    assert set(data) == set(RunSpec.model_fields)
    for name, field in RunSpec.model_fields.items():
        if data[name] is None:  # an optional section that is off (lora)
            assert field.default is None, name
            continue
        sub = _section_class(field.annotation)
        assert sub is not None and set(data[name]) == set(sub.model_fields), name
    assert Path(data["data"]["path"]).is_absolute() and Path(data["run"]["output_dir"]).is_absolute()
    other = tmp_path / "other"
    other.mkdir()
    (other / "resolved.yaml").write_text(text, encoding="utf-8")
    again = load_config(RunSpec, other / "resolved.yaml")
    assert again == spec
    assert dump_config(again) == text


def test_dump_config_prepare_spec(tmp_path: Path):
    spec = load_config(PrepareSpec, write_yaml(tmp_path / "prepare.yaml", PREPARE))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "p.yaml").write_text(dump_config(spec), encoding="utf-8")
    assert load_config(PrepareSpec, tmp_path / "d" / "p.yaml") == spec


def _full_values(spec: BaseModel) -> dict[str, Any]:
    return spec.model_dump(mode="json")


def test_commented_yaml_round_trips_init_templates():
    from dllm.cli.init_cmd import PREPARE_VALUES, TRAIN_VALUES

    for cls, values in ((RunSpec, TRAIN_VALUES), (PrepareSpec, PREPARE_VALUES)):
        text = commented_yaml(cls, values, header="first line\n\nthird line")
        assert yaml.safe_load(text) == values
        assert text.startswith("# first line\n#\n# third line\n")
        assert cls.model_validate(yaml.safe_load(text)) == cls.model_validate(values)


def test_commented_yaml_round_trips_every_field():
    run = RunSpec.model_validate(tiny_train_values(tokenizer={"kind": "hf", "path": "/tok: #x"}))
    prep = PrepareSpec.model_validate(
        {
            "sources": [{"path": "a: #b.jsonl", "text_field": "meta.body"}, {"path": "on"}],
            "output": "x y",
            "seq_len": 8,
            "tokenizer": {"mask_token": "<|m: #|>"},
        }
    )
    for cls, spec in ((RunSpec, run), (PrepareSpec, prep)):
        values = _full_values(spec)
        text = commented_yaml(cls, values)
        assert yaml.safe_load(text) == values
        assert cls.model_validate(yaml.safe_load(text)) == spec


def _num_keys(values: dict[str, Any]) -> int:
    """Keys at every depth (sections nest: topology.context)."""
    return sum(1 + (_num_keys(v) if isinstance(v, dict) else 0) for v in values.values())


def test_commented_yaml_puts_description_above_each_key():
    values = _full_values(RunSpec.model_validate(tiny_train_values()))
    lines = commented_yaml(RunSpec, values).splitlines()
    keys = [i for i, ln in enumerate(lines) if not ln.lstrip().startswith("#")]
    assert len(keys) == _num_keys(values)
    for i in keys:
        assert i > 0 and lines[i - 1].lstrip().startswith("# "), lines[i]
    assert lines[0] == f"# {RunSpec.model_fields['run'].description}"
    assert lines[2] == f"  # {RunSpec.model_fields['run'].annotation.model_fields['name'].description}"


def test_commented_yaml_round_trips_empty_section():
    values = {**PREPARE, "tokenizer": {}}
    assert yaml.safe_load(commented_yaml(PrepareSpec, values)) == values


# --------------------------------------------------------------------------------------------------
# rules: resolve_run_spec


def test_round_up():
    assert [round_up(n, 64) for n in (1, 64, 65, 260)] == [64, 64, 128, 320]


def test_resolve_fills_vocab_from_tokenizer(artifact_root: Path, no_gpu: None):
    spec = _spec(artifact_root)
    resolved, warnings = resolve_run_spec(spec)
    assert resolved.model.vocab_size == 320  # byte tokenizer: 260 rounded up to 64
    assert spec.model.vocab_size is None  # the input is not changed
    assert resolved.model.hidden_size == spec.model.hidden_size and resolved.data == spec.data
    assert warnings == []
    explicit, _ = resolve_run_spec(_spec(artifact_root, model={"vocab_size": 260}))
    assert explicit.model.vocab_size == 260
    with pytest.raises(ConfigError, match=r"^model.vocab_size: 100 is smaller than the tokenizer's 260"):
        resolve_run_spec(_spec(artifact_root, model={"vocab_size": 100}))


@pytest.mark.parametrize(
    ("training", "nproc", "ok"),
    [
        ({"global_batch_size": 8, "micro_batch_size": 4}, 2, True),
        ({"global_batch_size": 8, "micro_batch_size": 2}, 2, True),
        ({"global_batch_size": 8, "micro_batch_size": 4}, 4, False),
        ({"global_batch_size": 12, "micro_batch_size": 4}, 2, False),
        ({"global_batch_size": 6, "micro_batch_size": 4}, 1, False),
        ({"global_batch_size": 12, "micro_batch_size": 4}, 3, True),
    ],
)
def test_batch_divisibility(artifact_root: Path, no_gpu: None, training: dict, nproc: int, ok: bool):
    spec = _spec(artifact_root, training=training, topology={"nproc_per_node": nproc})
    if ok:
        assert resolve_run_spec(spec)[0].training.global_batch_size == training["global_batch_size"]
    else:
        with pytest.raises(ConfigError, match=r"^training.global_batch_size: .* not divisible by micro_batch_size"):
            resolve_run_spec(spec)


def test_world_size_must_match_topology(artifact_root: Path, no_gpu: None):
    spec = _spec(artifact_root, topology={"nproc_per_node": 2})
    assert resolve_run_spec(spec, world_size=2)[0].topology.world_size == 2
    with pytest.raises(ConfigError, match=r"^topology: 1 processes started but nnodes x nproc_per_node = 2"):
        resolve_run_spec(spec, world_size=1)
    two_nodes = _spec(artifact_root, topology={"nnodes": 2, "nproc_per_node": 1})
    assert resolve_run_spec(two_nodes)[0].topology.world_size == 2


def test_dp_size(artifact_root: Path, no_gpu: None):
    for dp in (-1, 2):
        spec = _spec(artifact_root, topology={"nproc_per_node": 2, "dp_size": dp})
        assert resolve_run_spec(spec)[0].topology.dp_size == dp
    with pytest.raises(ConfigError, match=r"^topology.dp_size: 1 does not use all 2 ranks"):
        resolve_run_spec(_spec(artifact_root, topology={"nproc_per_node": 2, "dp_size": 1}))
    # the batch rule uses the data-parallel degree
    bad = _spec(artifact_root, training={"global_batch_size": 8, "micro_batch_size": 8}, topology={"dp_size": -1})
    assert resolve_run_spec(bad)[0].training.micro_batch_size == 8
    with pytest.raises(ConfigError, match="2 data-parallel rank"):
        resolve_run_spec(
            _spec(
                artifact_root,
                training={"global_batch_size": 8, "micro_batch_size": 8},
                topology={"nproc_per_node": 2},
            )
        )


def test_seq_len_must_match_artifact(artifact_root: Path, no_gpu: None):
    with pytest.raises(ConfigError, match=r"^data.seq_len: 16 but the artifact .* was packed to 32"):
        resolve_run_spec(_spec(artifact_root, data={"seq_len": 16}))
    # without the data check the same spec resolves
    assert resolve_run_spec(_spec(artifact_root, data={"seq_len": 16}), check_data=False)[0].data.seq_len == 16


def test_seq_len_must_fit_the_model(artifact_root: Path, no_gpu: None):
    spec = _spec(artifact_root, model={"max_seq_len": 16})
    with pytest.raises(ConfigError, match=r"^data.seq_len: 32 exceeds model.max_seq_len 16"):
        resolve_run_spec(spec, check_data=False)


def test_missing_artifact(tmp_path: Path, no_gpu: None):
    with pytest.raises(ConfigError, match=r"^data.path: .*no manifest.json"):
        resolve_run_spec(_spec(tmp_path))
    assert resolve_run_spec(_spec(tmp_path), check_data=False)[0].model.vocab_size == 320


def test_artifact_too_small_for_batch(artifact_root: Path, no_gpu: None):
    manifest = json.loads((artifact_root / "data" / "prepared" / "manifest.json").read_text())
    n = int(manifest["num_sequences"])
    gbs = (n // 4 + 1) * 4
    spec = _spec(artifact_root, training={"global_batch_size": gbs, "micro_batch_size": 4})
    with pytest.raises(ConfigError, match=rf"^training.global_batch_size: {gbs} exceeds the {n} sequences"):
        resolve_run_spec(spec)


@pytest.mark.parametrize("key", ["vocab_hash", "special_ids"])
def test_tokenizer_must_match_artifact(tmp_path: Path, artifact_root: Path, no_gpu: None, key: str):
    shutil.copytree(artifact_root / "data" / "prepared", tmp_path / "data" / "prepared")
    path = tmp_path / "data" / "prepared" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert resolve_run_spec(_spec(tmp_path))[0].model.vocab_size == 320  # the copy itself matches
    manifest["tokenizer"][key] = "something else"
    path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^tokenizer: differs from the one that prepared .*\({key} mismatch\)"):
        resolve_run_spec(_spec(tmp_path))


def test_device_rules_without_gpu(artifact_root: Path, no_gpu: None):
    with pytest.raises(ConfigError, match=r"^training.device: cuda was requested but no GPU"):
        resolve_run_spec(_spec(artifact_root, training={"device": "cuda"}))
    with pytest.raises(ConfigError, match=r"^topology.backend: nccl needs GPUs"):
        resolve_run_spec(_spec(artifact_root, topology={"backend": "nccl"}))
    with pytest.raises(ConfigError, match=r"^training.autocast_dtype: float16 autocast is GPU-only"):
        resolve_run_spec(_spec(artifact_root, training={"autocast_dtype": "float16"}))
    for ok in ({"device": "cpu", "autocast_dtype": "bfloat16"}, {"device": "auto"}):
        assert resolve_run_spec(_spec(artifact_root, training=ok))[0].training.device == ok["device"]
    assert resolve_run_spec(_spec(artifact_root, topology={"backend": "gloo"}))[0].topology.backend == "gloo"
    # many CPU processes are fine without GPUs
    spec = _spec(artifact_root, topology={"nproc_per_node": 2})
    assert resolve_run_spec(spec)[0].topology.nproc_per_node == 2


def test_device_rules_with_gpu(artifact_root: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec, _ = resolve_run_spec(
        _spec(artifact_root, training={"autocast_dtype": "float16"}, topology={"backend": "nccl"})
    )
    assert spec.topology.backend == "nccl"
    with pytest.raises(ConfigError, match=r"^topology.nproc_per_node: 2 processes but 1 GPU"):
        resolve_run_spec(_spec(artifact_root, topology={"nproc_per_node": 2}))
    # on CPU by choice the GPU count does not matter, but nccl does
    cpu = _spec(artifact_root, training={"device": "cpu"}, topology={"nproc_per_node": 2})
    assert resolve_run_spec(cpu)[0].training.device == "cpu"
    with pytest.raises(ConfigError, match=r"^topology.backend: nccl needs GPUs"):
        resolve_run_spec(_spec(artifact_root, training={"device": "cpu"}, topology={"backend": "nccl"}))


def test_warning_for_checkpoint_interval_beyond_steps(artifact_root: Path, no_gpu: None):
    _, warnings = resolve_run_spec(_spec(artifact_root, checkpointing={"every_steps": 10}))
    assert len(warnings) == 1 and warnings[0].startswith("checkpointing.every_steps 10 > training.steps 4")
    assert resolve_run_spec(_spec(artifact_root, checkpointing={"every_steps": 4}))[1] == []
    assert resolve_run_spec(_spec(artifact_root, checkpointing={"every_steps": None}))[1] == []


def test_tensorboard_on_needs_tensorboard(artifact_root: Path, no_gpu: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(preflight_mod, "_has_tensorboard", lambda: False)
    with pytest.raises(ConfigError, match=r"^logging.tensorboard: 'on' needs tensorboard"):
        resolve_run_spec(_spec(artifact_root, logging={"tensorboard": "on"}))
    for value in ("auto", "off"):
        assert resolve_run_spec(_spec(artifact_root, logging={"tensorboard": value}))[0].logging.tensorboard == value
    monkeypatch.setattr(preflight_mod, "_has_tensorboard", lambda: True)
    assert resolve_run_spec(_spec(artifact_root, logging={"tensorboard": "on"}))[0].logging.tensorboard == "on"


@pytest.mark.parametrize(("multiple", "block", "ok"), [(None, 8, True), (16, 8, True), (16, 16, True), (8, 16, False)])
def test_block_size_must_divide_pad_to_multiple(
    tmp_path: Path, artifact_root: Path, no_gpu: None, multiple: int | None, block: int, ok: bool
):
    shutil.copytree(artifact_root / "data" / "prepared", tmp_path / "data" / "prepared")
    path = tmp_path / "data" / "prepared" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["prepare_config"]["pad_to_multiple"] = multiple
    path.write_text(json.dumps(manifest))
    spec = _spec(tmp_path, objective={"name": "bd3lm", "block_size": block})
    if ok:
        assert resolve_run_spec(spec)[0].objective.block_size == block
    else:
        with pytest.raises(ConfigError, match=r"^objective.block_size: 16 does not divide the artifact's pad_to_mul"):
            resolve_run_spec(spec)


@pytest.mark.parametrize(("backend", "device", "gpu", "recorded"), [
    ("auto", "auto", False, "blockwise"), ("auto", "cuda", True, "flex"), ("sdpa", "auto", False, "sdpa"),
    ("auto", "auto", True, "flex"),
])  # fmt: skip
def test_resolved_config_records_the_attention_backend(
    artifact_root: Path, monkeypatch: pytest.MonkeyPatch, backend: str, device: str, gpu: bool, recorded: str
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: int(gpu))
    spec = _spec(artifact_root, model={"attention_backend": backend}, training={"device": device})
    assert resolve_run_spec(spec, check_data=False)[0].model.attention_backend == recorded


def test_flex_compile_without_flex_is_a_warning(artifact_root: Path, no_gpu: None):
    spec = _spec(artifact_root, model={"flex_compile": False})
    _, warnings = resolve_run_spec(spec, check_data=False)
    assert warnings == ["model.flex_compile: false has no effect with attention_backend blockwise"]


# --------------------------------------------------------------------------------------------------
# rules: context / block parallelism (topology.context), one line each from `dllm config validate`

_CP2 = ["topology.context.mode=cp", "topology.context.cp_size=2"]
_BD3LM = ["objective.name=bd3lm", "objective.block_size=4"]  # 8 blocks of data.seq_len 32
_FAST_DLLM_V2 = ["objective.name=fast_dllm_v2", "objective.block_size=4", "objective.sub_block_size=2"]
_CSBP22 = ["topology.context.mode=csbp", "topology.context.cp_size=2", "topology.context.bp_size=2", *_BD3LM]
# DiffusionGemma's native SFT (8 canvas blocks of 4 over data.seq_len 32)
_DGEMMA = ["model.family=diffusion_gemma", "model.canvas_length=4", "objective.name=diffusiongemma_native_sft",
           "objective.block_size=4"]  # fmt: skip
_DGEMMA_MOE = [*_DGEMMA, "model.num_experts=4", "model.router_aux_loss_coef=0"]
_CSBP22_DGEMMA = [*_CSBP22[:3], *_DGEMMA]

CONTEXT_REFUSALS = {
    "cp-with-bp": (2, [*_CP2, "topology.context.bp_size=2"], "topology.context.bp_size: mode cp shards positions only"),
    "bp-with-cp": (
        2,
        ["topology.context.mode=bp", "topology.context.cp_size=2", "topology.context.bp_size=2", *_BD3LM],
        "topology.context.cp_size: mode bp keeps the clean half on every rank",
    ),
    "csbp-cp1": (2, [*_CSBP22, "topology.context.cp_size=1"], "topology.context.cp_size: csbp with cp_size 1 is bp"),
    "csbp-bp-not-multiple": (
        3,
        [*_CSBP22, "topology.context.bp_size=3"],
        "topology.context.bp_size: csbp needs bp_size a multiple of cp_size",
    ),
    "bp-needs-blocks": (
        2,
        ["topology.context.mode=bp", "topology.context.bp_size=2"],
        "topology.context.mode: bp deals out the noisy blocks of block diffusion, and objective mdlm has none",
    ),
    "blocks-not-split": (
        2,
        [*_CSBP22, "objective.block_size=16"],
        "topology.context: dual_end block schedule needs the 2 noisy blocks divisible by 4",
    ),
    "sequence-not-split": (
        3,
        ["topology.context.mode=cp", "topology.context.cp_size=3"],
        "topology.context: dual_end needs the sequence (32 rows) divisible by 6",
    ),
    "moe": (2, [*_CP2, "model.num_experts=4"], "model.router_aux_loss_coef: 0.001 with topology.context.mode cp: the"),
    "dgemma-ring": (
        2,
        [*_CSBP22_DGEMMA, "topology.context.transport=ring"],
        "topology.context.transport: ring does not carry diffusiongemma_native_sft's routed K/V exchange",
    ),
    "dgemma-tp": (2, [*_DGEMMA, "topology.tp_size=2"], "topology.tp_size: diffusion_gemma's Gemma 4 layers"),
    "ep-with-context": (
        4,
        [*_CP2, *_DGEMMA_MOE, "topology.ep_size=2"],
        "topology.ep_size: expert parallelism does not combine with context, block or tensor parallelism yet",
    ),
    "linear-layers-cp": (
        2,
        [*_CP2, "model.family=qwen3_5", "objective.name=ar"],
        "topology.context.mode: cp shards the sequence, and the linear-attention layers of qwen3_5 carry",
    ),
    "linear-layers-bp": (
        2,
        ["topology.context.mode=bp", "topology.context.bp_size=2", *_FAST_DLLM_V2, "model.family=qwen3_5"],
        "topology.context.mode: bp shards the sequence, and the linear-attention layers of qwen3_5 carry",
    ),
    "self-conditioning": (
        2,
        [*_CP2, "objective.name=uniform", "objective.self_condition_prob=0.5", "model.self_condition=true"],
        "objective.self_condition_prob: self-conditioning runs a second model pass",
    ),
    "world-not-groups": (3, _CP2, "topology.context: 3 processes do not split into cp groups of 2"),
    "dp-size": (
        4,
        [*_CP2, "topology.dp_size=1"],
        "topology.dp_size: 1 does not use all 4 ranks (context groups of 2: dp_size must be 2)",
    ),
    "batch-by-dp": (
        4,
        [*_CP2, "training.micro_batch_size=8"],
        "training.global_batch_size: 8 is not divisible by micro_batch_size 8 x 2 data-parallel rank(s)",
    ),
}


def _validate_cli(root: Path, nproc: int, sets: list[str], capsys: pytest.CaptureFixture[str]):
    from dllm.cli.main import main

    config = write_yaml(root / "train.yaml", tiny_train_values())
    args = ["config", "validate", "--config", str(config), "--no-data", "--nproc-per-node", str(nproc)]
    code = main([*args, *(a for s in sets for a in ("--set", s))])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


@pytest.mark.parametrize("case", list(CONTEXT_REFUSALS))
def test_context_parallel_refusals(tmp_path: Path, no_gpu: None, case: str, capsys: pytest.CaptureFixture[str]):
    nproc, sets, expected = CONTEXT_REFUSALS[case]
    code, err, _ = _validate_cli(tmp_path, nproc, sets, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"dllm: error: {expected}"), err


@pytest.mark.parametrize(
    ("nproc", "sets"),
    [
        (2, _CSBP22),  # dp 1
        (4, _CSBP22),  # dp 2 x csbp(cp 2, bp 2)
        (4, [*_CSBP22, "topology.context.bp_size=4"]),  # csbp(cp 2, bp 4)
        (2, [*_CP2, "training.micro_batch_size=8"]),  # the batch rule counts data-parallel ranks, not the world
        (2, ["topology.context.mode=bp", "topology.context.bp_size=2", *_FAST_DLLM_V2]),
        (4, [*_CP2, *_BD3LM, "topology.context.schedule=contiguous"]),  # the position-sharded 2L baseline
        # DiffusionGemma's SFT (self-conditioning drawn, its default): cp, bp and csbp, the MoE variant without
        # a router loss
        (2, [*_CP2, *_DGEMMA]),
        (2, ["topology.context.mode=bp", "topology.context.bp_size=2", *_DGEMMA_MOE]),
        (4, [*_CSBP22_DGEMMA, "topology.context.bp_size=4", "topology.context.schedule=contiguous"]),
    ],
)
def test_context_parallel_accepted(tmp_path: Path, no_gpu: None, nproc: int, sets: list[str], capsys):
    code, err, out = _validate_cli(tmp_path, nproc, sets, capsys)
    assert code == 0 and not [line for line in err if "error" in line or "context" in line], err  # core-count warning
    assert yaml.safe_load(out)["topology"]["context"]["mode"] in ("cp", "bp", "csbp")  # recorded in the resolved config


def test_diffusion_gemma_expert_parallelism_is_accepted(tmp_path: Path, no_gpu: None, capsys):
    code, err, out = _validate_cli(tmp_path, 2, [*_DGEMMA_MOE, "topology.ep_size=2"], capsys)
    assert code == 0 and not [line for line in err if "error" in line], err
    assert yaml.safe_load(out)["topology"]["ep_size"] == 2


def test_context_settings_without_effect_warn(artifact_root: Path, no_gpu: None):
    _, warnings = resolve_run_spec(_spec(artifact_root, topology={"context": {"cp_size": 2}}), check_data=False)
    assert warnings == ["topology.context: cp_size 2 has no effect with mode none"]
    _, warnings = resolve_run_spec(_spec(artifact_root, topology={"context": {"mode": "cp"}}), check_data=False)
    assert warnings == ["topology.context.mode: cp with cp_size 1 has no effect (whole sequences on every rank)"]
    spanning = _spec(
        artifact_root,
        training={"global_batch_size": 6, "micro_batch_size": 2},
        topology={"nnodes": 2, "nproc_per_node": 3, "context": {"mode": "cp", "cp_size": 2}},
    )
    _, warnings = resolve_run_spec(spanning, check_data=False)
    assert [w for w in warnings if "context" in w] == [
        "topology.context.cp_size 2 does not divide nproc_per_node 3: some CP groups span two nodes and exchange "
        "K/V over the network every layer"
    ]


# --------------------------------------------------------------------------------------------------
# rules: tensor, sequence, expert and hybrid-sharded data parallelism, one line each before any worker

_MOE = [
    "model.family=qwen3_moe",
    "model.num_experts=4",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
]

LAYOUT_REFUSALS = {
    "world-not-tp": (3, ["topology.tp_size=2"], "topology.tp_size: 3 processes do not split into tp_size 2"),
    "heads": (3, ["topology.tp_size=3"], "model.num_heads: 4 is not divisible by topology.tp_size 3"),
    "kv-heads": (
        2,
        ["topology.tp_size=2", "model.hidden_size=96", "model.num_heads=6", "model.num_kv_heads=3"],
        "model.num_kv_heads: 3 key/value heads neither split over topology.tp_size 2 nor replicate evenly",
    ),
    "vocab": (4, ["topology.tp_size=4", "model.vocab_size=322"], "model.vocab_size: 322 is not divisible by"),
    "mlp": (2, ["topology.tp_size=2", "model.intermediate_size=101"], "model.mlp_size: 101 is not divisible by"),
    "tp-moe": (2, ["topology.tp_size=2", *_MOE], "model.num_experts: tensor parallelism of MoE layers"),
    "tp-linear": (
        2,
        ["topology.tp_size=2", "model.family=qwen3_5", "objective.name=ar"],
        "model.attention_pattern: linear-attention layers are not tensor-parallel",
    ),  # fmt: skip
    "linear-bidirectional": (1, ["model.family=qwen3_5"], "objective.name: mdlm attends bidirectionally"),
    "tp-ddp": (2, ["topology.tp_size=2", "topology.data_parallel=ddp"], "topology.data_parallel: ddp does not take"),
    "tp-plain-loss": (2, ["topology.tp_size=2", "training.chunked_loss=false"], "training.chunked_loss: tensor"),
    "tp-certainty": (2, ["topology.tp_size=2", "objective.certainty.weight=1"], "objective.certainty: certainty"),
    "sp-without-tp": (2, ["topology.sequence_parallel=true"], "topology.sequence_parallel: needs tp_size > 1"),
    "sp-rows": (
        4,
        ["topology.tp_size=4", "topology.sequence_parallel=true", "data.seq_len=30"],
        "topology.sequence_parallel: the model input's 30 rows are not divisible by tp_size 4",
    ),
    "ep-dense": (2, ["topology.ep_size=2"], "topology.ep_size: 2 needs an MoE model"),
    "ep-experts": (
        4,
        ["topology.ep_size=4", *_MOE, "model.num_experts=6"],
        "topology.ep_size: 4 does not divide model.num_experts 6",
    ),
    "ep-dp": (2, ["topology.ep_size=4", *_MOE], "topology.ep_size: 4 does not divide the 2 data-parallel shard ranks"),
    "ep-ddp": (2, ["topology.ep_size=2", *_MOE, "topology.data_parallel=ddp"], "topology.data_parallel: expert"),
    "hsdp": (4, ["topology.dp_replicate=3"], "topology.dp_replicate: 3 does not divide dp_size 4"),
    "hsdp-ddp": (4, ["topology.dp_replicate=2", "topology.data_parallel=ddp"], "topology.dp_replicate: replicas"),
}


@pytest.mark.parametrize("case", list(LAYOUT_REFUSALS))
def test_parallel_layout_refusals(tmp_path: Path, no_gpu: None, case: str, capsys: pytest.CaptureFixture[str]):
    nproc, sets, expected = LAYOUT_REFUSALS[case]
    code, err, _ = _validate_cli(tmp_path, nproc, sets, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"dllm: error: {expected}"), err


@pytest.mark.parametrize(
    ("nproc", "sets"),
    [
        (4, ["topology.tp_size=2", "topology.sequence_parallel=true"]),  # DP2 x TP2 (SP)
        (8, ["topology.tp_size=2", *_CP2]),  # DP2 x TP2 x CP2
        (4, ["topology.tp_size=4"]),  # 2 key/value heads replicated onto 4 ranks
        (4, ["topology.ep_size=2", *_MOE, "training.micro_batch_size=2"]),  # DP2 x EP2 (dp 4, experts over pairs)
        (4, ["topology.dp_replicate=2", "topology.tp_size=2"]),  # HSDP x TP2
    ],
)
def test_parallel_layouts_accepted(tmp_path: Path, no_gpu: None, nproc: int, sets: list[str], capsys):
    code, err, _ = _validate_cli(tmp_path, nproc, sets, capsys)
    assert code == 0 and not [line for line in err if "error" in line], err
