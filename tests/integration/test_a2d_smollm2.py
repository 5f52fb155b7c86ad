"""The a2d-smollm2 recipes end to end on the truncated SmolLM2 (its first blocks, real weights and tokenizer;
tests/real_model.py): each recipe's own commands through the CLI on 8 of its prompts and 2 training steps: the
AR model answers its prompts (`generate --ar --chat`), `data prepare` reads the answers as chat turns, `launch`
trains from the imported folder; then the converted run decodes held-out prompts with no mask left, with both
of the bench's sampler settings; then bench/real_a2d.py's every section on the two runs. (The measured
accuracy, agreement, speed and likelihood of the full runs are the bench's: docs/real-a2d.md.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.cli.main import main
from tests import real_model as rm

pytestmark = pytest.mark.skipif(rm.missing() is not None, reason=str(rm.missing()))

RECIPES = {"mdlm": "a2d-smollm2-mdlm", "fast_dllm_v2": "a2d-smollm2-fast-dllm-v2"}
NEW = 24  # answer tokens in the training data (the recipes: 128)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Each recipe's run folder after its steps (module-scoped: run once)."""
    root = tmp_path_factory.mktemp("a2d-smollm2")
    (root / "smollm2").symlink_to(rm.converted("trunc"), target_is_directory=True)  # the recipes' ../smollm2
    mp = pytest.MonkeyPatch()
    out = {}
    try:
        for name, recipe in RECIPES.items():
            folder = root / name
            mp.chdir(root)
            assert main(["recipe", "copy", recipe, str(folder)]) == 0
            mp.chdir(folder)
            prompts = (folder / "data" / "prompts.jsonl").read_text().splitlines()
            (folder / "data" / "prompts.jsonl").write_text("\n".join(prompts[:8]) + "\n")
            answer = ["generate", "--model", "../smollm2", "--ar", "--chat", "--prompts-file", "data/prompts.jsonl",
                      "--max-new-tokens", str(NEW), "--batch-size", "8", "--output", "data/train.jsonl"]  # fmt: skip
            assert main(answer) == 0
            assert main(["data", "prepare", "--config", "prepare.yaml"]) == 0
            sets = ["training.steps=2", "training.global_batch_size=4", "training.micro_batch_size=4",
                    "checkpointing.every_steps=2", "scheduler.warmup_steps=1", "logging.every_steps=1"]  # fmt: skip
            assert main(["launch", "--config", "train.yaml", *[a for s in sets for a in ("--set", s)]]) == 0
            out[name] = folder / "runs" / recipe
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_run_trains_from_the_imported_model(runs, name):
    metrics = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 2 and bool(torch.isfinite(torch.tensor(losses)).all())
    from dllm.checkpoint.loading import load_for_inference

    loaded = load_for_inference(run=runs[name])
    assert loaded.spec.model.init_from is not None and loaded.model_cfg.num_layers == rm.TRUNCATED_LAYERS


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_converted_model_decodes_held_out_prompts_with_no_mask_left(runs, name):
    from bench.real_a2d import chat_encoder, settings, setup

    from dllm.checkpoint.loading import load_for_inference
    from dllm.inference.engine import generate

    loaded = load_for_inference(run=runs[name])
    assert loaded.profile.attention == ("block" if name == "fast_dllm_v2" else "bidirectional")
    prompts = [chat_encoder(loaded)(p) for p in rm.instructions(3)]
    for setting, fields in settings(loaded.profile).items():
        s = setup(loaded, fields, 32)
        res = generate(loaded.model, prompts, s.sampler, s.special, generator=torch.Generator().manual_seed(0))
        assert res.counters.nfe > 0, setting
        for start, row in zip(res.gen_start_B, res.canvas_BL.tolist(), strict=True):
            assert loaded.profile.mask_id not in row[start:], (setting, row)


def test_the_bench_runs_every_section(runs, capsys):
    from bench.real_a2d import main as bench

    args = ["--model", "trunc", *[a for n, p in runs.items() for a in ("--run", f"{n}={p}")], "--tasks",
            "capitals,yesno", "--limit", "1", "--open-prompts", "2", "--open-new", "8", "--speed-prompts", "2",
            "--rounds", "1", "--batches", "2", "--likelihood-rows", "3", "--mc-samples", "2",
            "--threshold-sweep", "0.5", "--settings", "fast,threshold_0.5"]  # fmt: skip
    result = bench(args)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for name in RECIPES:
        assert result["overlap"][name]["items_checked"] == 2 * 1 + 3
        assert all(v == 0 for k, v in result["overlap"][name].items() if k != "items_checked")
        assert f"{name}/quality" not in result["accuracy"]  # --settings keeps the fast ones
        for setting in ("fast", "threshold_0.5"):
            acc = result["accuracy"][f"{name}/{setting}"]
            assert acc["all"]["n"] == 2 and 0 <= acc["all"]["accuracy"] <= 1
            assert acc["capitals"]["tokens_per_forward"] > 0
        assert result["settings"][name]["threshold_0.5"]["threshold"] == 0.5
        assert 0 <= result["agreement"][name]["rouge_l"] <= 1 and 0 <= result["agreement"][name]["token_f1"] <= 1
        for timed in (name, f"{name}/threshold_0.5"):  # --settings: its threshold settings are timed
            speed = result["speed"]["batch_2"][timed]
            assert speed["tok_s"] > 0 and speed["forwards_per_token"] > 0 and speed["speed_over_ar"] > 0
        conf = result["confidence"][name]
        assert conf["forwards_per_token"] > 0 and conf["position_1"]["n"] == conf["steps"] > 0
        assert all(0 <= conf["position_1"][f"p>={c}"] <= 1 for c in (0.9, 0.7, 0.5))
        lik = result["likelihood"][name]
        assert lik["rows"] == 3 and lik["mc_samples"] == 2 and lik["nelbo_per_token"] > 0
    assert result["likelihood"]["ar"]["exact"] and result["likelihood"]["ar"]["mc_samples"] == 1
    chosen = result["confidence"]["ar"]["chosen_token"]  # greedy: the chosen token is the top one
    assert chosen["n"] > 0 and 0 < chosen["median"] <= 1
    assert result["speed"].keys() == {"prompts", "new_tokens", "rounds", "batch_2"}
    assert result["speed"]["batch_2"]["ar"]["forwards_per_token"] >= 1.0  # a batch steps until its last row ends
    ceil = result["ceiling"]
    assert ceil["prompts"] == 2 and ceil["top"] == 16 and ceil["answer_tokens"] > 0
    for k in (2, 3):
        lo, hi = ceil[f"position_{k}"]["bound_lo"], ceil[f"position_{k}"]["bound_hi"]
        assert lo["n"] == hi["n"] > 0 and lo["median"] <= hi["median"] <= 1
        assert all(lo[f"p>={c}"] <= hi[f"p>={c}"] for c in (0.9, 0.7, 0.5))
        assert 0 <= ceil[f"position_{k}"]["argmax_is_greedy"] <= 1
    fpt = [ceil[f"oracle_forwards_per_token_at_{c}"] for c in (0.9, 0.7, 0.5)]
    assert 1 / 3 <= fpt[2] <= fpt[1] <= fpt[0] <= 1  # at most 3 tokens a forward, more at a lower threshold
    assert 1 < ceil["parallel_drafter_tau_3_drafts"] <= 4  # its 1st draft is always kept, then the target's token


CERTAINTY_SETS = ["run.name=a2d-smollm2-certainty", "model.init_from=fdv2-export", "objective.certainty.weight=2",
                  "training.seed=1", "scheduler.warmup_steps=1"]  # fmt: skip
"""docs/real-a2d.md's continuation of the fast_dllm_v2 run with certainty forcing (its steps cut to 2 here)."""


def test_the_fast_dllm_v2_run_continues_with_certainty_forcing(runs, monkeypatch):
    """The documented second stage: export the fast_dllm_v2 run, train on from it with objective.certainty
    (the recipe's own train.yaml and data, --set overrides); the run logs its certainty metrics and decodes."""
    from bench.real_a2d import chat_encoder, settings, setup

    from dllm.checkpoint.loading import load_for_inference
    from dllm.inference.engine import generate

    folder = runs["fast_dllm_v2"].parent.parent
    monkeypatch.chdir(folder)
    assert main(["convert", "--run", str(runs["fast_dllm_v2"]), "--to-hf", "fdv2-export"]) == 0
    sets = [*CERTAINTY_SETS, "training.steps=2", "training.global_batch_size=4", "training.micro_batch_size=4",
            "checkpointing.every_steps=2", "logging.every_steps=1"]  # fmt: skip
    assert main(["launch", "--config", "train.yaml", *[a for s in sets for a in ("--set", s)]]) == 0
    run = folder / "runs" / "a2d-smollm2-certainty"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert len(steps) == 2 and all(0 <= m["certain_frac"] <= 1 and m["certain_entropy"] >= 0 for m in steps)
    loaded = load_for_inference(run=run)
    assert loaded.spec.objective.certainty.weight == 2 and loaded.profile.attention == "block"
    s = setup(loaded, settings(loaded.profile)["fast"], 32)
    res = generate(loaded.model, [chat_encoder(loaded)(rm.instructions(1)[0])], s.sampler, s.special)
    assert loaded.profile.mask_id not in res.canvas_BL[0, res.gen_start_B[0] :].tolist()


def test_rouge_l_and_token_f1():
    from bench.real_a2d import rouge_l, token_f1

    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("a b c d", "a x c y") == pytest.approx(0.5)  # LCS "a c": 2/4 both ways
    assert rouge_l("b a", "a b") == pytest.approx(0.5)  # order matters for ROUGE-L ...
    assert token_f1("b a", "a b") == 1.0  # ... not for the bag of words
    assert token_f1("a a b", "a c") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert rouge_l("", "") == 1.0 and token_f1("x", "") == 0.0


def _next_plain(model, tokens: list[int]) -> torch.Tensor:
    """P(. | tokens) from a forward of the whole sequence, no cache (sampling.causal.Recompute)."""
    from dllm.sampling.causal import Recompute
    from dllm.sampling.results import Counters

    logits, _ = Recompute(model, 1, len(tokens) + 1, Counters()).forward(torch.tensor([tokens]))
    return logits[0, -1].float().softmax(-1)


def test_the_ceilings_marginals_equal_plain_forwards():
    """bench/real_a2d.py's ceiling: the 2nd and 3rd positions' marginals under the AR original, computed on
    copies of one cached forward cut at each prefix, equal sums of whole-sequence forwards without a cache;
    the bounds hold the top probability of the whole marginal (all paths, not only the `top` counted)."""
    from bench.real_a2d import after_paths, chat_encoder, lookahead

    from dllm.checkpoint.loading import load_for_inference
    from dllm.sampling.causal import Target
    from dllm.sampling.results import Counters

    ar = load_for_inference(model_dir=rm.converted("trunc"))
    prompt = chat_encoder(ar)(rm.instructions(1)[0])
    seq = prompt + [int(t) for t in torch.randint(0, 5000, (5,), generator=torch.Generator().manual_seed(0))]
    start, top = len(prompt), 3
    with torch.inference_mode():
        full = Target(ar.model, 1, len(seq) + 2, Counters())
        full.forward(torch.tensor([seq]))
        full.commit(torch.tensor([len(seq)]))
        rows = [(start + 1, [7]), (start + 3, [11]), (start, [5, 9])]  # ragged cuts, and a path of two
        got = [p for part, probs in after_paths(ar.model, full, len(seq), rows[:2], chunk=1) for p in probs]
        got += [p for _, probs in after_paths(ar.model, full, len(seq), rows[2:]) for p in probs]
        for (j, path), p in zip(rows, got, strict=True):
            torch.testing.assert_close(p, _next_plain(ar.model, seq[:j] + path), atol=1e-5, rtol=1e-4)
        found = lookahead(ar.model, seq, start, top, chunk=4)
        assert [r["j"] for r in found] == list(range(start, len(seq) - 1))
        for r in found[:2]:
            j = r["j"]
            p1 = _next_plain(ar.model, seq[:j])
            xs = p1.topk(top).indices.tolist()
            after = {x: _next_plain(ar.model, seq[:j] + [x]) for x in xs}
            marg2 = sum(p1[x] * after[x] for x in xs)
            assert r["lo2"] == pytest.approx(float(marg2.max()), abs=1e-5)
            assert r["hi2"] == pytest.approx(float(marg2.max()) + 1 - float(p1[xs].sum()), abs=1e-5)
            assert r["greedy2"] == (int(marg2.argmax()) == seq[j + 1])
            pairs = [(float(p1[x] * after[x][y]), (x, y)) for x in xs for y in after[x].topk(top).indices.tolist()]
            pairs = sorted(pairs, reverse=True)[:top]
            marg3 = sum(w * _next_plain(ar.model, seq[:j] + list(path)) for w, path in pairs)
            assert r["lo3"] == pytest.approx(float(marg3.max()), abs=1e-5)
            assert r["hi3"] == pytest.approx(float(marg3.max()) + 1 - sum(w for w, _ in pairs), abs=1e-5)
        # the bounds hold more of the marginal than they count: summed over the 64 likeliest 1st tokens, its top
        # probability is at least the 3 tokens' and at most their bound's
        j = found[0]["j"]
        p1 = _next_plain(ar.model, seq[:j])
        xs = p1.topk(64).indices.tolist()
        more = float(sum(p1[x] * _next_plain(ar.model, seq[:j] + [x]) for x in xs).max())
        assert found[0]["lo2"] - 1e-5 <= more <= found[0]["hi2"] + 1e-5
