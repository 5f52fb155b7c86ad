"""rl.prompts.path as a prepared prompts artifact (`dllm data prepare`, rl/prompts.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.cli import main as cli_main
from dllm.config.data import TokenizerConfig
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.rl import PromptsConfig
from dllm.data.prepare import prepare
from dllm.errors import ConfigError
from dllm.rl.prompts import load_prompts
from dllm.tokenization import build_tokenizer
from dllm.training import grpo as grpo_mod
from tests.helpers import write_yaml
from tests.unit.test_rl_loop import _rl_yaml

RECORDS = [{"prompt": f"{a} + {b} =", "completion": f" {a + b}"} for a, b in [(1, 2), (12, 7), (30, 45), (9, 9)]]


def _prepare(folder: Path, supervision: str = "completion_only", rows: list = RECORDS, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    source = {"path": "train.jsonl", "format": "prompt_completion", "supervision": supervision}
    cfg = {"tokenizer": {"kind": "byte"}, "sources": [source], "output": "prepared", "seq_len": 16,
           "layout": "indexed", "pad_to_multiple": 16, **extra}  # fmt: skip
    prepare(load_config(PrepareSpec, write_yaml(folder / "prepare.yaml", cfg)), folder)
    return folder / "prepared"


def test_a_prepared_artifact_gives_the_prompts_and_answers_of_its_records(tmp_path: Path):
    tok = build_tokenizer(TokenizerConfig(kind="byte"))
    art = _prepare(tmp_path)
    task = load_prompts(PromptsConfig(path=art, num_prompts=3), tok)
    assert [(e.prompt, e.answer) for e in task.examples] == [(r["prompt"], r["completion"]) for r in RECORDS[:3]]
    assert task.examples[1].correct(" 19") and not task.examples[1].correct("20")
    again = _prepare(tmp_path / "again")  # deterministic: the same bytes, the same fingerprint
    assert (
        json.loads((art / "manifest.json").read_text())["fingerprint"]
        == json.loads((again / "manifest.json").read_text())["fingerprint"]
    )


def test_an_artifact_without_answers_or_prompts_is_refused(tmp_path: Path):
    tok = build_tokenizer(TokenizerConfig(kind="byte"))
    full = _prepare(tmp_path / "full", supervision="full")  # every token supervised: no prompt/answer split
    with pytest.raises(ConfigError, match=r"rl.prompts.path: .*sample 0: no prompt"):
        load_prompts(PromptsConfig(path=full), tok)
    cut = _prepare(tmp_path / "cut", rows=[*RECORDS, {"prompt": "1 + 1 =" * 3, "completion": " 2"}],
                   overflow="truncate_right")  # fmt: skip
    with pytest.raises(ConfigError, match="1 records were truncated .*use overflow: reject"):
        load_prompts(PromptsConfig(path=cut), tok)
    packed = _prepare(tmp_path / "packed", layout="packed")
    with pytest.raises(ConfigError, match="layout packed mixes records"):
        load_prompts(PromptsConfig(path=packed), tok)


def test_a_prompts_artifact_without_answers_is_one_line_through_launch_before_any_generation(
    tmp_path: Path, capsys, monkeypatch
):
    folder = tmp_path / "run"
    _prepare(folder, rows=[*RECORDS, {"prompt": "1 + 1 =", "completion": ""}])
    monkeypatch.setattr(grpo_mod, "rollout", lambda *a, **k: pytest.fail("generated before the error"))
    train_yaml = _rl_yaml(folder, rewards=[{"name": "exact_answer"}], prompts={"path": "prepared"})
    assert cli_main.main(["launch", "--config", str(train_yaml)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: rl.prompts.path: ") and "sample 4: no answer" in err, err
    assert err.count("\n") == 1 and not (folder / "runs").exists()


def test_the_grpo_smoke_recipe_prepares_a_prompts_artifact_its_rl_run_reads(tmp_path: Path):
    from dllm.recipes import copy_recipe

    copy_recipe("grpo-smoke", tmp_path)
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    task = load_prompts(PromptsConfig(path=tmp_path / "data" / "prepared", num_prompts=10**6),
                        build_tokenizer(TokenizerConfig(kind="byte")))  # fmt: skip
    assert [(e.prompt, e.answer) for e in task.examples] == [(r["prompt"], r["completion"]) for r in records]
