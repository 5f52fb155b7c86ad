"""BERT-chat end to end on a CPU: the bert-chat-smoke recipe (an encoder-only ModernBERT from the Hugging Face
folder `recipe copy` writes, masked-diffusion SFT on chat messages, assistant-only loss) trains briefly, and
`dllm chat` answers through the chat template, from the run and from its exported folder."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from dllm.cli.main import main as dllm
from dllm.recipes import copy_recipe

pytest.importorskip("safetensors")

QUESTION = "What is 12 + 7?"
STEPS = 20


def _train(folder: Path, steps: int | None) -> tuple[Path, list[float]]:
    """(run folder, losses) of the recipe copied into `folder` and trained (for `steps`, else its own)."""
    from dllm.config.loading import load_config
    from dllm.config.prepare import PrepareSpec
    from dllm.config.spec import RunSpec
    from dllm.data.prepare import prepare
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    copy_recipe("bert-chat-smoke", folder, force=True)
    train_yaml = folder / "train.yaml"
    text = train_yaml.read_text()
    assert "  steps: 150\n" in text
    if steps is not None:
        train_yaml.write_text(text.replace("  steps: 150\n", f"  steps: {steps}\n"))
    prepare(load_config(PrepareSpec, folder / "prepare.yaml"), folder)
    spec, _ = resolve_run_spec(load_config(RunSpec, train_yaml))
    run_dir = prepare_run_dir(spec)
    return run_dir, train_from_run_dir(run_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The recipe trained for a few steps, with its own settings otherwise."""
    return _train(tmp_path_factory.mktemp("bert-chat-smoke"), STEPS)


def _chat(args: list[str], lines: str, monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[list[str], list]:
    """`dllm chat ARGS` fed `lines` on stdin; (replies printed, (prompt ids, result) of every sampler call)."""
    import dllm.inference.engine as generate_module

    calls, real = [], generate_module.generate

    def spy(model, prompts, cfg, special, **kw):
        result = real(model, prompts, cfg, special, **kw)
        calls.append((prompts[0], result))
        return result

    monkeypatch.setattr(generate_module, "generate", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert dllm(["chat", *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines(), calls


def test_bert_chat_trains_and_answers_under_the_assistant_turn(trained, tmp_path: Path, monkeypatch, capsys):
    from dllm.checkpoint.loading import load_for_inference

    run_dir, losses = trained
    assert len(losses) == STEPS and sum(losses[-5:]) < 0.8 * sum(losses[:5]), losses
    loaded = load_for_inference(run=run_dir)
    assert loaded.model_cfg.family == "modernbert" and loaded.model_cfg.head == "mlm"
    profile = loaded.profile
    assert (profile.objective, profile.attention, profile.shift) == ("mdlm", "bidirectional", False)

    replies, calls = _chat(["--run", str(run_dir), "--gen-length", "16"], f"{QUESTION}\n/reset\n", monkeypatch, capsys)
    tok = loaded.tokenizer
    ((prompt, result),) = calls
    # the question rendered by the chat template, ending in the assistant's header: the reply is the next turn
    assert prompt == tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True).ids
    assert tok.decode(prompt).endswith(f"User: {QUESTION}\nAssistant: ")
    start = result.gen_start_B[0]
    assert result.canvas_BL[0, :start].tolist()[-len(prompt) :] == prompt  # the prompt is never edited
    generated = result.canvas_BL[0, start:].tolist()
    assert tok.mask_id not in generated and 1 <= result.nfe <= 16  # stops early once the reply has its EOS
    reply_ids = result.sequences[0]
    assert reply_ids == generated[: len(reply_ids)] and tok.eos_id not in reply_ids
    assert replies == [tok.decode(reply_ids).strip()]

    # the exported folder chats the same (greedy) way, its profile travelling with it
    assert dllm(["convert", "--to-hf", str(tmp_path / "bert-chat"), "--run", str(run_dir)]) == 0
    capsys.readouterr()
    again, calls = _chat(["--model", str(tmp_path / "bert-chat"), "--gen-length", "16"], f"{QUESTION}\n", monkeypatch,
                         capsys)  # fmt: skip
    assert again == replies and calls[0][0] == prompt


def test_bert_chat_from_a_hub_id_offline(trained, tmp_path: Path, monkeypatch, capsys):
    """The exported chatbot published on the hub and cached (huggingface_hub's on-disk layout), read offline:
    `dllm chat --model org/name@rev` answers as the folder does."""
    import shutil

    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants  # read by snapshot_download at call time

    run_dir, _ = trained
    assert dllm(["convert", "--to-hf", str(tmp_path / "bert-chat"), "--run", str(run_dir)]) == 0
    sha = "89abcdef" * 5
    repo = tmp_path / "hub" / "models--tiny-org--bert-chat"
    shutil.copytree(tmp_path / "bert-chat", repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    capsys.readouterr()
    args = ["--gen-length", "16"]
    want, _ = _chat(["--model", str(tmp_path / "bert-chat"), *args], f"{QUESTION}\n", monkeypatch, capsys)
    got, _ = _chat(["--model", f"tiny-org/bert-chat@{sha}", *args], f"{QUESTION}\n", monkeypatch, capsys)
    assert got == want


@pytest.mark.slow
def test_bert_chat_smoke_answers_on_format(tmp_path: Path, monkeypatch, capsys):
    """With the recipe's own settings the chatbot answers a sum question in the trained form `a + b = c.`
    (questions of the sums it trained on: the form is checked, not held-out arithmetic)."""
    import re

    run_dir, losses = _train(tmp_path / "bert-chat-smoke", None)
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10])
    questions = ["What is 4 + 5?", "What is 2 + 2?", "What is 9 + 9?"]
    replies, _ = _chat(["--run", str(run_dir)], "\n/reset\n".join(questions) + "\n", monkeypatch, capsys)
    assert len(replies) == 3 and all(re.fullmatch(r"\d+ \+ \d+ = \d+\.", r) for r in replies), replies
