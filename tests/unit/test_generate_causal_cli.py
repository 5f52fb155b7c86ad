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
    assert "ar (KV cache)" in err and "target forwards/token" in err
    monkeypatch.setattr(assembly, "load_drafter", lambda path, target: ReplayFirst(4))
    (tmp_path / "drafter").mkdir()
    code, out, err = run(["generate", "--model", str(folders["causal"]), "--draft", str(tmp_path / "drafter"),
                          "--draft-block-size", "4", *PROMPTS, "--gen-length", "12", "--json",
                          "--set", "stop_at_eos=false"], capsys)  # fmt: skip
    assert code == 0, err
    spec = [json.loads(line) for line in out.splitlines()]
    assert [r["completion"] for r in spec] == [r["completion"] for r in ar]  # greedy: the target's own output
    assert all(r["drafted"] > 0 for r in spec) and "speculative (block 4)" in err and "tau" in err


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
    code, _, err = run(["generate", "--run", str(run_dir), "-p", "x"], capsys)
    assert code == 2 and "autoregressive (trained with ar" in err and "--ar" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "{mdlm}", "--ar"], "--ar: {mdlm} is not a causal model (trained with mdlm, attention bidirect"),
        (["--model", "{mdlm}", "--draft", "{tmp}"], "--draft: {mdlm} is not a causal model"),
        (["--model", "{ar}", "--draft", "{tmp}"], "--draft: {tmp}/config.json names no drafter family"),
        (["--model", "{ar}", "--draft", "{ar}/nope"], "is not a drafter folder (no config.json)"),
        (["--model", "{ar}", "--ar", "--draft-block-size", "4"], "--draft-block-size applies to speculative"),
        (["--model", "{causal}"], "the diffusion sampler cannot decode it: use `dllm generate --ar`"),
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
