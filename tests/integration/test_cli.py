"""The CLI end to end, as a user drives it: init -> prepare -> validate -> launch -> interrupt ->
resume -> generate; and every command answers bad input with one line and exit code 2."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dllm.training.metrics import read_metrics

pytestmark = pytest.mark.slow

SMALL = [
    "--set",
    "model.preset=tiny",
    "--set",
    "logging.every_steps=1",
    "--set",
    "logging.progress=lines",
    "--set",
    "logging.tensorboard=off",
    "--set",
    "checkpointing.every_steps=5",
    "--set",
    "training.global_batch_size=8",
    "--set",
    "training.micro_batch_size=4",
]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def dllm(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dllm.cli.main", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli")
    _ok(dllm(["init", "proj", "--num-records", "1500"], root))
    proj = root / "proj"
    _ok(dllm(["data", "prepare", "--config", "prepare.yaml", "-q"], proj))
    return proj


def test_init_writes_a_commented_project(project: Path):
    text = (project / "train.yaml").read_text()
    assert "# Optimizer steps to run in total" in text
    assert (project / "README.md").is_file()
    assert json.loads((project / "data" / "sentences.jsonl").read_text().splitlines()[0])["text"]
    first_sum = json.loads((project / "data" / "arithmetic.jsonl").read_text().splitlines()[0])
    assert first_sum["prompt"].endswith(" =") and first_sum["completion"].startswith(" ")


def test_validate_commands(project: Path):
    res = _ok(dllm(["data", "validate", "data/prepared", "--config", "train.yaml"], project))
    assert res.stdout.startswith("ok:") and "compatible with train.yaml" in res.stdout
    res = _ok(dllm(["config", "validate", "--config", "train.yaml", "--set", "training.steps=7"], project))
    assert "steps: 7" in res.stdout and "vocab_size: 320" in res.stdout
    res = _ok(dllm(["config", "schema"], project))
    assert json.loads(res.stdout)["properties"]["training"]
    res = _ok(dllm(["launch", "--config", "train.yaml", "--dry-run", "--nproc-per-node", "2"], project))
    assert "torch.distributed.run" in res.stdout and "--nproc-per-node=2" in res.stdout
    assert not (project / "runs").exists()  # a dry run writes nothing


def test_interrupt_resume_generate(project: Path):
    steps = ["--set", "training.steps=40"]
    _ok(dllm(["launch", "--config", "train.yaml", *SMALL, *steps, "--set", "run.name=whole"], project))
    whole = [r["loss"] for r in read_metrics(project / "runs" / "whole")]
    assert len(whole) == 40

    args = [
        sys.executable,
        "-m",
        "dllm.cli.main",
        "launch",
        "--config",
        "train.yaml",
        *SMALL,
        *steps,
        "--set",
        "run.name=cut",
    ]
    proc = subprocess.Popen(args, cwd=project, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = project / "runs" / "cut" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 12:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(read_metrics(project / "runs" / "cut"))
    assert 12 <= done < 40
    latest = (project / "runs" / "cut" / "checkpoints" / "latest").read_text().strip()
    assert latest in {"step_00000010", "step_00000015", "step_00000020", "step_00000025"}

    res = _ok(dllm(["launch", "--config", "train.yaml", *SMALL, *steps, "--set", "run.name=cut"], project))
    resumed = [r["loss"] for r in read_metrics(project / "runs" / "cut")]
    assert resumed == whole, "a resumed run must give the same losses, bit for bit"

    res = _ok(
        dllm(
            [
                "generate",
                "--run",
                "runs/latest",
                "--prompt",
                "12 + 7 =",
                "--prompt",
                "the cat",
                "--gen-length",
                "8",
                "--block-length",
                "4",
                "--steps",
                "8",
                "--json",
            ],
            project,
        )
    )
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["12 + 7 =", "the cat"]
    assert all(x["nfe"] <= 8 for x in lines) and "NFE" in res.stderr
    res = _ok(
        dllm(
            ["generate", "--checkpoint", f"runs/cut/checkpoints/{latest_name(project)}", "-p", "1 + 1 ="],
            project,
        )
    )
    assert res.stdout.startswith("1 + 1 =")


def test_generate_sampler_options_and_chat(project: Path):
    """Runs after the resume test (its run is runs/latest): sampler file + flags, caches, stop
    strings, JSONL to a file, the chat template, and an interactive chat fed on stdin."""
    (project / "sampler.yaml").write_text("gen_length: 16\nblock_length: 8\nsteps: 8\npolicy: margin\n")
    args = ["generate", "--run", "runs/latest", "--sampler-config", "sampler.yaml", "--cache", "dual"]
    res = _ok(dllm([*args, "-p", "1 + 2 =", "-p", "13 + 4 =", "--stop", "\n", "-o", "out.jsonl", "--batch-size", "1"],
                   project))  # fmt: skip
    assert "1/2 prompts" in res.stderr and "2/2 prompts" in res.stderr  # progress of a job written to a file
    rows = [json.loads(x) for x in (project / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["1 + 2 =", "13 + 4 ="] and res.stdout == ""
    assert all(r["cached_tokens"] > 0 and r["nfe"] >= 1 and "\n" not in r["completion"] for r in rows)
    assert "margin/dual/bidirectional" in res.stderr
    res = _ok(dllm(["generate", "--run", "runs/latest", "--chat", "-p", "hi", "--gen-length", "8", "--json"], project))
    row = json.loads(res.stdout)
    turns = {"prompt": [{"role": "user", "content": "hi"}],
             "completion": [{"role": "assistant", "content": row["completion"]}]}  # fmt: skip
    assert row["prompt"] == "hi" and row["chat"] == turns  # the exchange as turns, for data prepare
    res = _ok(dllm(["generate", "--run", "runs/latest", "-p", "hi", "--policy", "threshold", "--json"], project))
    assert json.loads(res.stdout)["nfe"] <= 32
    # --compile: the model's blocks compiled (dynamic shapes), the same greedy text as eager for two prompts
    args = ["generate", "--run", "runs/latest", "-p", "1 + 2 =", "-p", "113 + 4 =", "--gen-length", "8", "--json"]
    eager = [json.loads(x)["completion"] for x in _ok(dllm(args, project)).stdout.splitlines()]
    compiled = [json.loads(x)["completion"] for x in _ok(dllm([*args, "--compile"], project)).stdout.splitlines()]
    assert compiled == eager
    chat = subprocess.run(
        [sys.executable, "-m", "dllm.cli.main", "chat", "--run", "runs/latest", "--gen-length", "8", "--live"],
        cwd=project, env=_env(), input="1 + 1 =\n/reset\n2 + 2 =\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert "history cleared" in chat.stderr and chat.stderr.count("[NFE ") == 2
    assert len(chat.stdout.splitlines()) <= 2


def test_eval_likelihood_and_tasks(project: Path):
    """Runs after the resume test: the bound on prepared rows (an exact AR number is refused for this masked
    model: it is not causal), and task accuracy that matches a count by hand over the written outputs."""
    base = ["eval", "likelihood", "--run", "runs/latest", "--data", "data/prepared", "--limit", "8", "--json"]
    res = _ok(dllm([*base, "--mc-samples", "4"], project))
    rec = json.loads(res.stdout)
    assert rec["kind"] == "mdlm" and rec["rows"] == 8 and rec["mc_samples"] == 4 and rec["forward_passes"] == 4
    assert 0 < rec["nelbo_per_token"] < 10 and rec["mc_stderr"] > 0 and not rec["exact"]
    low = json.loads(_ok(dllm([*base, "--mc-samples", "4", "--dtype", "bfloat16"], project)).stdout)
    assert low["dtype"] == "bfloat16" and rec["dtype"] == "float32"  # the same masks, the forward in bf16
    assert abs(low["nelbo_per_token"] - rec["nelbo_per_token"]) < 0.05 * rec["nelbo_per_token"]
    ar = dllm([*base, "--kind", "ar"], project)
    assert ar.returncode == 2 and ar.stderr.startswith("dllm: error: kind: ar scores causal") and not ar.stdout
    text = _ok(dllm(base[:-1], project)).stdout
    assert "NELBO (upper bound on NLL) per token" in text and "perplexity bound" in text

    args = ["eval", "tasks", "--run", "runs/latest", "--limit", "6", "--batch-size", "4"]
    res = _ok(dllm([*args, "--tasks", "addition,copy", "-o", "outs.jsonl", "--json"], project))
    summaries = [json.loads(x) for x in res.stdout.splitlines()]
    outputs = [json.loads(x) for x in (project / "outs.jsonl").read_text().splitlines()]
    for summary in summaries:
        mine = [o for o in outputs if o["task"] == summary["name"]]
        by_hand = sum(o["output"].strip() == o["answer"].strip() for o in mine) / len(mine)
        assert summary["accuracy"] == pytest.approx(by_hand) and summary["examples"] == 6
        assert summary["forwards_per_answer"] > 0 and summary["tokens_per_forward"] > 0
    # a user task whose answers are the model's own (greedy, deterministic) outputs for half the prompts
    mine = [o for o in outputs if o["task"] == "addition"]
    rows = [
        {"prompt": o["prompt"], "answer": o["output"] if i % 2 == 0 else o["output"] + "#"} for i, o in enumerate(mine)
    ]
    (project / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = _ok(dllm([*args, "--tasks", "mine.jsonl", "--json", "--gen-length", "8"], project))
    assert json.loads(res.stdout)["accuracy"] == pytest.approx(0.5)
    table = _ok(dllm([*args, "--tasks", "pattern"], project)).stdout
    assert table.splitlines()[0].split()[:2] == ["task", "accuracy"] and "pattern" in table


def latest_name(project: Path) -> str:
    return (project / "runs" / "cut" / "checkpoints" / "latest").read_text().strip()


def test_data_inspect_stats_and_workers(project: Path):
    res = _ok(dllm(["data", "prepare", "--config", "prepare.yaml", "-q", "--workers", "2", "--output", "w2"], project))
    # text split across rows as it comes, the prompt/completion records kept whole
    assert "wrote w2 (packed, packing mixed)" in res.stdout and "records split across rows" in res.stdout
    a = (project / "data" / "prepared" / "tokens.bin").read_bytes()
    assert (project / "w2" / "tokens.bin").read_bytes() == a  # the same bytes with 2 worker processes
    res = _ok(dllm(["data", "inspect", "data/prepared", "-i", "0", "-i", "3"], project))
    assert "packed sample 0 of" in res.stdout and "packed sample 3 of" in res.stdout and "<|eos|>" in res.stdout
    assert "data/prepared: packed, packing mixed;" in res.stdout
    res = _ok(dllm(["data", "stats", "data/prepared", "--json", "--plot", "lengths.png"], project))
    stats = json.loads(res.stdout)
    assert stats["records_read"] == 1500 and stats["supervised_tokens"] > 0
    assert 0 < stats["split_across_rows"] < 1500  # sentences only: every sum lies inside one row
    assert (project / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = _ok(dllm(["data", "stats", "data/prepared"], project))
    assert "records read" in res.stdout and "split across rows" in res.stdout


def test_doctor(project: Path):
    res = _ok(dllm(["doctor"], project))
    assert "torch" in res.stdout and "gloo" in res.stdout


BAD_INPUTS = [
    (["launch", "--config", "missing.yaml"], "missing.yaml: no such config file"),
    (["launch", "--config", "train.yaml", "--set", "optimizer.lr=-1"], "--set optimizer.lr"),
    (["launch", "--config", "train.yaml", "--set", "training.stepz=3"], "training.stepz: unknown field"),
    (["launch", "--config", "train.yaml", "--set", "training.steps"], "expected KEY=VALUE"),
    (["launch", "--config", "train.yaml", "--nproc-per-node", "3"], "training.global_batch_size"),
    (["launch", "--config", "train.yaml", "--set", "data.seq_len=48"], "data.seq_len"),
    (["launch", "--config", "train.yaml", "--set", "training.device=cuda"], "training.device"),
    (["launch", "--config", "bad.yaml"], "bad.yaml:3: optimizer.lr"),
    (["launch", "--config", "broken.yaml"], "broken.yaml:3: invalid YAML"),
    (["config", "validate", "--config", "train.yaml", "--set", "model.preset=huge"], "model: unknown preset"),
    (["data", "prepare", "--config", "prepare.yaml"], "already exists; pass --overwrite"),
    (["data", "validate", "nowhere"], "nowhere: no manifest.json"),
    (["data", "inspect", "data/prepared", "-i", "999999"], "sample 999999 is out of range"),
    (["data", "stats", "nowhere"], "nowhere: no manifest.json"),
    (["data", "prepare", "--config", "prepare.yaml", "--workers", "0"], "--workers"),
    (["generate", "--run", "nowhere", "-p", "x"], "nowhere: not a run folder"),
    (["generate", "--run", "runs/latest"], "at least one --prompt"),
    (["generate", "--run", "runs/latest", "-p", "x", "--block-length", "5"], "block_length 5 must divide"),
    (["generate", "--run", "runs/latest", "-p", "x", "--cache", "block"], "need block attention"),
    (["generate", "--run", "runs/latest", "-p", "x", "--set", "polcy=x"], "--set polcy: unknown field"),
    (["generate", "--run", "runs/latest", "-p", "x", "--policy", "uniform"], "uniform decodes uniform-state"),
    (["generate", "--run", "runs/latest", "-p", "x", "--sampler-config", "nope.yaml"], "nope.yaml does not exist"),
    (["chat", "--run", "nowhere"], "nowhere: not a run folder"),
    (["eval", "tasks", "--run", "runs/latest", "--tasks", "nope"], "neither a built-in task"),
    (["eval", "likelihood", "--run", "runs/latest", "--data", "nowhere"], "nowhere"),
    (["eval", "likelihood", "--run", "runs/latest", "--data", "data/prepared", "--sampling", "odd"], "--sampling"),
    (["init", "."], "is not empty"),
    (["launch", "--config", "train.yaml", "--bogus"], "No such option"),
    (["nonsense"], "No such command"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_INPUTS, ids=[" ".join(a)[:50] for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2(project: Path, args: list[str], expected: str):
    (project / "bad.yaml").write_text(
        "data: {path: data/prepared, seq_len: 64}\noptimizer:\n  lr: -3\n"
        "training: {steps: 1, global_batch_size: 2, micro_batch_size: 1}\n"
    )
    (project / "broken.yaml").write_text("training:\n  steps: 1\n   lr: 2\n")
    res = dllm(args, project)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("dllm: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in res.stderr
