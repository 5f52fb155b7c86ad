"""CPU threads per process: the `auto` rule, `training.threads` / `dllm launch --threads` reaching torch in
every process the launcher starts, `dllm serve --threads`, and `dllm doctor`'s warning on a busy machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dllm.cli.main import main
from dllm.errors import ConfigError
from dllm.parallel import threads
from dllm.training.metrics import read_metrics
from tests.distributed.harness import free_port
from tests.helpers import load_spec


@pytest.fixture
def keep_threads() -> Iterator[None]:
    """The commands below set this process's torch threads: put them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_auto_rule(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(threads, "machine_cores", lambda: 8)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)  # an idle machine
    monkeypatch.setattr(threads, "running_now", lambda: 0)
    assert threads.resolve_threads("auto", 1, {}) == 8  # one process: every core
    assert threads.resolve_threads("auto", 3, {}) == 2  # cores // workers on the node
    assert threads.resolve_threads("auto", 16, {}) == 1  # at least one
    assert threads.resolve_threads("auto", 2, {"OMP_NUM_THREADS": "3"}) == 3  # the user's own setting
    assert threads.resolve_threads("auto", 2, {"OMP_NUM_THREADS": "0"}) == 4  # not a thread count: ignored
    assert threads.resolve_threads(5, 2, {"OMP_NUM_THREADS": "3"}) == 5  # an explicit setting wins
    assert threads.threads_env({"A": "1"}, 3) == {"A": "1", "OMP_NUM_THREADS": "3"}
    assert threads.parse_threads("auto", "--threads") == "auto" and threads.parse_threads("4", "--threads") == 4
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ConfigError, match=f"--threads: expected a positive number of threads or auto, got {bad!r}"):
            threads.parse_threads(bad, "--threads")


@pytest.mark.parametrize(
    ("cores", "affinity", "load", "procs", "expected"),
    [
        (2, 2, 0.5, 1, 2),  # a load below one core: every core
        (2, 2, 1.0, 1, 1),  # one core busy with another job
        (2, 2, 1.9, 1, 1),
        (2, 2, 2.1, 1, 1),  # just above the cores (the SDPA case of the module docstring): one thread
        (2, 2, 12.0, 1, 1),
        (8, 8, 3.0, 2, 2),  # 5 free cores for 2 workers
        (64, 2, 30.0, 1, 2),  # a 2-core cpuset on a big host with free cores
        (64, 2, 63.5, 1, 1),  # ... that is busy
    ],
)
def test_auto_leaves_the_cores_the_load_keeps_busy(monkeypatch: pytest.MonkeyPatch, cores: int, affinity: int,
                                                   load: float, procs: int, expected: int):  # fmt: skip
    monkeypatch.setattr(threads, "machine_cores", lambda: cores)
    monkeypatch.setattr(threads, "usable_cores", lambda: affinity)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(threads, "running_now", lambda: None)  # no /proc: the load average alone
    assert threads.resolve_threads("auto", procs, {}) == expected
    monkeypatch.setattr(threads, "running_now", lambda: cores)  # as many runnable now: the load decides
    assert threads.resolve_threads("auto", procs, {}) == expected
    assert threads.resolve_threads("auto", procs, {"OMP_NUM_THREADS": "3"}) == 3  # the user's own setting wins
    assert threads.resolve_threads(4, procs, {}) == 4


def test_a_busy_machine_is_named():
    assert threads.busy_warning(2.5, 2) is None
    assert "load average (9.0) is far above the 2 cores" in threads.busy_warning(9.0, 2)
    assert threads.launch_load_warning(2.0, 2, 2) is None
    assert "load average (2.1) is above the 2 cores" in threads.launch_load_warning(2.1, 2, 1)


def test_the_load_of_work_that_just_ended_frees_its_cores(monkeypatch: pytest.MonkeyPatch):
    """The 1-minute load average still counts a `data prepare` that ended a second ago: when fewer tasks are
    runnable right now, auto takes the cores they leave (and launch does not warn)."""
    monkeypatch.setattr(threads, "machine_cores", lambda: 2)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    monkeypatch.setattr(threads, "running_now", lambda: 0)
    assert threads.resolve_threads("auto", 1, {}) == 2
    monkeypatch.setattr(threads, "running_now", lambda: 1)  # one other job running now
    assert threads.resolve_threads("auto", 1, {}) == 1
    assert threads.launch_load_warning(3.5, 2, 2, running=1) is None
    assert threads.launch_load_warning(3.5, 2, 1, running=3) is not None


def test_running_now_reads_the_machine():
    running = threads.running_now(reads=3, interval_s=0.0)
    if Path("/proc/stat").is_file():
        assert isinstance(running, int) and 0 <= running < 10_000
    else:
        assert running is None


def test_launch_warns_in_one_line_on_a_busy_machine(train_yaml: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.chdir(train_yaml.parent)
    monkeypatch.setattr(threads, "running_now", lambda: None)
    monkeypatch.setattr(threads, "machine_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.5, 3.0, 2.0))
    assert main(["launch", "--config", "train.yaml", "--dry-run"]) == 0
    busy = [line for line in capsys.readouterr().err.splitlines() if "load average" in line]
    assert busy == [
        "dllm: warning: the load average (3.5) is above the 2 cores: other jobs are running and each CPU training step "
        "waits on them (1 thread(s) per process now); wait for a quieter machine, or launch with --threads 1"
    ]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 3.0, 2.0))
    assert main(["launch", "--config", "train.yaml", "--dry-run"]) == 0
    assert "load average" not in capsys.readouterr().err


def test_doctor_shows_the_threads_and_warns_when_busy(monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (40.0, 30.0, 20.0))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert main(["doctor"]) == 0
    out, err = capsys.readouterr()
    rows = {line.split("  ")[0]: line.split("  ", 1)[1].strip() for line in out.splitlines()}
    assert rows["threads (auto)"] == "1 for one process (OMP_NUM_THREADS is set)"
    assert rows["load average"] == "40.00 30.00 20.00 (1, 5, 15 min)"
    assert "dllm: warning: the load average (40.0) is far above" in err and "--threads 1" in err
    assert main(["doctor", "--json"]) == 0
    assert "far above" in json.loads(capsys.readouterr().out)["warnings"][0]


def test_the_launcher_hands_its_workers_the_thread_count(train_yaml: Path, monkeypatch: pytest.MonkeyPatch):
    from dllm.cli.launch_cmd import _worker_env

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env, n = _worker_env(load_spec(train_yaml, "training.threads=3", "topology.nproc_per_node=2"))
    assert n == 3 and env["OMP_NUM_THREADS"] == "3"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.setattr(threads, "machine_cores", lambda: 6)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)  # an idle machine
    monkeypatch.setattr(threads, "running_now", lambda: 0)
    env, n = _worker_env(load_spec(train_yaml, "topology.nproc_per_node=2"))
    assert n == 3 and env["OMP_NUM_THREADS"] == "3"  # auto: 6 cores / 2 workers


def test_launch_threads_reach_torch_in_a_one_process_run(
    train_yaml: Path, monkeypatch: pytest.MonkeyPatch, capsys, keep_threads: None
):
    """--threads 2 against the test environment's OMP_NUM_THREADS=1: the setting wins and torch trains with it."""
    monkeypatch.chdir(train_yaml.parent)
    assert main(["launch", "--config", "train.yaml", "--dry-run", "--threads", "0"]) == 2
    assert "dllm: error: --threads: expected a positive number" in capsys.readouterr().err
    assert main(["launch", "--config", "train.yaml", "--threads", "2", "--set", "training.steps=2"]) == 0
    assert "(2 CPU thread(s) per process, training.threads)" in capsys.readouterr().err
    assert read_metrics(train_yaml.parent / "runs" / "t")[0]["threads"] == 2


PROBE = """
import os, sys, torch
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").write(str(torch.get_num_threads()))
"""


@pytest.mark.distributed
def test_launch_threads_reach_torch_in_every_worker(train_yaml: Path):
    """Two workers under torchrun: each starts with the launcher's OMP_NUM_THREADS (torchrun would set 1), and
    the trainer of each sets torch's threads from training.threads (rank 0 records it)."""
    from dllm.cli.launch_cmd import _worker_env

    spec = load_spec(train_yaml, "training.threads=2", "topology.nproc_per_node=2")
    env, _ = _worker_env(spec)
    (train_yaml.parent / "probe.py").write_text(PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "probe.py", "."]
    subprocess.run(cmd, cwd=train_yaml.parent, env=env, check=True, capture_output=True, timeout=120)
    assert [(train_yaml.parent / f"rank{r}").read_text() for r in (0, 1)] == ["2", "2"]
    args = ["launch", "--config", "train.yaml", "--nproc-per-node", "2", "--threads", "2", "--set", "training.steps=2"]
    res = subprocess.run([sys.executable, "-m", "dllm.cli.main", *args], cwd=train_yaml.parent, capture_output=True,
                         text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert read_metrics(train_yaml.parent / "runs" / "t")[0]["threads"] == 2


def test_serve_threads_reach_torch(train_yaml: Path, monkeypatch: pytest.MonkeyPatch, capsys, keep_threads: None):
    import uvicorn

    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    spec, _ = resolve_run_spec(load_spec(train_yaml, "training.steps=1"))
    train_from_run_dir(prepare_run_dir(spec))
    seen: list[int] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: seen.append(torch.get_num_threads()))
    port = ["--port", str(free_port())]
    for n in (2, 1):
        assert main(["serve", "--run", str(train_yaml.parent / "runs" / "t"), "--threads", str(n), *port]) == 0
        assert f"{n} CPU thread(s), max batch" in capsys.readouterr().err
    assert seen == [2, 1]
    assert main(["serve", "--run", str(train_yaml.parent / "runs" / "t"), "--threads", "many", *port]) == 2


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "-p", "x"],
        ["chat"],
        ["eval", "tasks", "--tasks", "addition"],
        ["eval", "likelihood", "--data", "d"],
        ["convert", "--to-hf", "out"],
    ],  # fmt: skip
)
def test_every_command_that_runs_a_model_takes_threads(command: list[str], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, capsys,
                                                       keep_threads: None):  # fmt: skip
    """One shared --threads (cli/common.py), checked in one line and applied before the model loads."""
    monkeypatch.chdir(tmp_path)
    assert main([*command, "--threads", "0"]) == 2
    assert "dllm: error: --threads: expected a positive number of threads or auto, got '0'" in capsys.readouterr().err
    torch.set_num_threads(1)
    assert main([*command, "--model", str(tmp_path / "missing"), "--threads", "2"]) == 2  # no such model folder
    assert torch.get_num_threads() == 2 and "missing" in capsys.readouterr().err
