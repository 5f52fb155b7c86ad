"""`dllm generate --ar` and `--draft`: causal targets (an imported AR folder, an `ar` run), the counters
printed, and bad input answered with one line and exit code 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dllm.inference.assembly as assembly
from dllm.cli.main import main
from dllm.config.loading import validate_config
from dllm.config.profile import DecodeProfile, write_profile
from dllm.config.spec import RunSpec
from dllm.recipes import BYTE_VOCAB_SIZE, write_ar_model
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import tiny_train_values

PROMPTS = ["-p", "1 + 2 =", "-p", "a much longer prompt"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An imported AR folder (no profile), the same with a diffusion profile, and with a causal one."""
    root = tmp_path_factory.mktemp("causal")
    ar = write_ar_model(root / "ar")
    out = {"ar": ar}
    ids = {"mask_id": 259, "pad_id": 256, "eos_id": 257, "num_tokens": 260, "max_length": 128}
    causal = DecodeProfile(objective="ar", attention="causal", shift=True, **ids)
    for name, profile in (("mdlm", DecodeProfile(objective="mdlm", **ids)), ("causal", causal)):
        shutil.copytree(ar, root / name)
        write_profile(profile, root / name)
        out[name] = root / name
    return out


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


class ReplayFirst:
    """A test drafter: proposes seeded random tokens (vocabulary of the byte-tokenizer models)."""

    target_layer_ids = (0,)

    def __init__(self, block_size: int) -> None:
        self.block_size, self.gen = block_size, torch.Generator().manual_seed(0)

    def start(self, batch_size: int, max_length: int) -> None:
        return None

    def extend(self, state, features_BNF, positions_BN) -> None:
        assert features_BNF.shape[-1] == 64  # one captured block of the 64-wide target

    def propose(self, state, anchor_B, anchor_pos_B) -> torch.Tensor:
        return torch.randn(anchor_B.shape[0], self.block_size - 1, BYTE_VOCAB_SIZE, generator=self.gen)


def test_ar_and_speculative_decoding_of_an_imported_folder(folders, capsys, monkeypatch, tmp_path):
    code, out, err = run(["generate", "--model", str(folders["ar"]), "--ar", *PROMPTS, "--gen-length", "12",
                          "--json", "--set", "stop_at_eos=false"], capsys)  # fmt: skip
    assert code == 0, err
    ar = [json.loads(line) for line in out.splitlines()]
    assert len(ar) == 2 and all(r["tokens_committed"] == 24 and r["tau"] == 1.0 for r in ar)
    assert "ar (KV cache)" in err and "forwards for 24 tokens" in err  # counters that mean something for AR
    assert "tau" not in err and "acceptance" not in err and "NFE" not in err
    monkeypatch.setattr(assembly, "load_drafter", lambda path, target: ReplayFirst(4))
    (tmp_path / "drafter").mkdir()
    code, out, err = run(["generate", "--model", str(folders["causal"]), "--draft", str(tmp_path / "drafter"),
                          "--draft-block-size", "4", *PROMPTS, "--gen-length", "12", "--json",
                          "--set", "stop_at_eos=false"], capsys)  # fmt: skip
    assert code == 0, err
    spec = [json.loads(line) for line in out.splitlines()]
    assert [r["completion"] for r in spec] == [r["completion"] for r in ar]  # greedy: the target's own output
    assert all(r["drafted"] > 0 for r in spec) and "speculative (block 4)" in err and "tau" in err
    assert "acceptance" in err and "target forwards/token" in err


def test_the_text_output_sets_the_completion_apart(folders, capsys):
    """Text output: the prompt, then the completion on its own line after a marker (a blank line between
    exchanges); --json keeps prompt and completion apart as they are."""
    args = ["generate", "--model", str(folders["ar"]), "--ar", "--chat", *PROMPTS, "--gen-length", "6",
            "--set", "stop_at_eos=false"]  # fmt: skip
    code, text, err = run(args, capsys)
    assert code == 0, err
    code, out, _ = run([*args, "--json"], capsys)
    records = [json.loads(line) for line in out.splitlines()]
    expected = [records[0]["prompt"], ">> " + records[0]["completion"].lstrip(), "",
                records[1]["prompt"], ">> " + records[1]["completion"].lstrip()]  # fmt: skip
    assert text.split("\n")[:-1] == expected and records[0]["prompt"] == "1 + 2 ="


def test_a_prompts_file_shows_its_progress_unless_quiet(folders, tmp_path, capsys):
    """Stderr is no terminal here: the progress display prints a line per batch, with its ETA; -q none."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i} + 1 ="}) + "\n" for i in range(3)))
    args = ["generate", "--model", str(folders["ar"]), "--ar", "--prompts-file", str(prompts), "--batch-size", "1",
            "--gen-length", "4", "--json"]  # fmt: skip
    code, out, err = run(args, capsys)
    assert code == 0 and len(out.splitlines()) == 3, err
    lines = [line for line in err.splitlines() if " prompts  " in line]
    assert [line.split()[0] for line in lines] == ["1/3", "2/3", "3/3"] and lines[-1].endswith("eta 0:00:00")
    code, _, err = run([*args, "-q"], capsys)
    assert code == 0 and " prompts  " not in err


def test_the_count_bar_prints_plain_lines_off_a_terminal(capsys):
    from dllm.training.progress import CountBar

    with CountBar("weights", 0, every_s=3600.0) as bar:  # the total learnt from the loader's first report
        for done in range(1, 5):
            bar.count(done, 4)
    assert capsys.readouterr().err == ""  # done within the hour: no line
    with CountBar("weights", 0, every_s=0.0) as bar:
        for done in range(1, 5):
            bar.count(done, 4)
    assert capsys.readouterr().err.splitlines()[-1] == "4/4 weights  eta 0:00:00"
    with CountBar("weights", 0) as bar:  # a model's parameters, in millions
        bar.count(30_000_000, 135_000_000)
    assert capsys.readouterr().err.startswith("30.0M/135.0M weights  eta ")
    with CountBar("examples", 2) as bar:
        bar.advance(1, "x")
    assert capsys.readouterr().err.startswith("1/2 examples  x  eta ")
    with CountBar("examples", 2, enabled=False) as bar:
        bar.advance(2)
    assert capsys.readouterr().err == ""


def test_help_explains_the_counters(capsys):
    for command in ("generate", "chat"):
        code, out, _ = run([command, "--help"], capsys)
        text = " ".join(out.split())
        assert code == 0 and "NFE, the model's forward passes" in text and "tau is the tokens a verify" in text


def test_an_ar_run_decodes_with_ar_and_the_diffusion_sampler_refuses_it(tmp_path, capsys):
    from tests.helpers import PREPARE, write_corpus, write_yaml

    write_corpus(tmp_path / "data" / "train.jsonl", num_records=50)
    write_yaml(tmp_path / "prepare.yaml", PREPARE)
    from dllm.config.loading import load_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare

    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    values = tiny_train_values(run={"name": "ar", "output_dir": str(tmp_path / "runs")}, objective={"name": "ar"},
                               training={"steps": 2})  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    code, out, err = run(["generate", "--run", str(run_dir), "--ar", "-p", "3 + 4 =", "--gen-length", "6",
                          "--temperature", "0.8", "--json"], capsys)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["nfe"] >= 1
    # no flag: the decode profile says causal, so generate and eval tasks decode causally by themselves
    args = ["-p", "3 + 4 =", "--gen-length", "6", "--json"]
    code, auto, err = run(["generate", "--run", str(run_dir), *args], capsys)
    assert code == 0 and "ar (KV cache)" in err, err
    assert json.loads(auto)["completion"] == json.loads(run(["generate", "--run", str(run_dir), "--ar", *args],
                                                            capsys)[1])["completion"]  # fmt: skip
    code, out, err = run(["eval", "tasks", "--run", str(run_dir), "--tasks", "copy", "--limit", "2", "--json"], capsys)
    assert code == 0 and (json.loads(out)["policy"], json.loads(out)["cache"]) == ("ar", "kv"), err
    code, _, err = run(["generate", "--run", str(run_dir), "--set", "generation=canvas", "-p", "x"], capsys)
    assert code == 2 and "sampler.generation: canvas cannot decode this model: it is autoregressive" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{mdlm}", "--ar"], "--ar: {mdlm} is not a causal model (trained with mdlm, attention bidirect"),
        (["--model", "{mdlm}", "--draft", "{tmp}"], "--draft: {mdlm} is not a causal model"),
        (["--model", "{ar}", "--draft", "{tmp}"], "--draft: {tmp}/config.json names no drafter family"),
        (["--model", "{ar}", "--draft", "{ar}/nope"], "is not a drafter folder (no config.json)"),
        (["--model", "{ar}", "--ar", "--draft-block-size", "4"], "--draft-block-size applies to speculative"),
        (["--model", "{causal}", "--steps", "4"], "sampler.steps: no effect on causal decoding"),
    ],
)
def test_bad_input_is_one_line_exit_2(folders, tmp_path, capsys, args: list[str], message: str):
    (tmp_path / "config.json").write_text("{}")
    names = {k: str(v) for k, v in folders.items()} | {"tmp": str(tmp_path)}
    code, out, err = run(["generate", *[a.format(**names) for a in args], "-p", "x"], capsys)
    assert code == 2 and err.startswith("dllm: error: ") and err.count("\n") == 1, err
    assert message.format(**names) in err and out == ""


def test_block_size_mismatch_is_refused(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(assembly, "load_drafter", lambda path, target: ReplayFirst(4))
    code, _, err = run(["generate", "--model", str(folders["ar"]), "--draft", str(tmp_path), "--draft-block-size",
                        "8", "-p", "x"], capsys)  # fmt: skip
    assert code == 2 and "trained with blocks of 4, not 8" in err and err.count("\n") == 1


@pytest.mark.parametrize("field", ["policy=threshold", "cache=dual", "steps=99"])
def test_a_diffusion_field_with_ar_is_one_line(folders, field, capsys):
    """`generate --ar --set policy=threshold` used to run without a word: a field causal decoding does not read is
    refused before decoding, one line and exit 2."""
    code, out, err = run(["generate", "--model", str(folders["ar"]), "--ar", *PROMPTS, "--set", field], capsys)
    assert code == 2 and out == ""
    name = field.split("=")[0]
    assert (
        err.strip().startswith(f"dllm: error: sampler.{name}: no effect on causal decoding") and "\n" not in err.strip()
    )
