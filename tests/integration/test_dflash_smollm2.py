"""The dflash-smollm2 recipe end to end on the truncated SmolLM2 (its first blocks, real weights and tokenizer;
tests/real_model.py): the recipe's own commands, each through the CLI, on 8 of its training prompts and a
few training steps: the target answers its prompts (`generate --ar --chat`), `data prepare` reads those
answers as chat turns, `launch` builds the feature cache and trains, `convert --to-hf` exports the drafter,
and `generate --draft` on held-out prompts equals `generate --ar` token for token at the drafter's block
and a shorter verify block. Then bench/real_model.py's DFlash section on it, and a drafter handed to
another target refused in one line. (The trained drafter's tau and speed are the bench's, on the full
model: docs/real-model.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.cli.main import main
from tests import real_model as rm

pytestmark = pytest.mark.skipif(rm.missing() is not None, reason=str(rm.missing()))

NEW = 24  # answer tokens in the training data (the recipe: 128)


def cli(args: list[str], capsys) -> str:
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The recipe folder after its steps up to an exported drafter (module-scoped: run once)."""
    root = tmp_path_factory.mktemp("dflash-smollm2")
    (root / "smollm2").symlink_to(rm.converted("trunc"), target_is_directory=True)  # the recipe's ../smollm2
    folder = root / "recipe"
    mp = pytest.MonkeyPatch()
    try:
        mp.chdir(root)
        assert main(["recipe", "copy", "dflash-smollm2", str(folder)]) == 0
        mp.chdir(folder)
        prompts = (folder / "data" / "prompts.jsonl").read_text().splitlines()
        (folder / "data" / "prompts.jsonl").write_text("\n".join(prompts[:8]) + "\n")
        answer = ["generate", "--model", "../smollm2", "--ar", "--chat", "--prompts-file", "data/prompts.jsonl",
                  "--max-new-tokens", str(NEW), "--batch-size", "8", "--output", "data/train.jsonl"]  # fmt: skip
        assert main(answer) == 0
        assert main(["data", "prepare", "--config", "prepare.yaml"]) == 0
        sets = ["objective.target_layer_ids=[0,2,3]", "training.steps=3", "training.global_batch_size=4",
                "training.micro_batch_size=4", "checkpointing.every_steps=3", "scheduler.warmup_steps=1"]  # fmt: skip
        assert main(["launch", "--config", "train.yaml", *[a for s in sets for a in ("--set", s)]]) == 0
        assert main(["convert", "--to-hf", "drafter", "--run", "runs/dflash-smollm2"]) == 0
    finally:
        mp.undo()
    return folder


def test_the_training_text_is_the_targets_own_answers(recipe):
    """Each record holds the target's answer as chat turns; prepare supervises the answer and its end of turn."""
    from dllm.data.artifact import open_artifact
    from dllm.data.report import sample_tokens

    rows = [json.loads(line) for line in (recipe / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["chat"]["completion"][0]["content"] == r["completion"] for r in rows)
    loaded = rm.load_ours("trunc")
    tok = loaded.tokenizer
    art = open_artifact(recipe / "data" / "prepared")
    for i, r in enumerate(rows):
        tokens, mask = (a.tolist() for a in sample_tokens(art, i))
        answer = [t for t, m in zip(tokens, mask, strict=True) if m]
        prompt = tok.apply_chat_template(r["chat"]["prompt"], add_generation_prompt=True).ids
        assert tokens[: len(prompt)] == prompt and not any(mask[: len(prompt)])
        assert tok.decode(answer).startswith(r["completion"]) and loaded.profile.eos_id in answer
    assert (recipe / "data" / "smollm2-features" / "manifest.json").is_file()  # built once, at launch


def test_speculative_equals_ar_on_held_out_prompts(recipe, capsys, monkeypatch):
    monkeypatch.chdir(recipe)
    held = (recipe / "data" / "held-out.jsonl").read_text().splitlines()[:4]
    (recipe / "held4.jsonl").write_text("\n".join(held) + "\n")
    base = ["generate", "--model", "../smollm2", "--chat", "--prompts-file", "held4.jsonl", "--max-new-tokens", "16",
            "--json", "--batch-size", "4"]  # fmt: skip
    ar = [json.loads(x)["completion"] for x in cli([*base, "--ar"], capsys).splitlines()]
    for block in ("16", "8"):
        spec = cli([*base, "--draft", "drafter", "--draft-block-size", block], capsys).splitlines()
        assert [json.loads(x)["completion"] for x in spec] == ar
        assert json.loads(spec[0])["drafted"] == json.loads(spec[0])["rounds"] * (int(block) - 1)


def test_the_bench_measures_the_drafter(recipe, capsys):
    from bench.real_model import main as bench

    args = ["--model", "trunc", "--skip-ar", "--skip-parity", "--skip-profile", "--drafter", str(recipe / "drafter"),
            "--dflash-prompts", "3", "--dflash-new", "8", "--draft-blocks", "4", "16"]  # fmt: skip
    result = bench(args)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    d = result["dflash"]
    assert d["trained_block"] == 16 and d["prompts"] == 3 and d["split"] == "held_out"
    for batch in ("batch_1", "batch_8"):
        assert d[batch]["ar_tok_s"] > 0
        for block in ("b4", "b16"):
            row = d[batch][block]
            assert row["rows_equal_ar"] == 3 and row["tokens_equal_ar"] and 1 <= row["tau"] <= int(block[1:])


def test_a_drafter_of_another_target_is_refused(recipe, capfd):
    """The full model is another target (the drafter records its target's weights): one line, exit 2."""
    code = main(["generate", "--model", str(rm.converted("full")), "--draft", str(recipe / "drafter"), "-p", "Hi"])
    err = capfd.readouterr().err
    assert code == 2 and "target" in err and err.strip().count("\n") == 0, err
