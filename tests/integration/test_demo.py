"""`make demo` (python -m dllm.demo) through the real CLI, shortened: it prints the held-out score, one sentence
on what it means and the next three commands, and they are commands the CLI takes."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from dllm import demo
from dllm.cli.main import main


def test_the_demo_ends_with_its_score_its_meaning_and_three_next_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    folder = tmp_path / "demo-run"
    code = demo.main(["--dir", str(folder), "--set", "training.steps=4", "--set", "checkpointing.every_steps=4",
                      "--num-prompts", "3"])  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    score = next(line for line in lines if line.startswith("arithmetic on held-out sums"))
    assert "/3 answers right; the whole demo took" in score
    assert lines[lines.index(score) + 1].startswith("what it means: ")
    tail = lines[lines.index(score) + 2 :]
    assert tail[0] == "next:" and [t.split(":")[0].strip() for t in tail[1:]] == ["try it", "score it", "serve it"]
    monkeypatch.chdir(folder)
    for line in tail[1:3]:  # the first two run as printed, from the demo folder (serve would block)
        command = shlex.split(line.split("&& dllm ", 1)[1])
        assert main([*command, "--limit", "2"] if command[0] == "eval" else command) == 0, command
