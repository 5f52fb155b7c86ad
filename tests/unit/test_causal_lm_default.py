"""A causal LM folder never trained here (an imported llama) decodes causally when no loop is asked for, as an ar
run does; `generation: canvas`, or a field only canvas decoding reads, samples it as a diffusion model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.recipes import write_ar_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ar_model(tmp_path_factory.mktemp("causal-default") / "llama")


def _generate(llama: Path, capsys, *extra: str) -> tuple[dict, str]:
    args = ["generate", "--model", str(llama), "-p", "1 + 2 =", "--max-new-tokens", "6", "--json", *extra]
    assert main([*args, "--set", "stop_at_eos=false"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out.splitlines()[0]), captured.err


def test_a_causal_lm_folder_decodes_causally_without_ar(llama: Path, capsys):
    unasked, err = _generate(llama, capsys)
    asked, _ = _generate(llama, capsys, "--ar")
    assert unasked["completion"] == asked["completion"]  # the same greedy AR decoding
    assert unasked["nfe"] == asked["nfe"] == 6  # one forward a token: no canvas steps
    assert "ar (KV cache)" in err


def test_canvas_decoding_stays_an_explicit_choice(llama: Path, capsys):
    canvas, err = _generate(llama, capsys, "--set", "generation=canvas", "--set", "steps=3")
    assert canvas["nfe"] == 3 and "ar (KV cache)" not in err


def test_a_canvas_option_asks_for_a_diffusion_sample(llama: Path, capsys):
    """--steps (a field only canvas decoding reads) samples the folder as a diffusion model, as
    `generation=canvas` does; the summary line says so."""
    canvas, err = _generate(llama, capsys, "--steps", "3", "--gen-length", "6")
    assert canvas["nfe"] == 3 and "ar (KV cache)" not in err and "low_confidence" in err
