"""Reliability hardening, configs: mistakes a hostile or careless user makes, each refused in one line (or warned).

Each test reproduces a case that passed silently, hung or gave a traceback before the checks existed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from dllm.cli.main import main as dllm
from dllm.config.loading import load_config
from dllm.config.model import FAMILY_DEFAULTS, ModelConfig
from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError
from dllm.models.transformer import Transformer
from dllm.training.preflight import resolve_run_spec
from tests.helpers import tiny_train_values, write_yaml


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def train_yaml(tmp_path: Path) -> Path:
    return write_yaml(tmp_path / "train.yaml", tiny_train_values())


def _validate(config: Path, *sets: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """`dllm config validate --no-data` in process: the exit code and the stderr lines."""
    args = ["config", "validate", "--config", str(config), "--no-data"]
    for s in sets:
        args += ["--set", s]
    code = dllm(args)
    return code, capsys.readouterr().err.strip().splitlines()


def _one_error(code: int, lines: list[str], *expected: str) -> str:
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("dllm: error: ") and "Traceback" not in lines[0], lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# -- optimizer values ----------------------------------------------------------------------------------
@pytest.mark.parametrize("betas", ["[1.5, 0.9]", "[0.9, 1.0]", "[-0.1, 0.9]", "[0.9, .nan]"])
def test_adam_betas_outside_0_1_are_refused(train_yaml: Path, betas: str, capsys: pytest.CaptureFixture[str]):
    code, lines = _validate(train_yaml, f"optimizer.betas={betas}", capsys=capsys)
    _one_error(code, lines, "--set optimizer.betas")
    assert load_config(RunSpec, train_yaml, ["optimizer.betas=[0.0, 0.999]"]).optimizer.betas == (0.0, 0.999)


@pytest.mark.parametrize("value", [".inf", "1e999"])
def test_non_finite_learning_rate_is_refused_with_its_line(tmp_path: Path, value: str,
                                                           capsys: pytest.CaptureFixture[str]):  # fmt: skip
    text = f"data: {{path: data, seq_len: 32}}\ntraining: {{steps: 1, global_batch_size: 1, micro_batch_size: 1}}\n" \
           f"optimizer:\n  lr: {value}\n"  # fmt: skip
    (tmp_path / "t.yaml").write_text(text)
    code, lines = _validate(tmp_path / "t.yaml", capsys=capsys)
    _one_error(code, lines, "t.yaml:4: optimizer.lr", "finite")


# -- memory --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILY_DEFAULTS))
def test_parameter_count_from_the_config_is_exact(family: str):
    from dllm.models.sizing import count_params

    for extra in ({}, {"tie_embeddings": False, "self_condition": True, "qk_norm": True, "mlp_bias": True}):
        cfg = ModelConfig(family=family, preset="tiny", vocab_size=300, **extra)
        with torch.device("meta"):
            assert count_params(cfg) == Transformer(cfg).num_params()


def test_a_model_beyond_the_machines_memory_is_refused_with_the_numbers(train_yaml: Path, no_gpu: None,
                                                                        monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^model: [\d,]+ parameters need at least .* TB per machine"):
        resolve_run_spec(load_config(RunSpec, train_yaml, ["model.hidden_size=65536", "model.num_layers=64"]),
                         check_data=False)  # fmt: skip
    assert time.perf_counter() - t0 < 5  # counted, never allocated
    # the tiny model (vocab 320): 119,104 parameters x 16 bytes = 1.9 MB; refused on a 1 MB machine, by name and number
    monkeypatch.setattr("dllm.models.sizing.host_memory_bytes", lambda: 1_000_000)
    with pytest.raises(
        ConfigError, match=r"^model: 119,104 parameters need at least 1\.9 MB per machine .* its 1\.0 MB"
    ):
        resolve_run_spec(load_config(RunSpec, train_yaml), check_data=False)
    monkeypatch.setattr("dllm.models.sizing.host_memory_bytes", lambda: 10_000_000)
    resolve_run_spec(load_config(RunSpec, train_yaml), check_data=False)


def test_lora_counts_frozen_weights_only(train_yaml: Path, no_gpu: None, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("dllm.models.sizing.host_memory_bytes", lambda: 1_000_000)  # 1.9 MB trained, 0.5 MB frozen
    resolve_run_spec(load_config(RunSpec, train_yaml, ["lora.rank=2"]), check_data=False)


# -- the file itself -----------------------------------------------------------------------------------
def test_non_utf8_config_is_one_line_with_its_line(train_yaml: Path, capsys: pytest.CaptureFixture[str]):
    (train_yaml.parent / "t.yaml").write_bytes(b"run:\n  name: caf\xe9\n")
    code, lines = _validate(train_yaml.parent / "t.yaml", capsys=capsys)
    _one_error(code, lines, "t.yaml:2: not UTF-8 text (byte 0xe9)")
    train_yaml.write_bytes(b"\xef\xbb\xbf" + train_yaml.read_bytes())  # a byte-order mark is still fine
    assert load_config(RunSpec, train_yaml).run.name == "t"


@pytest.mark.parametrize(("literal", "expected"), [("9" * 5000, "5000 characters is too large"),
                                                   (str(2**64), "does not fit in 64 bits")])  # fmt: skip
def test_huge_integers_are_refused(train_yaml: Path, literal: str, expected: str, capsys: pytest.CaptureFixture[str]):
    train_yaml.write_text(train_yaml.read_text().replace("seed", "x") + f"topology:\n  nproc_per_node: {literal}\n")
    code, lines = _validate(train_yaml, capsys=capsys)
    _one_error(code, lines, "train.yaml:", expected)
    code, lines = _validate(train_yaml.with_name("missing.yaml"), f"training.seed={literal}", capsys=capsys)
    assert "missing.yaml" in lines[0]  # the file is checked first
    code, lines = _validate(write_yaml(train_yaml, tiny_train_values()), f"training.seed={literal}", capsys=capsys)
    _one_error(code, lines, "--set training.seed", expected)


def test_duplicate_keys_name_both_lines(train_yaml: Path, capsys: pytest.CaptureFixture[str]):
    (train_yaml.parent / "d.yaml").write_text("optimizer:\n  lr: 0.001\n  eps: 1.0e-8\n  lr: 0.1\n")
    code, lines = _validate(train_yaml.parent / "d.yaml", capsys=capsys)
    _one_error(code, lines, "d.yaml:4:", "duplicate key 'lr' (first on line 2)")


BOMB = "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9) if p else ', '.join(['lol'] * 9)}]\n"
    for p, c in zip(["", *"abcdefgh"], "abcdefghi", strict=True)
)  # 9 levels of 9 aliases: 9**9 = 387 million strings once expanded


def test_yaml_alias_bomb_is_refused_quickly(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 800
    t0 = time.perf_counter()
    code, lines = _validate(tmp_path / "bomb.yaml", capsys=capsys)
    assert time.perf_counter() - t0 < 2
    _one_error(code, lines, "bomb.yaml:", "aliases")


def test_ordinary_aliases_merge_keys_and_recursion(train_yaml: Path, capsys: pytest.CaptureFixture[str]):
    text = train_yaml.read_text() + "x-defaults: &d {every_steps: 2, keep_last_n: 3}\n"
    train_yaml.write_text(
        text.replace("checkpointing:\n  every_steps: 2\n", "checkpointing:\n  <<: *d\n  every_steps: 1\n")
    )
    data_cfg = "x-defaults: &d {every_steps: 2, keep_last_n: 3}\ncheckpointing:\n  <<: *d\n  every_steps: 1\n"
    (train_yaml.parent / "m.yaml").write_text(data_cfg)
    from dllm.config.loading import read_yaml

    data, _ = read_yaml(train_yaml.parent / "m.yaml")
    assert data["checkpointing"] == {"every_steps": 1, "keep_last_n": 3}  # a merge then an override: no duplicate
    (train_yaml.parent / "r.yaml").write_text("a: &a [1, *a]\n")
    code, lines = _validate(train_yaml.parent / "r.yaml", capsys=capsys)
    _one_error(code, lines, "r.yaml:1:", "refers to the node that contains it")


def test_deep_nesting_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    for depth in (100, 5000):
        (tmp_path / "n.yaml").write_text("run: " + "[" * depth + "]" * depth + "\n")
        code, lines = _validate(tmp_path / "n.yaml", capsys=capsys)
        _one_error(code, lines, "n.yaml", "nested")


# -- values that need the machine or another config ----------------------------------------------------
def test_warmup_longer_than_training_warns(train_yaml: Path, no_gpu: None):
    _, warnings = resolve_run_spec(load_config(RunSpec, train_yaml, ["scheduler.warmup_steps=10"]), check_data=False)
    assert any(w.startswith("scheduler.warmup_steps 10 > training.steps 4") for w in warnings), warnings
    assert resolve_run_spec(load_config(RunSpec, train_yaml, ["scheduler.warmup_steps=4"]), check_data=False)[1] == []


@pytest.mark.parametrize("path", ["${HOME}/runs", "$RUNS/x", "runs/${USER"])
def test_unexpanded_environment_variables_in_paths_are_refused(train_yaml: Path, path: str,
                                                               capsys: pytest.CaptureFixture[str]):  # fmt: skip
    code, lines = _validate(train_yaml, f"run.output_dir={path}", capsys=capsys)
    _one_error(code, lines, "--set run.output_dir", "environment variable")
    prepare = write_yaml(train_yaml.parent / "p.yaml", {"sources": [{"path": f"{path}.jsonl"}], "output": "o",
                                                         "seq_len": 8})  # fmt: skip
    assert dllm(["data", "prepare", "--config", str(prepare)]) == 2
    assert "sources.0.path: $" in capsys.readouterr().err
    assert load_config(RunSpec, train_yaml, ["run.output_dir=~/runs"]).run.output_dir == Path.home() / "runs"


def test_gen_length_beyond_the_models_length_is_refused():
    profile = DecodeProfile(max_length=64, mask_id=1, pad_id=2, eos_id=3, num_tokens=10)
    assert resolve_sampler(SamplerConfig(gen_length=64), profile).gen_length == 64
    with pytest.raises(ConfigError, match=r"^sampler.gen_length: 128 exceeds the 64 positions"):
        resolve_sampler(SamplerConfig(gen_length=128), profile)


def test_more_cpu_processes_than_cores_warns(train_yaml: Path, no_gpu: None):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n = cores + 1
    sets = [f"topology.nproc_per_node={n}", "training.micro_batch_size=1", f"training.global_batch_size={n}"]
    _, warnings = resolve_run_spec(load_config(RunSpec, train_yaml, sets), check_data=False)
    assert any(w.startswith(f"topology.nproc_per_node {n} > the {cores} CPU core(s)") for w in warnings), warnings


@pytest.mark.parametrize("name", ["latest", "Latest"])
def test_the_run_name_of_the_latest_link_is_refused(train_yaml: Path, name: str, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    """output_dir/latest links to the newest run: a run named latest made it a link to itself (ELOOP)."""
    monkeypatch.chdir(train_yaml.parent)
    code = dllm(["launch", "--config", "train.yaml", "--dry-run", "--set", f"run.name={name}"])
    _one_error(code, capsys.readouterr().err.strip().splitlines(), "--set run.name: reserved", "latest")
    assert not (train_yaml.parent / "runs").exists()


# -- item 13: an override's mistake is blamed on --set, not on the file --------------------------------
@pytest.mark.parametrize(("override", "expected"), [
    ("model.hidden_size=63", "--set model.hidden_size: model: hidden_size 63 is not divisible"),
    ("tokenizer.path=x", "--set tokenizer.path: tokenizer: kind 'byte' takes no path"),
])  # fmt: skip
def test_set_errors_name_the_override(train_yaml: Path, override: str, expected: str,
                                      capsys: pytest.CaptureFixture[str]):  # fmt: skip
    code, lines = _validate(train_yaml, override, capsys=capsys)
    line = _one_error(code, lines, expected)
    assert "train.yaml" not in line


# -- booleans are not numbers ------------------------------------------------------------------------------------
BOOL_AS_NUMBER = ["training.steps=true", "training.global_batch_size=false", "model.hidden_size=true",
                  "optimizer.lr=true", "optimizer.betas=[true, 0.9]", "data.seq_len=true",
                  "scheduler.warmup_steps=false", "checkpointing.keep_last_n=true", "model.rope_theta=false",
                  "training.seed=true"]  # fmt: skip


@pytest.mark.parametrize("override", BOOL_AS_NUMBER)
def test_a_boolean_is_not_read_as_a_number(train_yaml: Path, override: str, capsys: pytest.CaptureFixture[str]):
    code, lines = _validate(train_yaml, override, capsys=capsys)
    _one_error(code, lines, f"--set {override.partition('=')[0]}", "true/false is not a number")


def test_a_boolean_number_in_the_file_names_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    text = "data: {path: data, seq_len: 32}\ntraining:\n  steps: true\n  global_batch_size: 1\n  micro_batch_size: 1\n"
    (tmp_path / "t.yaml").write_text(text)
    code, lines = _validate(tmp_path / "t.yaml", capsys=capsys)
    _one_error(code, lines, "t.yaml:3: training.steps: true/false is not a number")
    (tmp_path / "t.yaml").write_text(text.replace("steps: true", "steps: 100"))
    assert load_config(RunSpec, tmp_path / "t.yaml").training.steps == 100


def _sections() -> list[type]:
    """Every config section class (all subclasses of Section, the evaluation and recipe ones included)."""
    import dllm.config.spec  # noqa: F401 - every section of a run
    import dllm.evaluation.harness  # noqa: F401
    import dllm.recipes  # noqa: F401
    from dllm.config.base import Section

    found, todo = [], [Section]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found[1:]


def _holds_numbers(annotation: object) -> bool:
    import typing

    if annotation in (int, float):
        return True
    return any(_holds_numbers(a) for a in typing.get_args(annotation))


def _holds_bools(annotation: object) -> bool:
    import typing

    if annotation is bool or annotation is typing.Any:
        return True
    return any(_holds_bools(a) for a in typing.get_args(annotation))


def test_no_number_field_of_any_section_takes_a_boolean():
    """Each field that holds numbers (and no bool) refuses True: a new field declared `int` instead of `Int` fails."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    checked = []
    for cls in _sections():
        for name, field in cls.model_fields.items():
            if not _holds_numbers(field.annotation) or _holds_bools(field.annotation):
                continue
            typ = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
            adapter = TypeAdapter(typ)
            for value in (True, [True], (True, True)):  # a number, a list or tuple of numbers
                try:
                    adapter.validate_python(value)
                except ValidationError:
                    continue
                raise AssertionError(f"{cls.__name__}.{name} accepts {value!r}")
            checked.append(f"{cls.__name__}.{name}")
    assert len(checked) > 90 and "TrainingConfig.steps" in checked and "OptimizerConfig.betas" in checked


# -- YAML tags beyond the plain ones ---------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "tag"), [("!!binary aGVsbG8=", "!!binary"), ("2024-01-01", "!!timestamp"),
                                            ("!!timestamp 2024-01-01", "!!timestamp"), ("!!set {a, b}", "!!set"),
                                            ("!!omap [a: 1]", "!!omap"), ("!!pairs [a: 1]", "!!pairs")])  # fmt: skip
def test_yaml_tags_other_than_plain_values_are_refused(train_yaml: Path, value: str, tag: str,
                                                       capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """`name: !!binary aGVsbG8=` became bytes, which pydantic read as the run name "hello"."""
    text = train_yaml.read_text()
    assert "\n  name: t\n" in text
    (train_yaml.parent / "b.yaml").write_text(text.replace("\n  name: t\n", f"\n  name: {value}\n"))
    line = text.splitlines().index("  name: t") + 1
    code, lines = _validate(train_yaml.parent / "b.yaml", capsys=capsys)
    _one_error(code, lines, f"b.yaml:{line}:", tag, "not read in configs")
    code, lines = _validate(train_yaml, f"run.name={value}", capsys=capsys)
    _one_error(code, lines, "--set run.name:", tag)
    (train_yaml.parent / "s.yaml").write_text(text.replace("\n  name: t\n", "\n  name: !!str t2\n"))
    assert load_config(RunSpec, train_yaml.parent / "s.yaml").run.name == "t2"  # a core tag of a plain value


# -- run.output_dir: never the filesystem root or the kernel's folders, and writable before any worker -------
@pytest.mark.parametrize("output_dir", ["/", "/proc/x", "/sys/runs", "/dev/runs", "/proc/../"])
def test_a_system_folder_is_no_output_dir(train_yaml: Path, output_dir: str, capsys: pytest.CaptureFixture[str]):
    """output_dir / trained into /t and /latest (as root); /proc/x validated and failed only once training wrote."""
    code, lines = _validate(train_yaml, f"run.output_dir={output_dir}", capsys=capsys)
    _one_error(code, lines, "--set run.output_dir:", "filesystem root" if output_dir.endswith("/") else "kernel")
    text = train_yaml.read_text().replace("\n  name: t\n", f"\n  name: t\n  output_dir: {output_dir}\n")
    (train_yaml.parent / "o.yaml").write_text(text)
    code, lines = _validate(train_yaml.parent / "o.yaml", capsys=capsys)
    _one_error(code, lines, "o.yaml:", "run.output_dir:")
    assert load_config(RunSpec, train_yaml, ["run.output_dir=/dev/shm/runs"])  # a RAM disk holds files


def test_an_output_dir_that_cannot_be_written_is_refused_before_launch(train_yaml: Path,
                                                                       capsys: pytest.CaptureFixture[str]):  # fmt: skip
    (train_yaml.parent / "a_file").write_text("x")
    code, lines = _validate(train_yaml, f"run.output_dir={train_yaml.parent / 'a_file' / 'runs'}", capsys=capsys)
    _one_error(code, lines, "run.output_dir:", "a_file is a file, not a folder")
    code = dllm(["launch", "--config", str(train_yaml), "--dry-run", "--set", "run.output_dir=a_file/runs"])
    _one_error(code, capsys.readouterr().err.strip().splitlines(), "run.output_dir:", "is a file")
