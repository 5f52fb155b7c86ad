"""Run observability: model FLOPs vs torch's FLOP counter, MFU fields, profiler traces, W&B offline."""

from __future__ import annotations

import glob
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, FastDLLMv2Config, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import TokenIds
from dllm.diffusion.objectives.block import BD3LMObjective, FastDLLMv2Objective
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.flops import Layout, train_flops
from dllm.training.build import build_trainer
from dllm.training.metrics import read_metrics
from dllm.training.mfu import FlopsMeter, layout_of, peak_of
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from dllm.training.trainer import run_model
from tests.helpers import load_spec

V = 64
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)

OBJECTIVES = {
    "mdlm": lambda: MDLMObjective(MDLMConfig(), IDS, chunked_loss=False),
    "bd3lm": lambda: BD3LMObjective(BD3LMConfig(block_size=8), IDS, chunked_loss=False),
    "bd3lm_shift": lambda: BD3LMObjective(BD3LMConfig(block_size=8, shift=True), IDS, chunked_loss=False),
    "fast_dllm_v2": lambda: FastDLLMv2Objective(FastDLLMv2Config(block_size=8), IDS, chunked_loss=False),
    "fast_dllm_v2_two_rows": lambda: FastDLLMv2Objective(
        FastDLLMv2Config(block_size=8), IDS, chunked_loss=False, shared_clean=False
    ),
}
MODELS = {
    "llama": {},
    "bert": {"family": "bert"},  # plain MLP, MLM head transform, learned positions
    "moe": {"num_experts": 4, "num_experts_per_tok": 2},  # only the routed experts count
    # Gemma 4: a global layer of its own head width and kv heads without a value projection, experts beside the MLP
    "diffusion_gemma": {
        "family": "diffusion_gemma",
        "num_experts": 4,
        "attention_pattern": ["local", "global"],
        "global_head_dim": 32,
        "global_num_kv_heads": 1,
        "local_window": 8,
    },
}


def _counted(model_kw: dict, objective_name: str) -> tuple[int, int, Layout, int]:
    """(FlopCounterMode's FLOPs of one forward + backward, ours, the layout, head rows) on a tiny model."""
    cfg = ModelConfig(preset="tiny", vocab_size=V, attention_backend="sdpa", **model_kw)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    B, L = 4, 32
    tokens = torch.randint(0, V - 3, (B, L), generator=torch.Generator().manual_seed(1))
    batch = Batch(tokens, torch.ones(B, L, dtype=torch.bool), torch.arange(B))
    objective = OBJECTIVES[objective_name]()
    inputs = objective.prepare(batch, NoiseKeys(0, B))
    # the MATH kernel runs attention as bmm, which the counter sees (the fused CPU kernels it does not)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = objective.loss(run_model(model, inputs), inputs)
        out.loss_sum.backward()
    layout, head_rows = layout_of(batch, inputs), int(out.metrics["num_masked"])
    return counter.get_total_flops(), train_flops(cfg, layout, B, head_rows), layout, head_rows


@pytest.mark.parametrize("objective_name", list(OBJECTIVES))
def test_flops_match_torch_flop_counter_per_objective(objective_name: str):
    measured, ours, layout, _ = _counted({}, objective_name)
    assert ours == pytest.approx(measured, rel=0.05)
    expected = {
        "mdlm": Layout(32, 32, 1, None),
        "bd3lm": Layout(32, 64, 1, 32),  # [x_t ; x_0], the last layer's queries for x_t only
        "bd3lm_shift": Layout(32, 64, 1, None),  # the shift reads clean rows too: all queries
        "fast_dllm_v2": Layout(32, 96, 1, None),  # two complementary views over one clean stream
        "fast_dllm_v2_two_rows": Layout(32, 64, 2, None),  # a row [x_t ; x_0] per view
    }[objective_name]
    assert layout == expected


@pytest.mark.parametrize("model_name", list(MODELS))
def test_flops_match_torch_flop_counter_per_model_layout(model_name: str):
    measured, ours, _, _ = _counted(MODELS[model_name], "bd3lm")
    assert ours == pytest.approx(measured, rel=0.05)


def test_flops_would_miss_the_counter_without_the_2l_layout_or_the_query_only_last_layer():
    measured, ours, layout, head_rows = _counted({}, "bd3lm")
    assert ours == measured  # exact: the counter sees the same products
    cfg = ModelConfig(preset="tiny", vocab_size=V)
    all_queries = Layout(layout.seq_len, layout.row_len, layout.rows, None)
    assert train_flops(cfg, all_queries, 4, head_rows) > 1.05 * measured
    one_half = Layout(layout.seq_len, layout.seq_len, layout.rows, None)  # as if the model saw L tokens
    assert train_flops(cfg, one_half, 4, head_rows) < 0.7 * measured


def test_peak_table_and_mfu():
    assert peak_of("NVIDIA H200") == 989e12
    assert peak_of("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_of("NVIDIA H100 PCIe") == 756e12
    assert peak_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_of("NVIDIA B200") == 2250e12
    assert peak_of("NVIDIA GeForce RTX 3090") is None
    cfg = ModelConfig(preset="tiny", vocab_size=V)
    meter = FlopsMeter(cfg, 1e12, num_devices=2)
    meter.layout = Layout(32, 32)
    rec = meter.measure(num_sequences=8, num_head_rows=100, step_s=0.5)
    flops = train_flops(cfg, meter.layout, 8, 100)
    assert rec["flops_per_token"] == round(flops / (8 * 32))
    assert rec["flops_per_s"] == pytest.approx(flops / 0.5, rel=1e-3)
    assert rec["mfu"] == pytest.approx(flops / 0.5 / 2e12, abs=1e-4)
    cpu = FlopsMeter(cfg, None, 1)
    cpu.layout = meter.layout
    assert "mfu" not in cpu.measure(8, 100, 0.5)


def _train(train_yaml: Path, *overrides: str) -> tuple[Path, list[float]]:
    spec, _ = resolve_run_spec(load_spec(train_yaml, *overrides))
    run_dir = prepare_run_dir(spec)
    return run_dir, train_from_run_dir(run_dir)


def test_metrics_and_progress_carry_flops_on_cpu(train_yaml: Path, capsys: pytest.CaptureFixture):
    run_dir, _ = _train(train_yaml, "logging.progress=lines", "objective.name=bd3lm", "objective.block_size=8")
    records = read_metrics(run_dir)
    assert len(records) == 4
    spec = load_spec(run_dir / "config.yaml")
    body = train_flops(spec.model, Layout(32, 64, 1, 32), 8, 0)  # per step, without the head
    for r in records:
        assert r["tokens"] == r["step"] * 8 * 32
        assert "mfu" not in r  # a CPU: FLOP/s only
        assert r["flops_per_token"] > body / (8 * 32)  # plus the head's share
        assert r["flops_per_s"] == pytest.approx(r["flops_per_token"] * 8 * 32 / r["step_s"], rel=0.01)
    err = capsys.readouterr().err
    assert "FLOP/s" in err and "MFU" not in err


def test_profiler_writes_a_chrome_trace_of_the_chosen_steps(train_yaml: Path, capsys: pytest.CaptureFixture):
    run_dir, _ = _train(
        train_yaml, "profiling.start_step=2", "profiling.steps=2", "profiling.record_shapes=true",
        "model.attention_backend=sdpa",
    )  # fmt: skip
    trace = run_dir / "profile" / "trace-steps2-3-rank0.json"
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [trace.name]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert "aten::linear" in names and "aten::scaled_dot_product_attention" in names
    assert {n for n in names if str(n).startswith("dllm step")} == {"dllm step 2", "dllm step 3"}
    assert any("Input Dims" in e.get("args", {}) for e in events if e.get("name") == "aten::linear")
    assert f"dllm: profiler trace: {trace}" in capsys.readouterr().err


def test_profiling_after_the_last_step_is_a_warning(train_yaml: Path):
    _, warnings = resolve_run_spec(load_spec(train_yaml, "profiling.start_step=9"))
    assert any("profiling.start_step 9 > training.steps 4" in w for w in warnings)


def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a .wandb file (a LevelDB-style log: 32 KiB blocks of chunks with a
    7-byte header crc32/length/type after a 7-byte file header ':W&B', magic, version)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, chunk, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk += data[pos : pos + n]
        pos += n
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_wandb_offline_run_holds_the_config_and_every_metric(train_yaml: Path):
    pytest.importorskip("wandb")
    run_dir, _ = _train(
        train_yaml, "logging.wandb.mode=offline", "logging.wandb.project=obs-test", "logging.wandb.tags=[a,b]"
    )
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files
    records = _wandb_records(Path(files[0]))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds, (kinds, Path(files[0]).stat().st_size)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "obs-test" and run.display_name == "t" and list(run.tags) == ["a", "b"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["training"]["steps"] == 4 and config["model"]["vocab_size"] > 0  # the resolved config
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    metrics = read_metrics(run_dir)
    assert [h["_step"] for h in history] == [m["step"] for m in metrics]
    for h, m in zip(history, metrics, strict=True):
        assert h["loss"] == pytest.approx(m["loss"]) and h["lr"] == pytest.approx(m["lr"])
        assert h["flops_per_s"] == pytest.approx(m["flops_per_s"]) and h["tokens"] == m["tokens"]


def test_wandb_configured_but_missing_is_refused_before_training(train_yaml: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now fails
    with pytest.raises(ConfigError, match=r"logging.wandb: needs the wandb package"):
        resolve_run_spec(load_spec(train_yaml, "logging.wandb.mode=offline"))
    resolve_run_spec(load_spec(train_yaml, "logging.wandb.mode=disabled"))  # disabled needs nothing
    spec, _ = resolve_run_spec(load_spec(train_yaml, "logging.wandb.mode=disabled"))
    build_trainer(spec, prepare_run_dir(spec)).metrics.close()  # and builds without it


def test_measuring_flops_does_not_change_the_losses(train_yaml: Path):
    """The meter reads the layout from an extra prepare of the first micro-batch: the noise is keyed by
    sample, so the run's losses stay bit-identical with and without it."""
    losses = []
    for name, meter in (("with", True), ("without", False)):
        spec, _ = resolve_run_spec(load_spec(train_yaml, f"run.name={name}", "objective.name=bd3lm"))
        trainer = build_trainer(spec, prepare_run_dir(spec))
        if not meter:
            trainer.flops = None
        losses.append(trainer.fit())
        trainer.metrics.close()
    assert losses[0] == losses[1]
