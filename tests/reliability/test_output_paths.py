"""No command overwrites what it reads: the output flags of every command (generate -o, eval tasks -o, data stats
--plot, plot -o, convert --to / --to-hf, data prepare --output, init, recipe copy, launch's run folder) pointed
at every file of a tiny run folder, of an artifact and of a model folder, at the command's own input file, a
symbolic and a hard link to it, and at /proc.

Every case ends the way a user mistake ends (`_run` of test_fuzz_cli.py): exit 2, one `dllm: error:` line, no
traceback, and every file of the world unchanged (hashed before and after). The legitimate uses still work: a
new file next to a run, a previous output of the same command overwritten, `plot -o plot.png` in the working
folder, a previous artifact or convert output replaced with --overwrite.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dllm.cli.main import main as dllm
from tests.helpers import PREPARE, write_corpus, write_yaml
from tests.reliability.ckpt_runs import STEP2, trained_run
from tests.reliability.test_fuzz_cli import _run, _snapshot

RUN = "runs/t"
CKPT = f"{RUN}/checkpoints/{STEP2}"
ART = "data/prepared"

COMMANDS = {  # what it runs with the output {out}, and the file it reads that a link may name
    "generate": (["generate", "--run", RUN, "--prompts-file", "prompts.jsonl", "--gen-length", "4", "-o", "{out}"],
                 "prompts.jsonl"),
    "eval tasks": (["eval", "tasks", "--run", RUN, "--tasks", "tasks.jsonl", "--limit", "1", "-o", "{out}"],
                   "tasks.jsonl"),
    "data stats": (["data", "stats", ART, "--plot", "{out}"], f"{ART}/manifest.json"),
    "plot": (["plot", RUN, "-o", "{out}"], f"{RUN}/metrics.jsonl"),
}  # fmt: skip
READS_THE_RUN = ("generate", "eval tasks", "plot")
FILES = [f"{RUN}/config.yaml", f"{RUN}/metrics.jsonl", f"{RUN}/checkpoints/latest", f"{CKPT}/__0_0.distcp",
         f"{CKPT}/.metadata", f"{CKPT}/trainer_state.json", f"{CKPT}/decode_profile.json", f"{ART}/manifest.json",
         f"{ART}/tokens.bin", "hf/config.json", "hf/model.safetensors", f"{RUN}/new.png", f"{ART}/new.png",
         "hf/new.png", "/proc/x.png"]  # fmt: skip


def _slug(command: str) -> str:
    return command.replace(" ", "-")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """data/prepared, a run trained 2 steps (runs/t), its Hugging Face export (hf/), the inputs of each command
    and a symbolic link to each (link-CMD); `in_world` adds the hard links (HARD_LINKS)."""
    root = tmp_path_factory.mktemp("outputs")
    write_corpus(root / "data" / "train.jsonl", num_records=40)
    write_yaml(root / "prepare.yaml", PREPARE)
    assert dllm(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 0
    trained_run(root)
    assert dllm(["convert", "--to-hf", str(root / "hf"), "--run", str(root / RUN)]) == 0
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (root / "tasks.jsonl").write_text(json.dumps({"prompt": "1 + 1 =", "answer": "2"}) + "\n")
    for command, (_, read) in COMMANDS.items():
        (root / f"link-{_slug(command)}").symlink_to(read)  # relative: a copy of the world links in itself
    return root


HARD_LINKS = {**{f"hard-{_slug(command)}": read for command, (_, read) in COMMANDS.items()},
              "hard-shard": f"{CKPT}/__0_0.distcp"}  # fmt: skip


@pytest.fixture
def in_world(world: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the world for one case (a case that failed leaves the next ones theirs), as working folder."""
    copy = shutil.copytree(world, tmp_path / "world", symlinks=True)
    for name, target in HARD_LINKS.items():
        os.link(copy / target, copy / name)
    monkeypatch.chdir(copy)
    return copy


def _args(command: str, out: str) -> list[str]:
    return [a.format(out=out) for a in COMMANDS[command][0]]


def _file_cases() -> list[tuple[str, str]]:
    cases = [(command, target) for command in COMMANDS for target in FILES]
    for command, (_, read) in COMMANDS.items():
        cases += [(command, read), (command, f"link-{_slug(command)}"), (command, f"hard-{_slug(command)}")]
    return cases + [(command, "hard-shard") for command in READS_THE_RUN]


@pytest.mark.parametrize(("command", "target"), _file_cases())
def test_an_output_file_never_replaces_what_dllm_reads(in_world: Path, command: str, target: str,
                                                       capsys: pytest.CaptureFixture[str]):  # fmt: skip
    _run(_args(command, target), in_world, capsys)


FOLDERS = [RUN, f"{RUN}/x", f"{RUN}/checkpoints", CKPT, ART, f"{ART}/x", "hf", "hf/x", "/proc/x"]
FOLDER_COMMANDS = {
    "convert --to-hf": ["convert", "--to-hf", "{out}", "--run", RUN, "--overwrite"],
    "convert --to": ["convert", "--from-hf", "hf", "--to", "{out}", "--overwrite"],
    "data prepare --output": ["data", "prepare", "--config", "prepare.yaml", "-q", "--output", "{out}", "--overwrite"],
    "init": ["init", "{out}", "--force"],
    "recipe copy": ["recipe", "copy", "mdlm-smoke", "{out}", "--force"],
}
OWN = {("data prepare --output", ART), ("convert --to-hf", "hf")}  # previous outputs of the command: replaced


@pytest.mark.parametrize("target", FOLDERS)
@pytest.mark.parametrize("command", list(FOLDER_COMMANDS))
def test_an_output_folder_never_lies_in_what_dllm_reads(in_world: Path, command: str, target: str,
                                                        capsys: pytest.CaptureFixture[str]):  # fmt: skip
    if (command, target) in OWN:
        pytest.skip("a previous output of this command: replaced with --overwrite (test below)")
    _run([a.format(out=target) for a in FOLDER_COMMANDS[command]], in_world, capsys)


@pytest.mark.parametrize("output_dir", [ART, RUN, "hf"])
def test_a_run_folder_is_never_made_inside_another_dllm_folder(in_world: Path, output_dir: str,
                                                               capsys: pytest.CaptureFixture[str]):  # fmt: skip
    _run(["launch", "--config", "train.yaml", "--set", f"run.output_dir={output_dir}", "--dry-run"], in_world, capsys)


# -- the legitimate uses ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_new_file_next_to_the_run_and_then_over_it(in_world: Path, command: str):
    out = in_world / "runs" / f"out-{_slug(command)}"
    for _ in range(2):  # a previous output of the same command is overwritten
        assert dllm(_args(command, str(out))) == 0
    assert out.stat().st_size > 0


def test_plot_into_the_working_folder(in_world: Path, monkeypatch: pytest.MonkeyPatch):
    (in_world / "plots").mkdir()
    monkeypatch.chdir(in_world / "plots")
    assert dllm(["plot", str(in_world / RUN)]) == 0
    assert (in_world / "plots" / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("command", ["data stats", "plot"])
def test_a_hard_link_to_a_file_the_command_does_not_read_is_replaced_not_written_through(in_world: Path,
                                                                                          command: str):  # fmt: skip
    shard = in_world / "shard"
    shard.write_bytes(b"weights")
    os.link(shard, in_world / "out.png")
    assert dllm(_args(command, "out.png")) == 0
    assert shard.read_bytes() == b"weights" and (in_world / "out.png").read_bytes()[1:4] == b"PNG"


def test_previous_outputs_of_folder_commands_are_replaced(in_world: Path):
    prepare = ["data", "prepare", "--config", "prepare.yaml", "-q", "--overwrite"]
    for _ in range(2):
        assert dllm([*prepare, "--output", "art"]) == 0
        assert dllm(["convert", "--from-hf", "hf", "--to", "m", "--overwrite"]) == 0
    before = _snapshot(in_world)
    assert dllm(prepare) == 0  # the config's own output, data/prepared, replaced by the same bytes
    assert _snapshot(in_world) == before
