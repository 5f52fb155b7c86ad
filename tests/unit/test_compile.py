"""Compiled training (`training.compile`): the setting's resolution, the toolchain error, compiled
losses against eager ones, no recompilation across steps, and the warm-up's compile time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from dllm.errors import ConfigError
from dllm.training import needs
from dllm.training.build import build_trainer
from dllm.training.metrics import read_metrics
from dllm.training.needs import resolve_compile
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import load_spec

NO_SAVES = ("checkpointing.every_steps=null", "checkpointing.save_final=false")
BD3LM = ("objective.name=bd3lm", "objective.block_size=8")


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def no_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(needs.importlib.util, "find_spec", lambda name: None)


@pytest.mark.parametrize(("value", "expected"), [("auto", False), ("true", True), ("false", False), ("on", True)])
def test_compile_setting_resolves_in_the_preflight(train_yaml: Path, no_gpu: None, value: str, expected: bool):
    """auto is off on CPU; YAML booleans (true, on) still mean true; the resolved config records a bool."""
    assert load_spec(train_yaml).training.compile == "auto"  # the default
    spec, _ = resolve_run_spec(load_spec(train_yaml, f"training.compile={value}"))
    assert spec.training.compile is expected


def test_auto_compiles_on_cuda_unless_no_toolchain(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(needs, "compiler_available", lambda on_gpu: (True, "triton installed"))
    assert resolve_compile("auto", "cuda") is True
    assert resolve_compile("auto", "cpu") is False
    assert resolve_compile(True, "cpu") is True and resolve_compile(False, "cuda") is False
    monkeypatch.setattr(needs, "compiler_available", lambda on_gpu: (False, "triton missing (pip install triton)"))
    assert resolve_compile("auto", "cuda") is False


def test_compile_true_without_the_toolchain_is_one_line(train_yaml: Path, no_gpu: None, no_toolchain: None):
    with pytest.raises(ConfigError, match=r"^training.compile: true needs torch.compile's toolchain: no C\+\+ "
                       r"compiler found \(install g\+\+\); or set compile: auto$") as err:  # fmt: skip
        resolve_run_spec(load_spec(train_yaml, "training.compile=true"))
    assert "\n" not in str(err.value)
    spec, _ = resolve_run_spec(load_spec(train_yaml, "training.compile=auto"))  # auto: silently off
    assert spec.training.compile is False


def _trainer(train_yaml: Path, name: str, *overrides: str):
    spec, _ = resolve_run_spec(load_spec(train_yaml, f"run.name={name}", *NO_SAVES, *overrides))
    return build_trainer(spec, prepare_run_dir(spec))


def _losses(trainer, steps: int) -> list[float]:
    return [trainer.train_step(trainer.loader.next_step()).loss for _ in range(steps)]


@pytest.mark.parametrize(
    ("objective", "steps"),
    [("mdlm", 50), pytest.param("bd3lm", 50, marks=pytest.mark.slow)],
)
def test_compiled_training_matches_eager_without_recompiling(train_yaml: Path, objective: str, steps: int):
    """fp32 on CPU: the compiled loss sequence equals eager's within 1e-4 relative. Three blocks share
    their code, so they compile once (mdlm: one graph for the whole block); after the first step
    no graph is compiled again (dynamo's counters)."""
    extra = (*(BD3LM if objective == "bd3lm" else ()), "model.num_layers=3", "training.global_batch_size=4",
             "training.micro_batch_size=4")  # fmt: skip
    eager = _losses(_trainer(train_yaml, "eager", "training.compile=false", *extra), steps)
    torch._dynamo.reset()
    counters.clear()
    trainer = _trainer(train_yaml, "compiled", "training.compile=true", *extra)
    compiled = _losses(trainer, 1)
    graphs = counters["stats"]["unique_graphs"]
    compiled += _losses(trainer, steps - 1)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled in the later steps
    if objective == "mdlm":
        assert graphs == 1 and not counters["graph_break"]  # fullgraph: one graph for all three blocks
    else:  # bd3lm's CPU attention plans from mask values: it runs eagerly between two graphs per block shape
        assert 1 < graphs < 12
        assert all("split_attention" in reason for reason in counters["graph_break"])
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_first_progress_line_and_record_report_the_compile_time(train_yaml: Path, capsys: pytest.CaptureFixture):
    torch._dynamo.reset()
    spec, _ = resolve_run_spec(
        load_spec(train_yaml, "run.name=warm", "training.compile=true", "training.steps=3", "logging.every_steps=2",
                  "logging.progress=lines", *NO_SAVES)
    )  # fmt: skip
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/3") and "  compile " in lines[0]
    assert all("compile" not in line for line in lines[1:])
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [2, 3]
    assert records[0]["compile_s"] > 0 and "compile_s" not in records[1]
