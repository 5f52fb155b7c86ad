"""`dllm generate` on an edit_flow run (tau-leaping through the ordinary sampler entry point), and the
bad combinations: an edit-flow run with a mask policy / canvas sampler, a mask run with tau-leaping."""

from __future__ import annotations

import io
import json

import pytest

from dllm.cli.main import main
from dllm.config.loading import load_config, validate_config
from dllm.config.prepare import PrepareSpec
from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.config.spec import RunSpec
from dllm.data.prepare import prepare
from dllm.errors import ConfigError
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import PREPARE, tiny_train_values, write_corpus, write_yaml

IDS = {"mask_id": 259, "pad_id": 256, "eos_id": 257, "num_tokens": 260, "max_length": 128}


def test_resolve_sampler_keeps_edit_flow_and_mask_runs_apart():
    edit = DecodeProfile(objective="edit_flow", generation="edit_flow", **IDS)
    mask = DecodeProfile(objective="mdlm", **IDS)
    assert resolve_sampler(SamplerConfig(), edit).generation == "edit_flow"
    again = resolve_sampler(resolve_sampler(SamplerConfig(steps=4), edit), edit)  # eval re-resolves
    assert again.generation == "edit_flow" and again.total_steps == 4
    assert resolve_sampler(SamplerConfig(), mask).generation == "canvas"
    with pytest.raises(ConfigError, match="sampler.policy: threshold commits mask positions, but this run was"):
        resolve_sampler(SamplerConfig(policy="threshold"), edit)
    with pytest.raises(ConfigError, match="sampler.generation: canvas commits mask positions"):
        resolve_sampler(SamplerConfig(generation="canvas"), edit)
    with pytest.raises(ConfigError, match="sampler.generation: edit_flow .* needs an Edit Flows model; .* mdlm"):
        resolve_sampler(SamplerConfig(generation="edit_flow"), mask)
    with pytest.raises(ConfigError, match="use cache none"):
        resolve_sampler(SamplerConfig(cache="prefix"), edit)


def test_generate_and_chat_on_an_edit_flow_run(tmp_path, capsys, monkeypatch):
    write_corpus(tmp_path / "data" / "train.jsonl", num_records=30)
    write_yaml(tmp_path / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    values = tiny_train_values(run={"name": "ef", "output_dir": str(tmp_path / "runs")},
                               objective={"name": "edit_flow"}, model={"edit_head": True},
                               training={"steps": 2})  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    args = ["generate", "--run", str(run_dir), "-p", "ab", "-p", "a longer prompt", "--gen-length", "6"]
    assert main([*args, "--steps", "24", "--json", "--seed", "3"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 2 and all(r["nfe"] == 24 and r["steps"] == 24 for r in records)
    assert records[0]["edits"] == records[1]["edits"] >= records[0]["tokens_committed"]  # whole-batch counters
    assert "edit_flow/tau_leaping, NFE 24" in err
    for bad, words in ((["--policy", "threshold"], "sampler.policy: threshold"),
                       (["--set", "generation=canvas"], "sampler.generation: canvas")):  # fmt: skip
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.startswith("dllm: error:") and err.count("\n") == 1
    assert main(["eval", "tasks", "--run", str(run_dir), "--tasks", "addition", "--limit", "4", "--json",
                 "--set", "steps=4"]) == 0  # fmt: skip
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["examples"] == 4 and summary["nfe_per_call"] == 4 and summary["edits_per_answer"] > 0
    assert summary["policy"] == "tau_leaping"
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    assert main(["chat", "--run", str(run_dir), "--gen-length", "6", "--steps", "5"]) == 0
    err = capsys.readouterr().err
    assert "chatting (edit_flow, tau_leaping)" in err and "[NFE 5," in err


def test_likelihood_refuses_an_edit_flow_run():
    from types import SimpleNamespace

    from dllm.evaluation.likelihood import scoring_for

    loaded = SimpleNamespace(profile=DecodeProfile(objective="edit_flow", generation="edit_flow", **IDS))
    with pytest.raises(ConfigError, match="trained with edit_flow .* evaluate it with tasks"):
        scoring_for(loaded)
