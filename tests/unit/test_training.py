"""Trainer, LR schedule, optimizer groups, checkpoint publish/prune/resume (one process, CPU)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.checkpoint.manager import latest_checkpoint
from dllm.config.model import ModelConfig
from dllm.config.training import OptimizerConfig, SchedulerConfig
from dllm.errors import CheckpointError
from dllm.models import Transformer
from dllm.training import build as build_mod
from dllm.training.build import build_trainer
from dllm.training.lr import LRSchedule
from dllm.training.metrics import read_metrics
from dllm.training.optim import build_optimizer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import load_spec, output_of_logits, tiny_train_values, write_yaml


def _run_dir(train_yaml: Path, *overrides: str) -> Path:
    spec, _ = resolve_run_spec(load_spec(train_yaml, *overrides))
    return prepare_run_dir(spec)


def _trainer(train_yaml: Path, *overrides: str):
    spec, _ = resolve_run_spec(load_spec(train_yaml, *overrides))
    run_dir = prepare_run_dir(spec)
    return build_trainer(spec, run_dir), run_dir


def test_lr_schedule_shapes():
    cos = LRSchedule(SchedulerConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1), 1.0, 20)
    assert [cos.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.lr_at(4) == pytest.approx(1.0)
    assert cos.lr_at(20) == pytest.approx(0.1)
    assert cos.lr_at(12) == pytest.approx(0.55)  # half way: floor + (1 - floor) / 2
    lin = LRSchedule(SchedulerConfig(name="linear", warmup_steps=0, min_lr_ratio=0.0), 2.0, 10)
    assert lin.lr_at(5) == pytest.approx(1.0)
    const = LRSchedule(SchedulerConfig(name="constant", warmup_steps=2), 3.0, 10)
    assert const.lr_at(0) == 1.5 and const.lr_at(9) == 3.0
    assert all(cos.lr_at(s) >= cos.lr_at(s + 1) for s in range(4, 25))


def test_optimizer_decays_only_matrices():
    model = Transformer(ModelConfig(preset="tiny", vocab_size=64, qkv_bias=True))
    opt = build_optimizer(model, OptimizerConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert any("embed" in names[id(p)] for p in no_decay["params"])
    assert any(names[id(p)].endswith("bias") for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_loss_is_global_mean_over_supervised_tokens(train_yaml: Path):
    """train_step's loss = sum of weighted token losses / number of supervised tokens."""
    trainer, _ = _trainer(train_yaml)
    batches = trainer.loader.next_step()
    model = trainer.model
    expected_sum = 0.0
    with torch.no_grad():
        for b in batches:
            inputs = trainer.objective.prepare(b, trainer.noise)
            logits = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask).logits()
            expected_sum += float(trainer.objective.loss(output_of_logits(logits), inputs).loss_sum)
    targets = sum(int(b.loss_mask_BL.sum()) for b in batches)
    stats = trainer.train_step(batches)
    assert stats.num_targets == targets
    assert stats.loss == pytest.approx(expected_sum / targets, rel=1e-5)
    trainer.metrics.close()


def test_micro_batching_does_not_change_the_step(train_yaml: Path):
    """Accumulating 2 micro-batches of 4 equals one micro-batch of 8 (same loss, same update)."""
    a, _ = _trainer(train_yaml, "run.name=a")
    b, _ = _trainer(train_yaml, "run.name=b", "training.micro_batch_size=8")
    sa = a.train_step(a.loader.next_step())
    sb = b.train_step(b.loader.next_step())
    assert sa.loss == pytest.approx(sb.loss, rel=1e-5)
    assert sa.grad_norm == pytest.approx(sb.grad_norm, rel=1e-4)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)
    a.metrics.close()
    b.metrics.close()


def test_training_reduces_loss(train_yaml: Path):
    run_dir = _run_dir(train_yaml, "training.steps=40", "optimizer.lr=3e-3", "checkpointing.every_steps=null")
    losses = train_from_run_dir(run_dir)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5


def test_resume_is_bit_identical(train_yaml: Path, monkeypatch: pytest.MonkeyPatch):
    steps = ("training.steps=6", "checkpointing.every_steps=2")
    full = train_from_run_dir(_run_dir(train_yaml, "run.name=full", *steps))

    run_dir = _run_dir(train_yaml, "run.name=cut", *steps)
    real_step = build_mod.Trainer.train_step

    def crash_at_step_5(self, batches):
        if self.step == 4:
            raise KeyboardInterrupt("simulated interrupt")
        return real_step(self, batches)

    monkeypatch.setattr(build_mod.Trainer, "train_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train_from_run_dir(run_dir)
    monkeypatch.setattr(build_mod.Trainer, "train_step", real_step)
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000004"
    resumed = train_from_run_dir(run_dir)
    assert resumed == full[4:]  # exact float equality: same bits
    logged = [r["loss"] for r in read_metrics(run_dir)]
    assert logged == full  # the metrics file holds each step once
    # the run's threads in the log's first record only: the resume adds them to no record of its own
    assert [r.get("threads") for r in read_metrics(run_dir)] == [torch.get_num_threads()] + [None] * 5


def test_checkpoint_keep_last_n_and_latest(train_yaml: Path):
    run_dir = _run_dir(train_yaml, "training.steps=8", "checkpointing.every_steps=2", "checkpointing.keep_last_n=2")
    train_from_run_dir(run_dir)
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir())
    assert ckpts == ["step_00000006", "step_00000008"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    state = json.loads((run_dir / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    assert state["step"] == 8 and state["loader"]["position"] == 8 * 8


def test_crash_during_save_keeps_previous_checkpoint(train_yaml: Path, monkeypatch: pytest.MonkeyPatch):
    import dllm.checkpoint.manager as mgr

    run_dir = _run_dir(train_yaml, "training.steps=4", "checkpointing.every_steps=2")
    real_save = mgr.dcp.save
    calls = {"n": 0}

    def failing_save(state, checkpoint_id, **kw):
        calls["n"] += 1
        if calls["n"] == 2:  # the save at step 4 dies after writing part of its files
            Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
            raise OSError("disk full")
        return real_save(state, checkpoint_id=checkpoint_id, **kw)

    monkeypatch.setattr(mgr.dcp, "save", failing_save)
    with pytest.raises(OSError):
        train_from_run_dir(run_dir)
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000002"
    monkeypatch.setattr(mgr.dcp, "save", real_save)
    losses = train_from_run_dir(run_dir)  # resumes from step 2 and publishes step 4
    assert len(losses) == 2
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000004"
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_resume_refuses_another_artifact(workdir: Path):
    from dllm.config.loading import load_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare
    from tests.helpers import write_corpus

    train_yaml = write_yaml(workdir / "train.yaml", tiny_train_values())
    train_from_run_dir(_run_dir(train_yaml, "training.steps=2"))
    write_corpus(workdir / "data" / "train.jsonl", seed=7)  # different content, same shape
    prepare(load_config(PrepareSpec, workdir / "prepare.yaml"), workdir, overwrite=True)
    with pytest.raises(CheckpointError, match="data.path"):
        train_from_run_dir(_run_dir(train_yaml, "training.steps=4"))


def test_run_dir_refuses_a_different_model(train_yaml: Path):
    train_from_run_dir(_run_dir(train_yaml, "training.steps=2"))
    with pytest.raises(CheckpointError, match="model.hidden_size"):
        _run_dir(train_yaml, "model.hidden_size=128")
    _run_dir(train_yaml, "model.hidden_size=128", "checkpointing.resume=never")  # explicit start-over is allowed
    assert (train_yaml.parent / "runs" / "latest").resolve() == (train_yaml.parent / "runs" / "t").resolve()


def test_bfloat16_autocast_trains(train_yaml: Path):
    """autocast bf16 on CPU: parameters stay float32, the loss stays finite and close to float32's."""
    fp32 = train_from_run_dir(_run_dir(train_yaml, "run.name=fp32", "training.steps=3"))
    bf16_dir = _run_dir(train_yaml, "run.name=bf16", "training.steps=3", "training.autocast_dtype=bfloat16")
    bf16 = train_from_run_dir(bf16_dir)
    assert all(torch.isfinite(torch.tensor(bf16)))
    assert bf16 == pytest.approx(fp32, rel=0.05)
    from dllm.checkpoint.loading import load_for_inference

    loaded = load_for_inference(bf16_dir)
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())


def test_trains_on_an_indexed_sft_artifact(tmp_path: Path):
    """Prompt/completion samples in the indexed layout: only completions are noised and trained on."""
    from dllm.config.loading import validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare

    rows = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    values = {"sources": [{"path": "sft.jsonl", "format": "prompt_completion"}], "output": "data/prepared",
              "seq_len": 32, "layout": "indexed"}  # fmt: skip
    prepare(validate_config(PrepareSpec, values, source="prepare.yaml", base_dir=tmp_path), tmp_path)
    train_yaml = write_yaml(tmp_path / "train.yaml", tiny_train_values())
    trainer, _ = _trainer(train_yaml)
    batch = trainer.loader.next_step()[0]
    inputs = trainer.objective.prepare(batch, trainer.noise)
    # prompts (unsupervised) and padding are never noised; the mask keeps samples off their padding
    assert not bool((inputs.tokens_BL != batch.tokens_BL)[~batch.loss_mask_BL].any())
    assert inputs.mask.doc_ids_BL is not None
    losses = trainer.fit()
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    trainer.metrics.close()


def test_moe_trains_with_its_load_balancing_loss(train_yaml: Path):
    trainer, run_dir = _trainer(
        train_yaml, "model.family=qwen3_moe", "model.num_experts=4", "model.router_aux_loss_coef=0.01"
    )
    losses = trainer.fit()
    trainer.metrics.close()
    assert all(math.isfinite(x) for x in losses)
    records = read_metrics(run_dir)
    assert all(r["aux_loss"] >= 1.0 - 1e-4 for r in records)  # 1 is perfectly balanced
    router = trainer.model.layers[0].mlp.gate.weight
    assert router.requires_grad and trainer.optimizer.state[router]  # the router is trained


def test_lora_run_trains_only_adapters_and_resumes(train_yaml: Path, monkeypatch: pytest.MonkeyPatch):
    """Only adapter weights change and are checkpointed; a resumed LoRA run matches an uninterrupted one;
    generation loads base + adapters and merges them."""
    from dllm.checkpoint.loading import load_for_inference
    from dllm.models.lora import LoraLinear

    lora = ("lora.rank=4", "lora.alpha=8", "lora.targets=[q_proj, v_proj, up_proj]", "optimizer.lr=1e-2")
    steps = ("training.steps=4", "checkpointing.every_steps=2")
    trainer, run_dir = _trainer(train_yaml, "run.name=lora", *lora, *steps)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    assert base_before and all("lora_" not in n for n in base_before)
    full = trainer.fit()
    trainer.metrics.close()
    for n, p in trainer.model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n  # frozen: bit-identical
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(run_dir / "checkpoints" / "step_00000004")).read_metadata()
    model_keys = {k for k in meta.state_dict_metadata if k.startswith("model.")}
    assert model_keys and all(".lora_" in k for k in model_keys)  # only adapters are checkpointed

    cut_dir = _run_dir(train_yaml, "run.name=lora_cut", *lora, *steps)
    real_step = build_mod.Trainer.train_step

    def crash_at_step_3(self, batches):
        if self.step == 2:
            raise KeyboardInterrupt("simulated interrupt")
        return real_step(self, batches)

    monkeypatch.setattr(build_mod.Trainer, "train_step", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        train_from_run_dir(cut_dir)
    monkeypatch.setattr(build_mod.Trainer, "train_step", real_step)
    assert train_from_run_dir(cut_dir) == full[2:]

    loaded = load_for_inference(run_dir)
    assert not any(isinstance(m, LoraLinear) for m in loaded.model.modules())  # merged for inference
    x = torch.randint(0, 200, (1, 16))
    pos = torch.arange(16)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x, pos).logits(), trainer.model(x, pos).logits(), atol=1e-5, rtol=0)


def test_cpu_workers_start_with_the_retain_tunables_unless_told_not_to(train_yaml: Path, monkeypatch):
    from dllm.cli.launch_cmd import _worker_env
    from dllm.training.host_memory import memory_retained, retaining_env

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")  # the user's own tunables are kept
    spec = load_spec(train_yaml, "training.device=cpu")
    env, _ = _worker_env(spec)
    assert memory_retained(env)
    assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.arena_max=2:glibc.malloc.mmap_max=0:")
    assert env["PATH"] == os.environ["PATH"]
    assert retaining_env(env) == env  # idempotent
    system = spec.model_copy(update={"training": spec.training.model_copy(update={"cpu_allocator": "system"})})
    assert _worker_env(system)[0]["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"  # the user's, untouched
    assert not memory_retained({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"})


_FAULTS_OF_A_64MB_LOOP = """
import resource, torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):  # 64 MiB: above glibc's largest adaptive mmap threshold (32 MiB)
    torch.empty(16 << 20).fill_(1.0)  # retained: the heap grows to its working set, then stays
f0 = faults()
for _ in range(10):
    x = torch.empty(16 << 20).fill_(1.0)
    del x
print(faults() - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc")
def test_retained_memory_is_reused_without_page_faults():
    """A freed 64 MiB tensor: glibc's default unmaps it, so each new one faults its 16384 pages in again;
    started with the retain tunables, once the heap has grown to the loop's working set, new ones reuse it."""
    from dllm.training.host_memory import retaining_env

    def faults(env: dict[str, str]) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS_OF_A_64MB_LOOP], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert faults(retaining_env(plain)) < 1000  # 10 x 16384 pages without it
    assert faults(plain) > 10 * 16384 * 0.9


def test_resume_may_change_the_attention_kernel_but_not_the_model(train_yaml: Path):
    """Backends are exact, so a run written with `auto` resumes under a resolved or other backend;
    a different architecture is refused before anything is overwritten."""
    from dllm.errors import CheckpointError

    run_dir = _run_dir(train_yaml, "training.steps=2")
    train_from_run_dir(run_dir)
    text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(text.replace("attention_backend: blockwise", "attention_backend: auto"))
    assert _run_dir(train_yaml, "training.steps=3", "model.attention_backend=sdpa") == run_dir
    with pytest.raises(CheckpointError, match=r"different model \(model.hidden_size, model.num_heads, model.num_kv_"):
        _run_dir(train_yaml, "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1")
