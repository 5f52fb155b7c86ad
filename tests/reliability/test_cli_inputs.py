"""Reliability hardening, command-line values: flags of generate, chat, eval, init and serve that gave a
traceback or a wrong answer with exit 0.

- `eval likelihood --kind ar` printed an "exact NLL" for a model that is not causal;
- a prompt longer than the model's positions was decoded for minutes (the server refuses it);
- a seed beyond 64 bits, `--limit 0`, an output under /proc, `dllm init /proc/x` and a full disk while
  `init` writes were tracebacks; `serve --max-wait-ms nan` and `--temperature nan` were accepted.

Each ends as one line `dllm: error: ...`, exit code 2, before a model is loaded or a token decoded where
the value is known that early.
"""

from __future__ import annotations

import errno
import io
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dllm.cli.main import main as dllm
from dllm.config.model import ModelConfig
from dllm.config.profile import read_profile, write_profile
from dllm.models.hf_io import export_hf
from dllm.models.transformer import Transformer
from tests.helpers import write_corpus, write_yaml

MAX_LENGTH = 64
LONG = "x" * 100  # 100 byte tokens: with any generation past the 64 positions of the model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny imported Llama folder (an AR family, never trained here: causal), the same weights with the
    profile of an mdlm run (bidirectional), and a prepared artifact to score."""
    root = tmp_path_factory.mktemp("cli_inputs")
    cfg = ModelConfig(family="llama", preset="tiny", vocab_size=320, max_seq_len=MAX_LENGTH)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    hf = export_hf(model.state_dict(), cfg, root / "hf")
    assert dllm(["convert", "--from-hf", str(hf), "--to", str(root / "ar")]) == 0
    mdlm = shutil.copytree(root / "ar", root / "mdlm")
    profile = read_profile(mdlm)
    assert profile is not None
    write_profile(profile.model_copy(update={"objective": "mdlm"}), mdlm)
    write_corpus(root / "data" / "train.jsonl", num_records=40)
    write_yaml(root / "prepare.yaml", {"sources": [{"path": "data/train.jsonl"}], "output": "data/prepared",
                                       "seq_len": 32})  # fmt: skip
    assert dllm(["data", "prepare", "--config", str(root / "prepare.yaml"), "-q"]) == 0
    return {"ar": root / "ar", "mdlm": mdlm, "data": root / "data" / "prepared"}


def _one_error(args: list[str], capsys: pytest.CaptureFixture[str], *expected: str) -> str:
    capsys.readouterr()
    code = dllm(args)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    if args[0] == "chat":  # chat says what it loaded before it reads the first turn
        lines = lines[1:] if lines and lines[0].endswith("/reset, /exit") else lines
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("dllm: error: ") and "Traceback" not in err, lines
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any decoding fails the test: the refusals below come before the first forward."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("decoding started")

    monkeypatch.setattr("dllm.inference.engine.generate", refuse)


# -- eval likelihood --kind ar -----------------------------------------------------------------------------
def test_kind_ar_is_refused_for_a_model_that_is_not_causal(models: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]):  # fmt: skip
    args = ["eval", "likelihood", "--data", str(models["data"]), "--kind", "ar", "--limit", "2"]
    _one_error([*args, "--model", str(models["mdlm"])], capsys, "kind: ar", "trained with mdlm", "bidirectional")
    assert dllm([*args, "--model", str(models["ar"]), "--json"]) == 0  # an AR family folder: its exact NLL
    assert json.loads(capsys.readouterr().out)["kind"] == "ar"


# -- prompts longer than the model's positions ---------------------------------------------------------------
def _tasks_file(tmp_path: Path) -> str:
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": LONG, "answer": "x"}) + "\n")
    return str(tmp_path / "long.jsonl")


LONG_PROMPTS = {
    "generate": (["generate", "-p", "hi", "-p", LONG, "--gen-length", "8"], "prompt 2: 100 tokens"),
    "generate-ar": (["generate", "--ar", "-p", LONG, "--gen-length", "8"], "prompt 1: 100 tokens"),
    "generate-short-prompt": (["generate", "-p", "hi", "--gen-length", "63"], "prompt 1: 2 tokens plus gen_length 63"),
    "chat": (["chat", "--gen-length", "8"], "the conversation: "),
    "chat-ar": (["chat", "--ar", "--gen-length", "8"], "the conversation: "),
    "eval-tasks": (["eval", "tasks", "--tasks", "TASKS", "--gen-length", "8"], "--tasks long: example 1: 100 tokens"),
}  # fmt: skip


@pytest.mark.parametrize("path", list(LONG_PROMPTS))
def test_a_prompt_past_the_model_positions_is_refused_before_decoding(
    models: dict[str, Path], path: str, tmp_path: Path, no_decoding: None, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
):  # fmt: skip
    args, expected = LONG_PROMPTS[path]
    args = [a if a != "TASKS" else _tasks_file(tmp_path) for a in args]
    monkeypatch.setattr(sys, "stdin", io.StringIO(LONG + "\n"))  # chat reads its turn here
    line = _one_error([*args, "--model", str(models["ar"])], capsys, expected, f"the {MAX_LENGTH} positions")
    assert "lower --gen-length" in line


# -- seeds -----------------------------------------------------------------------------------------------------
SEEDS = [str(2**64), str(10**30), "-1"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("command", ["generate", "likelihood", "tasks"])
def test_a_seed_outside_64_bits_is_one_line(models: dict[str, Path], command: str, seed: str,
                                            capsys: pytest.CaptureFixture[str]):  # fmt: skip
    args = {
        "generate": ["generate", "-p", "hi", "--gen-length", "4"],
        "likelihood": ["eval", "likelihood", "--data", str(models["data"])],
        "tasks": ["eval", "tasks", "--tasks", "copy", "--limit", "1"],
    }[command]
    _one_error([*args, "--model", str(models["mdlm"]), "--seed", seed], capsys, "--seed")


@pytest.mark.parametrize("seed", ["-1", str(2**63), str(2**64)])
def test_a_seed_field_outside_64_bits_is_one_line(tmp_path: Path, seed: str, capsys: pytest.CaptureFixture[str]):
    from tests.helpers import tiny_train_values

    train = write_yaml(tmp_path / "train.yaml", tiny_train_values())
    args = ["config", "validate", "--config", str(train), "--no-data", "--set", f"training.seed={seed}"]
    _one_error(args, capsys, "--set training.seed")


@pytest.mark.parametrize("seed", [-1, 2**63, True])
def test_every_seed_field_takes_a_non_negative_64_bit_integer(seed: Any):
    from pydantic import ValidationError

    from dllm.config.rl import PromptsConfig
    from dllm.config.sampler import SamplerConfig
    from dllm.config.training import TrainingConfig

    training = {"steps": 1, "global_batch_size": 1, "micro_batch_size": 1}
    for section, required in ((SamplerConfig, {}), (PromptsConfig, {"task": "copy"}), (TrainingConfig, training)):
        with pytest.raises(ValidationError, match="seed"):
            section.model_validate({**required, "seed": seed})
        assert section.model_validate({**required, "seed": 2**63 - 1}).seed == 2**63 - 1


def test_a_sampler_seed_outside_64_bits_is_one_line(models: dict[str, Path], capsys: pytest.CaptureFixture[str]):
    _one_error(["chat", "--model", str(models["mdlm"]), "--set", "seed=-3"], capsys, "--set seed")


# -- outputs that cannot be written ------------------------------------------------------------------------------
@pytest.mark.parametrize("output", ["/proc/x.jsonl", "/proc/self/nope/x.jsonl"])
@pytest.mark.parametrize("command", ["generate", "tasks"])
def test_an_output_that_cannot_be_written_is_refused_before_decoding(
    models: dict[str, Path], command: str, output: str, no_decoding: None, capsys: pytest.CaptureFixture[str]
):  # fmt: skip
    args = {
        "generate": ["generate", "-p", "hi", "--gen-length", "4"],
        "tasks": ["eval", "tasks", "--tasks", "copy", "--limit", "1"],
    }[command]
    _one_error([*args, "--model", str(models["mdlm"]), "-o", output], capsys, "--output")


def test_a_failed_write_of_the_output_is_one_line_and_leaves_no_temp_file(
    models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):  # fmt: skip
    real_open = Path.open

    def full_disk(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if path.name.endswith(".jsonl.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_disk)
    out = tmp_path / "samples.jsonl"
    args = ["generate", "--model", str(models["mdlm"]), "-p", "hi", "--gen-length", "4", "-o", str(out)]
    _one_error(args, capsys, f"--output: cannot write {out}", "no space left on device")
    assert list(tmp_path.iterdir()) == []


# -- eval likelihood --limit --------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit", ["0", "-1"])
def test_likelihood_limit_below_one_is_one_line(models: dict[str, Path], limit: str,
                                                capsys: pytest.CaptureFixture[str]):  # fmt: skip
    args = ["eval", "likelihood", "--model", str(models["mdlm"]), "--data", str(models["data"]), "--limit", limit]
    _one_error(args, capsys, "--limit")


# -- init -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["/proc/x", "/proc/self/x/y"])
def test_init_where_nothing_can_be_written_is_one_line(target: str, capsys: pytest.CaptureFixture[str]):
    _one_error(["init", target, "--num-records", "10"], capsys, f"{target}: cannot write the run folder")


@pytest.mark.parametrize("num_records", [str(10**30), "2000000", "0"])
def test_init_refuses_a_record_count_it_cannot_hold(tmp_path: Path, num_records: str,
                                                    capsys: pytest.CaptureFixture[str]):  # fmt: skip
    _one_error(["init", str(tmp_path / "p"), "--num-records", num_records], capsys, "--num-records")
    assert not (tmp_path / "p").exists()


def test_init_on_a_full_disk_removes_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    real_write = Path.write_text

    def write_text(path: Path, *args: Any, **kwargs: Any) -> int:
        if path.name.startswith("train.yaml"):  # the fourth file: three are written by then
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    _one_error(["init", str(tmp_path / "a" / "p"), "--num-records", "10"], capsys, "no space left on device")
    assert list(tmp_path.iterdir()) == []  # the folders it created are gone too
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    _one_error(["init", str(tmp_path / "kept"), "--force", "--num-records", "10"], capsys, "no space left")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


# -- floats that must be finite ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("option", ["serve --max-wait-ms", "generate --temperature", "chat --temperature"])
def test_a_float_option_must_be_finite(models: dict[str, Path], option: str, value: str,
                                       capsys: pytest.CaptureFixture[str]):  # fmt: skip
    command, flag = option.split()
    _one_error([command, "--model", str(models["mdlm"]), flag, value], capsys, flag, "not a finite number")


# -- counts that would run for ever -------------------------------------------------------------------------------
HUGE = str(2**63 - 1)
HUGE_COUNTS = {
    "generate --steps": (["generate", "-p", "hi", "--gen-length", "4", "--steps", HUGE], "steps"),
    "likelihood --mc-samples": (["eval", "likelihood", "--data", "DATA", "--mc-samples", HUGE], "--mc-samples"),
    "tasks --limit": (["eval", "tasks", "--tasks", "copy", "--limit", HUGE], "--limit"),
}


@pytest.mark.parametrize("case", list(HUGE_COUNTS))
def test_a_count_beyond_reason_is_one_line(models: dict[str, Path], case: str, no_decoding: None,
                                           capsys: pytest.CaptureFixture[str]):  # fmt: skip
    args, expected = HUGE_COUNTS[case]
    args = [str(models["data"]) if a == "DATA" else a for a in args]
    _one_error([*args, "--model", str(models["mdlm"])], capsys, expected, "less than or equal")


# -- text that is not UTF-8 -------------------------------------------------------------------------------------
def _stdin_bytes(data: bytes, errors: str) -> io.TextIOWrapper:
    """stdin as Python opens it: UTF-8 and strict (UTF-8 locale) or surrogateescape (C locale)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors=errors)


@pytest.mark.parametrize("source", ["argument", "prompts-file"])
def test_a_prompt_that_is_not_utf8_decodes_as_replacement_characters(
    models: dict[str, Path], source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):  # fmt: skip
    """An argument's undecodable bytes reach Python as lone surrogates, as does a JSON escape "\\udcff"."""
    prompts = ["-p", "caf\udcff"]
    if source == "prompts-file":
        (tmp_path / "p.jsonl").write_text('{"prompt": "caf\\udcff"}\n')
        prompts = ["--prompts-file", str(tmp_path / "p.jsonl")]
    capsys.readouterr()
    code = dllm(["generate", "--model", str(models["ar"]), *prompts, "--gen-length", "4", "--stop", "\udcff", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert json.loads(captured.out)["prompt"] == "caf\ufffd"


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_chat_reads_stdin_that_is_not_utf8(models: dict[str, Path], errors: str, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    monkeypatch.setattr(sys, "stdin", _stdin_bytes(b"caf\xff\xfe\r\n/exit\n", errors))
    capsys.readouterr()
    code = dllm(["chat", "--model", str(models["ar"]), "--gen-length", "4", "--system", "be \udcffbrief"])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err and "forwards for 4 tokens" in err, err[-2000:]  # a causal LM: AR


def test_argv_bytes_that_are_not_utf8_print_as_replacement_characters(models: dict[str, Path]):
    """The real process: argv bytes decoded by Python, the prompt printed back on a UTF-8 stdout."""
    import os
    import subprocess

    args = [sys.executable, "-m", "dllm.cli.main", "generate", "--model", str(models["ar"]), "-p", b"caf\xff",
            "--gen-length", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(args, capture_output=True, env=env, timeout=300)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.startswith("caf\ufffd".encode())


# -- eval harness: lm_eval's arguments ---------------------------------------------------------------------------
HARNESS_ARGS = {
    "empty names": (["--model_args", "garbage=,,="], "model_args: a value without a name"),
    "unknown arg": (["--model_args", "bogus=1"], "model_args: unknown argument 'bogus'"),
    "bad json": (["--model_args", "{bad"], "lm_eval refuses its arguments: Invalid JSON"),
    "usage": (["--model_args", "model=M", "--bogus", "1"], "lm_eval refuses its arguments: lm-eval: error: unrec"),
    "unknown task": (["--model_args", "model=M"], "lm_eval refuses its arguments: Tasks not found: nope"),
}


@pytest.mark.parametrize("case", list(HARNESS_ARGS))
def test_harness_arguments_lm_eval_refuses_are_one_line(models: dict[str, Path], case: str,
                                                         capsys: pytest.CaptureFixture[str]):  # fmt: skip
    """Bad --model_args are refused before lm_eval loads its tasks; lm_eval's own refusals (usage, JSON, an
    unknown task) were tracebacks or usage screens."""
    pytest.importorskip("lm_eval")
    args, expected = HARNESS_ARGS[case]
    args = [f"model={models['mdlm']}" if a == "model=M" else a for a in args]
    _one_error(["eval", "harness", "--model", "dllm", *args, "--tasks", "nope"], capsys, expected)


def test_every_help_text_names_the_right_extra(capsys: pytest.CaptureFixture[str]):
    """Help texts are plain text: rich's help read `pip install 'dllm[plot]'` as markup and printed
    `pip install 'dllm'` (and `org/name[@revision]` as `org/name`)."""
    helps = {}
    for args in (["--help"], ["plot", "--help"], ["eval", "--help"], ["generate", "--help"], ["convert", "--help"]):
        assert dllm(args) == 0
        helps[args[0]] = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert all("pip install 'dllm'" not in text for text in helps.values())
    assert "pip install 'dllm[plot]'" in helps["--help"] and "pip install 'dllm[plot]'" in helps["plot"]
    assert "pip install 'dllm[eval]'" in helps["eval"] and "pip install 'dllm[bench]'" in helps["eval"]
    assert "org/name[@revision]" in helps["generate"] and "org/name[@revision]" in helps["convert"]
