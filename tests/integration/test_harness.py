"""The lm-evaluation-harness adapter end to end, offline: a tiny run trained here on single-digit sums,
local multiple-choice and generate_until tasks through `lm_eval.simple_evaluate` and through
`python -m dllm.evaluation.harness`, and DllmLM's requests checked directly (exact AR scores by hand,
guidance, stop strings, max_gen_toks, argument errors)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from dllm.attention.masks import AttentionMask  # noqa: E402
from dllm.data.synthetic import random_sum, sentence  # noqa: E402
from dllm.errors import ConfigError  # noqa: E402
from dllm.evaluation.harness import DllmLM, main  # noqa: E402
from dllm.sampling.stops import cut_at_stop  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
# A bidirectional model sees how long its canvas is, and every sum it trains on is one 16-token document
# (prompt, answer, EOS filled to pad_to_multiple 16), so it reads an answer's length off the canvas.
# Scored as the very end of the text, an answer is unlikely whatever its digits (0/10 right with
# suffix_masks=0 when written); the scores and the generations below use 16-token canvases, as trained:
# a 7-token prompt with a one-digit answer and 7 masks after it (see DllmLM's suffix_masks), or with 9
# tokens to generate. With 8 masks, or 8 tokens to generate, the canvas is 17 or 15 tokens: a run that
# has learnt every sum may still answer with one digit too few or too many (generation exact match 0.0
# from runs whose 9-token generations were all right), and which runs do changes with the seed.
SCORING = {"mc_samples": 16, "batch_size": 16, "suffix_masks": 7}
MAX_GEN_TOKS = 9


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **OFFLINE}


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


def _launch(proj: Path, sets: dict) -> Path:
    overrides = [f"--set={k}={v}" for k, v in sets.items()]
    _run(["-m", "dllm.cli.main", "launch", "--config", "train.yaml", *overrides], proj)
    return proj / "runs" / str(sets["run.name"])


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        if "datasets" in sys.modules:  # read at import: set what an earlier import already read
            for key in OFFLINE:
                mp.setattr(sys.modules["datasets"].config, key, True, raising=False)
        yield


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`dllm init`, its sums replaced by single-digit ones, prepared and trained: ~30 s on one core.
    800 steps: at 400 the tiny preset had learnt the sums in some seeds and data orders only (of 16
    seeds, 2 runs of the default layout and 4 of `packing: split` generated under 60% of the 100 sums
    right; at 800, 8 seeds of the default layout generated all 100 right and chose 87-100% right)."""
    root = tmp_path_factory.mktemp("harness")
    cli = ["-m", "dllm.cli.main"]
    _run([*cli, "init", "proj", "--num-records", "200"], root)
    proj = root / "proj"
    rng = random.Random(0)
    # every single-digit sum, held-out ones included: the tests check the harness's scoring of sums the model
    # trained on (training-set scores by design, reported nowhere), not held-out arithmetic
    pairs = (random_sum(rng, 9) for _ in range(3000))
    sums = "".join(json.dumps({"prompt": f"{a} + {b} =", "completion": f" {a + b}"}) + "\n" for a, b in pairs)
    (proj / "data" / "arithmetic.jsonl").write_text(sums, encoding="utf-8")
    texts = "".join(json.dumps({"text": sentence(rng)}) + "\n" for _ in range(TEXTS))  # fixed here, not by init
    (proj / "data" / "train.jsonl").write_text(texts, encoding="utf-8")
    _run([*cli, "data", "prepare", "--config", "prepare.yaml", "-q"], proj)
    sets = {
        "model.preset": "tiny", "training.steps": 800, "optimizer.lr": 0.005, "training.global_batch_size": 32,
        "training.micro_batch_size": 32, "checkpointing.every_steps": 800, "logging.progress": "off",
        "logging.tensorboard": "off", "run.name": "sums",
    }  # fmt: skip
    return _launch(proj, sets)


@pytest.fixture(scope="module")
def ar_run(run_dir: Path) -> Path:
    """A few steps of next-token training on the same data: a causal model, the only kind `ar` scores exactly."""
    proj = run_dir.parent.parent
    sets = {
        "model.preset": "tiny", "training.steps": 4, "training.global_batch_size": 8, "training.micro_batch_size": 8,
        "checkpointing.every_steps": 4, "logging.progress": "off", "logging.tensorboard": "off", "run.name": "ar",
        "objective": "{name: ar}",
    }  # fmt: skip
    return _launch(proj, sets)


@pytest.fixture(scope="module")
def block_run(run_dir: Path) -> Path:
    """A few steps of fast_dllm_v2 (block diffusion with the token shift) on the same data: the block path."""
    proj = run_dir.parent.parent
    sets = {
        "model.preset": "tiny", "training.steps": 4, "training.global_batch_size": 8, "training.micro_batch_size": 8,
        "checkpointing.every_steps": 4, "logging.progress": "off", "logging.tensorboard": "off", "run.name": "blocks",
        "objective": "{name: fast_dllm_v2, block_size: 16, sub_block_size: 8}",
    }  # fmt: skip
    return _launch(proj, sets)


TEXTS = 40
QUESTIONS = [(3, 4), (1, 8), (6, 7), (2, 2), (9, 5), (0, 6), (7, 8), (4, 5), (8, 1), (5, 9)]


def _wrong(right: int) -> list[int]:
    return [right + 1, right + 10, right - 2 if right >= 2 else right + 2]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two local tasks over the same ten sums: four choices (the right one shuffled in), and generation."""
    folder = tmp_path_factory.mktemp("tasks")
    rng = random.Random(1)
    docs = []
    for a, b in QUESTIONS:
        choices = [str(x) for x in [a + b, *_wrong(a + b)]]
        rng.shuffle(choices)
        right = str(a + b)
        docs.append({"prompt": f"{a} + {b} =", "choices": choices, "label": choices.index(right), "answer": right})
    (folder / "sums.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    data = {
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(folder / "sums.jsonl")}, "cache_dir": str(folder / "cache")},
        "test_split": "test",
        "doc_to_text": "{{prompt}}",
    }
    mc = {"task": "dllm_sums_mc", **data, "output_type": "multiple_choice", "doc_to_choice": "choices",
          "doc_to_target": "label", "metric_list": [{"metric": "acc"}]}  # fmt: skip
    gen = {"task": "dllm_sums_gen", **data, "output_type": "generate_until", "doc_to_target": "answer",
           "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS},
           "metric_list": [{"metric": "exact_match", "regexes_to_ignore": [" "]}]}  # fmt: skip
    for cfg in (mc, gen):
        (folder / f"{cfg['task']}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def lm(run_dir: Path) -> DllmLM:
    return DllmLM(run=str(run_dir), **SCORING)


def _evaluate(model: DllmLM, task: str, task_dir: Path) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=[task], task_manager=manager, log_samples=True)


def test_multiple_choice_task_through_simple_evaluate(lm: DllmLM, task_dir: Path):
    results = _evaluate(lm, "dllm_sums_mc", task_dir)
    acc = results["results"]["dllm_sums_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert acc >= 0.7, f"the trained model should pick most right sums (chance 0.25), got {acc}"


def test_generate_until_task_through_simple_evaluate(lm: DllmLM, task_dir: Path):
    results = _evaluate(lm, "dllm_sums_gen", task_dir)
    em = results["results"]["dllm_sums_gen"]["exact_match,none"]
    assert 0.0 <= em <= 1.0
    outputs = [s["resps"][0][0] for s in results["samples"]["dllm_sums_gen"]]
    assert len(outputs) == len(QUESTIONS)
    assert all("<|mask|>" not in o and "\n" not in o for o in outputs), outputs
    assert all(len(lm.tokenizer.encode(o)) <= MAX_GEN_TOKS for o in outputs), outputs
    assert em >= 0.5, outputs  # the run answers most of its own training format


def test_cli_module_runs_lm_eval(run_dir: Path, task_dir: Path, tmp_path: Path):
    args = ",".join(f"{k}={v}" for k, v in {"run": run_dir, **SCORING}.items())
    res = _run(
        ["-m", "dllm.evaluation.harness", "--model", "dllm", "--model_args", args, "--tasks", "dllm_sums_mc",
         "--include_path", str(task_dir), "--device", "cpu", "--output_path", str(tmp_path / "out")],
        tmp_path,
    )  # fmt: skip
    assert "dllm_sums_mc" in res.stdout and "acc" in res.stdout
    (found,) = list((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(found.read_text())["results"]["dllm_sums_mc"]["acc,none"]
    assert 0.7 <= acc <= 1.0


def _requests(kind: str, pairs) -> list[Instance]:
    return [Instance(kind, {}, args, i) for i, args in enumerate(pairs)]


def test_right_sums_score_higher_than_wrong_ones(lm: DllmLM):
    pairs = [(f"{a} + {b} =", f" {c}") for a, b in QUESTIONS for c in [a + b, *_wrong(a + b)]]
    scores = [ll for ll, _ in lm.loglikelihood(_requests("loglikelihood", pairs))]
    margins = [scores[4 * q] - max(scores[4 * q + 1 : 4 * q + 4]) for q in range(len(QUESTIONS))]
    assert sum(margins) / len(margins) > 0 and sum(m > 0 for m in margins) >= 7, margins
    assert all(ll < 0 for ll in scores)


def _teacher_forced(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    """log p(cont | ctx) of a causal forward, from full logits (not the adapter's chunked path)."""
    ids = torch.tensor([ctx + cont])
    L = ids.shape[1]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, torch.arange(L)[None], AttentionMask("causal")).logits().double(), -1)[0]
    steps = range(len(ctx) - 1, L - 1)  # logits at i predict token i + 1
    total = sum(float(logp[i, ids[0, i + 1]]) for i in steps)
    return total, all(int(logp[i].argmax()) == int(ids[0, i + 1]) for i in steps)


def test_ar_loglikelihood_is_the_exact_teacher_forced_log_prob(ar_run: Path, run_dir: Path):
    ar = DllmLM(run=str(ar_run), kind="ar", batch_size=3)
    tok = ar.tokenizer
    pairs = [("3 + 4 =", " 7"), ("the cat ", "sat on a mat"), ("", "1 + 7 = 8"), ("1 + 1 =", " 2"), ("9 + 9 =", "18")]
    got = ar.loglikelihood(_requests("loglikelihood", pairs))
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        head = ctx.rstrip()  # trailing spaces belong to the continuation; an empty context is BOS
        ctx_ids = tok.encode(head) if head else [tok.bos_id]
        want, want_greedy = _teacher_forced(ar.model, ctx_ids, tok.encode(ctx[len(head) :] + cont))
        assert ll == pytest.approx(want, rel=1e-4, abs=1e-4) and greedy == want_greedy
    # the same requests in another order and batch size give the same numbers, in the caller's order
    again = DllmLM(run=str(ar_run), kind="ar", batch_size=2).loglikelihood(_requests("loglikelihood", pairs[::-1]))
    assert [ll for ll, _ in again[::-1]] == pytest.approx([ll for ll, _ in got], rel=1e-5)
    # rolling: one window is the whole text after BOS; short windows still give a finite, smaller sum
    text = "3 + 4 = 7 and 5 + 2 = 7"
    (whole,) = ar.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    assert whole == pytest.approx(ar.loglikelihood(_requests("loglikelihood", [("", text)]))[0][0], rel=1e-5)
    ar.window = 8
    (chunked,) = ar.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]))
    assert chunked < 0 and chunked != pytest.approx(whole)
    with pytest.raises(ConfigError, match="kind: ar scores causal"):  # a masked model has no exact AR likelihood
        DllmLM(run=str(run_dir), kind="ar")


def test_guidance_changes_the_scores(run_dir: Path):
    pairs = [(f"{a} + {b} =", f" {a + b}") for a, b in QUESTIONS[:4]]
    plain = DllmLM(run=str(run_dir), mc_samples=4, seed=3)
    guided = DllmLM(run=str(run_dir), mc_samples=4, seed=3, cfg_scale=1.5)
    assert guided.sampler.cfg_scale == 1.5  # generation is guided too
    a = [ll for ll, _ in plain.loglikelihood(_requests("loglikelihood", pairs))]
    b = [ll for ll, _ in guided.loglikelihood(_requests("loglikelihood", pairs))]
    assert a == [ll for ll, _ in plain.loglikelihood(_requests("loglikelihood", pairs))]  # seeded: repeatable
    assert all(abs(x - y) > 1e-6 for x, y in zip(a, b, strict=True))
    out = guided.generate_until(_requests("generate_until", [("3 + 4 =", {"until": ["\n"], "max_gen_toks": 4})]))
    assert len(out) == 1 and "\n" not in out[0]


def test_generate_until_honours_until_and_max_gen_toks(run_dir: Path):
    gen = DllmLM(run=str(run_dir), block_length=4, steps=4, batch_size=3)
    prompts = [f"{a} + {b} =" for a, b in QUESTIONS[:5]]
    full = gen.generate_until(_requests("generate_until", [(p, {"until": [], "max_gen_toks": 8}) for p in prompts]))
    assert all("<|mask|>" not in o for o in full)
    # two gen_kwargs groups in one call: the answers come back in the caller's order
    mixed = [(p, {"until": [full[i][-1:] or "#"], "max_gen_toks": 8}) if i % 2 else (p, {"max_gen_toks": 2})
             for i, p in enumerate(prompts)]  # fmt: skip
    out = gen.generate_until(_requests("generate_until", mixed))
    for i, o in enumerate(out):
        if i % 2:  # stopped at the string: what the unstopped run decoded, cut before it
            assert o == cut_at_stop(full[i], mixed[i][1]["until"]) and mixed[i][1]["until"][0] not in o
        else:  # 2 tokens asked, a block of 4 decoded, the output cut back to 2
            assert len(gen.tokenizer.encode(o)) <= 2
    cfg, max_new = gen._gen_config({"max_gen_toks": 6})
    assert (cfg.gen_length, cfg.block_length, cfg.steps, max_new) == (8, 4, 8, 6)


def test_bad_model_args_are_one_line_errors(run_dir: Path):
    run = str(run_dir)
    cases = [
        ({"run": run, "bogus": 1}, "model_args: unknown argument 'bogus'"),
        ({"run": run, "mc_samples": "0"}, "mc_samples"),
        ({"run": run, "policy": "nope"}, "policy"),
        ({"run": run, "checkpoint": run}, "exactly one of run="),
        ({"run": run, "device": "gpu7"}, "device"),
        ({"run": run, "sampler_config": "missing.yaml"}, "missing.yaml does not exist"),
        ({"run": run, "cfg_scale": 1, "cache": "dual"}, "cfg_scale"),
    ]
    for args, expected in cases:
        with pytest.raises(ConfigError, match=expected) as info:
            DllmLM(**args)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="'antithetic' is not KEY=VALUE"):
        DllmLM.create_from_arg_string(f"run={run},antithetic")
    # lm_eval's strings and its own --batch_size / --device (cuda:0 by default) defer to model_args
    lm = DllmLM.create_from_arg_string(f"run={run},mc_samples=2,antithetic=false", {"batch_size": 4, "device": None})
    assert (lm.args.mc_samples, lm.args.antithetic, lm.args.batch_size) == (2, False, 4)


def test_main_turns_user_errors_into_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    from lm_eval._cli import HarnessCLI

    seen = []

    def fake_execute(self, args) -> None:
        seen.append(list(sys.argv))
        raise ConfigError("model_args: unknown argument 'x'")

    monkeypatch.setattr(HarnessCLI, "execute", fake_execute)
    argv = list(sys.argv)
    assert main(["--model", "dllm", "--tasks", "t"]) == 2
    assert seen == [["lm-eval", "run", "--model", "dllm", "--tasks", "t"]] and sys.argv == argv  # lm_eval adds run
    assert capsys.readouterr().err == "dllm: error: model_args: unknown argument 'x'\n"


def test_import_without_lm_eval_says_how_to_install():
    code = (
        "import sys\nsys.modules['lm_eval'] = None\nimport dllm.cli.main, dllm.evaluation\n"
        "assert 'dllm.evaluation.harness' not in sys.modules\n"
        "try:\n    import dllm.evaluation.harness\nexcept ImportError as e:\n    print(e)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "pip install 'dllm[eval]'" in res.stdout


def test_block_model_scores_rolls_and_generates(block_run: Path):
    lm = DllmLM(run=str(block_run), mc_samples=2, batch_size=2, suffix_masks=3)
    assert (lm.scoring.kind, lm.scoring.block_size, lm.scoring.shift) == ("block", 16, True)
    pairs = [("3 + 4 =", " 7"), ("12 + 7 =", " 19"), ("", "a text longer than one block of sixteen tokens")]
    scores = lm.loglikelihood(_requests("loglikelihood", pairs))  # rows padded to whole blocks
    assert all(math.isfinite(ll) and ll < 0 and isinstance(greedy, bool) for ll, greedy in scores)
    lm.window = 16  # rolling windows of one block
    rolled = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(pairs[2][1],), ("hi",)]))
    assert all(math.isfinite(x) and x < 0 for x in rolled)
    out = lm.generate_until(_requests("generate_until", [(p, {"until": ["\n"], "max_gen_toks": 5}) for p, _ in pairs]))
    assert all("<|mask|>" not in o and "\n" not in o and len(lm.tokenizer.encode(o)) <= 5 for o in out)
    guided = DllmLM(run=str(block_run), cfg_scale=1.0)
    with pytest.raises(ConfigError, match="guided likelihoods are computed for masked"):
        guided.loglikelihood(_requests("loglikelihood", pairs[:1]))
