"""Context and block parallelism through the real Trainer and `dllm launch`:
gloo processes reproduce the one-process run on the same global batch (losses, gradient norms and
the parameters after the steps), and a CSBP checkpoint resumes on another CSBP size and on one process.
DiffusionGemma's native SFT (an MoE model, routers frozen by the build, self-conditioning drawn) trains
the same way under CSBP, its sliding-window layer receiving only what its window reaches, and under EP2.

Parameters are compared with optimizer.eps 1e-6 instead of the default 1e-8. Adam's first update of a
weight is lr * g / (|g| + eps): for the few entries whose gradient is near 0 it is a sign function of
g, so the summation-order noise of those entries (~1e-11 absolute; the K/V gradients of CP/BP are
summed in another order than one process sums them) moves them by up to ~lr * 1e-3. Measured after one
step with eps 1e-8: 3.5e-5 max relative difference in one weight matrix (12 of 12288 entries above
1e-8 absolute), against 1e-6 for plain data parallelism; with eps 1e-6 the comparison is one of
gradients again (5e-6). The losses and gradient norms agree to ~1e-7 either way.

Relative difference of a tensor: max |a - b| / max |b|.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.checkpoint.loading import load_for_inference
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.training.metrics import read_metrics
from tests.helpers import PREPARE, load_spec, tiny_train_values, write_corpus, write_yaml

pytestmark = pytest.mark.distributed

OBJECTIVES = {"bd3lm": {"name": "bd3lm", "block_size": 4}, "mdlm": {"name": "mdlm"}}  # bd3lm: 8 blocks of 32


def _context(mode: str, cp: int = 1, bp: int = 1, transport: str = "collective") -> list[str]:
    sets = [f"topology.context.mode={mode}", f"topology.context.cp_size={cp}", f"topology.context.bp_size={bp}"]
    sets.append(f"topology.context.transport={transport}")
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared artifact (seq_len 32) and one config per objective: constant LR (a run stopped early
    follows the reference's schedule), Adam eps 1e-6 (see the module doc)."""
    from dllm.data.prepare import prepare

    root = tmp_path_factory.mktemp("cp_training")
    write_corpus(root / "data" / "train.jsonl")
    write_yaml(root / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, root / "prepare.yaml"), root)
    for name, objective in OBJECTIVES.items():
        values = tiny_train_values(
            training={"steps": 3},
            optimizer={"lr": 1e-3, "eps": 1e-6},
            scheduler={"name": "constant"},
            objective=objective,
            checkpointing={"every_steps": 10},
        )
        write_yaml(root / f"{name}.yaml", values)
    return root


@pytest.fixture(scope="module")
def gemma_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompt/completion records, one per row (seq_len 32), and a tiny MoE DiffusionGemma with one sliding
    layer (window 8) and one full layer, trained with diffusiongemma_native_sft (canvas blocks of 8). Adam
    eps 1e-4 (see the module doc): this model's gradients have more entries near 1e-6, where eps 1e-6 still
    turns summation-order noise into ~5e-5 relative parameter differences (measured, CSBP cp2 x bp2)."""
    import json

    from dllm.data.prepare import prepare

    root = tmp_path_factory.mktemp("cp_training_gemma")
    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]
    (root / "data").mkdir()
    (root / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sources = [{"path": "data/sft.jsonl", "format": "prompt_completion"}]
    write_yaml(root / "prepare.yaml", {**PREPARE, "sources": sources, "layout": "indexed"})
    prepare(load_config(PrepareSpec, root / "prepare.yaml"), root)
    model = {"family": "diffusion_gemma", "num_experts": 4, "router_aux_loss_coef": 0.0, "canvas_length": 8,
             "local_window": 8, "attention_pattern": ["local", "global"]}  # fmt: skip
    values = tiny_train_values(
        model=model, training={"steps": 3}, optimizer={"lr": 1e-3, "eps": 1e-4}, scheduler={"name": "constant"},
        objective={"name": "diffusiongemma_native_sft", "block_size": 8}, checkpointing={"every_steps": 10},
    )  # fmt: skip
    write_yaml(root / "dgemma.yaml", values)
    return root


def _dllm(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "dllm.cli.main", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _launch(project: Path, objective: str, run: str, nproc: int, *extra: str) -> Path:
    args = ["launch", "--config", f"{objective}.yaml", "--nproc-per-node", str(nproc), "--set", f"run.name={run}"]
    _dllm([*args, *extra], project)
    return project / "runs" / run


_REFERENCES: dict[tuple[str, int], Path] = {}


def _one_process(project: Path, objective: str, steps: int) -> Path:
    """The one-process run (in this process, once per module) that the sharded runs must reproduce."""
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    key = (objective, steps)
    if key not in _REFERENCES:
        overrides = (f"run.name=one-{objective}-{steps}", f"training.steps={steps}")
        spec, _ = resolve_run_spec(load_spec(project / f"{objective}.yaml", *overrides))
        run_dir = prepare_run_dir(spec)
        train_from_run_dir(run_dir)
        _REFERENCES[key] = run_dir
    return _REFERENCES[key]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _max_param_diff(run: Path, reference: Path) -> tuple[str, float]:
    """The worst tensor of the latest checkpoints' weights (loaded in this process: DCP reshards)."""
    a = load_for_inference(run=run).model.state_dict()
    b = load_for_inference(run=reference).model.state_dict()
    assert a.keys() == b.keys()
    return max(((k, _rel(a[k], b[k])) for k in b), key=lambda kv: kv[1])


def _records(run: Path, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run)]


CASES = {
    # name: (objective, processes, topology.context --set arguments)
    "csbp-cp2-bp2": ("bd3lm", 2, _context("csbp", 2, 2)),
    "csbp-cp2-bp2-ring": ("bd3lm", 2, _context("csbp", 2, 2, "ring")),  # clean K/V shards passed around a ring
    "cp2-mdlm": ("mdlm", 2, _context("cp", 2)),
    "bp2": ("bd3lm", 2, _context("bp", 1, 2)),
    # DP2 x CSBP(CP2, BP2): a CSBP group has bp ranks (its CP groups split them), so 4 processes, not 2 x 2 x 2
    "dp2-x-csbp-cp2-bp2": ("bd3lm", 4, _context("csbp", 2, 2)),
}
SLOW = {"dp2-x-csbp-cp2-bp2"}  # 4 processes on 2 cores: ~15-20 s


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_trainer_steps_match_one_process(project: Path, name: str):
    """3 optimizer steps (global batch 8, micro-batches of 4: gradient accumulation when dp is 1)."""
    objective, nproc, context = CASES[name]
    reference = _one_process(project, objective, 3)
    run = _launch(project, objective, name, nproc, *context)
    losses, ref_losses = _records(run, "loss"), _records(reference, "loss")
    norms, ref_norms = _records(run, "grad_norm"), _records(reference, "grad_norm")
    worst, param_diff = _max_param_diff(run, reference)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    print(f"{name}: losses {losses} vs {ref_losses}: max rel {loss_diff:.2e}; params: {worst} {param_diff:.2e}")
    assert len(losses) == 3
    assert _records(run, "num_targets") == _records(reference, "num_targets")  # counted once per group
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert param_diff <= 1e-5, (worst, param_diff)


GEMMA_CASES = {
    "dgemma-csbp-cp2-bp2": (2, _context("csbp", 2, 2)),
    "dgemma-ep2": (2, ["--set", "topology.ep_size=2"]),  # ep ranks are data-parallel: each reads its own rows
}


@pytest.mark.parametrize("name", list(GEMMA_CASES))
def test_diffusion_gemma_steps_match_one_process(gemma_project: Path, name: str):
    nproc, extra = GEMMA_CASES[name]
    reference = _one_process(gemma_project, "dgemma", 3)
    run = _launch(gemma_project, "dgemma", name, nproc, *extra)
    losses, ref_losses = _records(run, "loss"), _records(reference, "loss")
    worst, param_diff = _max_param_diff(run, reference)
    print(f"{name}: losses {losses} vs {ref_losses}; params: {worst} {param_diff:.2e}")
    assert len(losses) == 3
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert _records(run, "grad_norm") == pytest.approx(_records(reference, "grad_norm"), rel=1e-5)
    assert param_diff <= 1e-5, (worst, param_diff)


@pytest.mark.slow
def test_csbp_checkpoint_resumes_on_other_sizes(project: Path):
    """`dllm launch --nproc-per-node 4` trains bd3lm with CSBP (cp 2 x bp 4) for 20 steps, saving at
    10 and 20; the step-20 checkpoint resumes on 2 processes (CSBP cp 2 x bp 2) and on 1 (no context
    parallelism), and step 21 gives the uninterrupted one-process run's loss."""
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    reference = _records(_one_process(project, "bd3lm", 21), "loss")
    four = _launch(project, "bd3lm", "csbp4", 4, "--set", "training.steps=20", *_context("csbp", 2, 4))
    assert _records(four, "loss") == pytest.approx(reference[:20], rel=1e-5)
    shutil.copytree(four, project / "runs" / "csbp4-to-1")  # a second copy of the step-20 checkpoint
    saved = (four / "metrics.jsonl").read_text().splitlines()

    two = _launch(project, "bd3lm", "csbp4", 2, "--set", "training.steps=21", *_context("csbp", 2, 2))
    spec, _ = resolve_run_spec(load_spec(project / "bd3lm.yaml", "run.name=csbp4-to-1", "training.steps=21"))
    one = train_from_run_dir(prepare_run_dir(spec))
    assert len(one) == 1  # resumed at step 20: one step run
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert lines[:20] == saved and len(lines) == 21  # resumed: the first 20 records were kept as written
    resumed = {"2 processes": _records(two, "loss")[20], "1 process": one[0]}
    print(f"step 21: uninterrupted {reference[20]}, resumed {resumed}")
    for loss in resumed.values():
        assert loss == pytest.approx(reference[20], rel=1e-5)
