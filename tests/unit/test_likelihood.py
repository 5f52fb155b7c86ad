"""Likelihood bounds (evaluation/likelihood.py): masked and block NELBO, exact AR NLL, the estimator's
spread, and that a trained model's bound prefers the right continuation.

Shapes: B batch, L sequence, K Monte Carlo samples.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dllm.checkpoint.loading import load_for_inference
from dllm.config.loading import validate_config
from dllm.config.model import ModelConfig
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.data.prepare import prepare
from dllm.evaluation.likelihood import ScoringModel, nelbo_samples, scoring_for, summarize, time_samples
from dllm.models.transformer import Transformer
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir

V = 64
CYCLE = "abcdefghijklmnop"


def untrained(seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, init_std=0.02))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, V - 4, (4, 32), generator=torch.Generator().manual_seed(seed))
    scored = torch.ones_like(x, dtype=torch.bool)
    scored[:, :4] = False  # a context of 4 tokens
    return x, scored


def estimate(model, how, k, seed, antithetic=True, x=None, scored=None) -> float:
    if x is None:
        x, scored = rows()
    s = nelbo_samples(model, x, scored, how, num_samples=k, antithetic=antithetic,
                      generator=torch.Generator().manual_seed(seed))  # fmt: skip
    return summarize([s]).nelbo_per_token


def test_time_samples_are_stratified_or_independent():
    t = time_samples(torch.tensor([0.3, 0.95]), 4, True, None)
    assert torch.allclose(t[0], 1 - torch.tensor([0.3, 0.55, 0.8, 0.05], dtype=torch.float64))
    assert bool((t > 0).all() and (t <= 1).all())
    # one sample per stratum [k/K, (k+1)/K) of u = 1 - t
    strata = ((1 - t) * 4).floor().sort(-1).values
    assert torch.equal(strata, torch.arange(4, dtype=torch.float64).expand(2, 4))
    g = torch.Generator().manual_seed(0)
    assert not torch.allclose(
        time_samples(torch.zeros(2), 4, False, g)[0], time_samples(torch.zeros(2), 4, False, g)[0]
    )


@pytest.mark.parametrize("kind", ["mdlm", "block"])
def test_untrained_model_bound_is_close_to_log_vocab(kind):
    """Near-uniform predictions: each masked token costs ~log(V - 1) (the mask id is excluded), and the
    ELBO weight makes E_t[w(t) * (masked share t)] = 1, so the bound per token is ~log(V - 1)."""
    how = ScoringModel(kind, mask_id=V - 1, block_size=8)
    s = nelbo_samples(untrained(), *rows(), how, num_samples=64, generator=torch.Generator().manual_seed(0))
    res = summarize([s])
    assert res.tokens == 4 * 28 and res.mc_samples == 64 and res.forward_passes == 64
    assert abs(res.nelbo_per_token - math.log(V - 1)) < max(4 * res.mc_stderr, 0.1), res


def test_ar_nll_is_the_teacher_forced_log_prob():
    model = untrained(1)
    x, scored = rows(1)
    s = nelbo_samples(model, x, scored, ScoringModel("ar", mask_id=V - 1), num_samples=5)
    assert s.samples_BK.shape == (4, 1) and s.forward_passes == 1
    from dllm.attention.masks import AttentionMask

    with torch.no_grad():
        logp = model(x, torch.arange(32).expand(4, 32), AttentionMask("causal")).logits().double().log_softmax(-1)
    want = -sum(logp[b, i - 1, x[b, i]] for b in range(4) for i in range(32) if scored[b, i])
    torch.testing.assert_close(s.samples_BK.sum(), want, rtol=1e-5, atol=1e-4)
    assert summarize([s], exact=True).mc_stderr == 0


@pytest.mark.parametrize("kind", ["mdlm", "block"])
def test_spread_shrinks_with_more_samples_and_both_samplers_agree(kind):
    """Both time samplers estimate the same bound; the spread over seeds falls roughly as 1/sqrt(K)."""
    model, how = untrained(2), ScoringModel(kind, mask_id=V - 1, block_size=8)
    few = torch.tensor([estimate(model, how, 2, s) for s in range(12)])
    many = torch.tensor([estimate(model, how, 32, s) for s in range(12)])
    plain = torch.tensor([estimate(model, how, 32, s, antithetic=False) for s in range(12)])
    assert many.std() < few.std() / 2, (few.std(), many.std())
    assert abs(many.mean() - plain.mean()) < 3 * (many.std() + plain.std()) / math.sqrt(12)


class ShiftedStates(torch.nn.Module):
    """`model` with its states moved one position right: row i is the state at i - 1 (row 0 its own)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def head(self, hidden):
        return self.model.head(hidden)

    def forward(self, tokens, positions, mask, cache=None):
        out = self.model(tokens, positions, mask)
        return replace(out, hidden_BLE=out.hidden_BLE[:, (torch.arange(tokens.shape[1]) - 1).clamp_min(0)])


def test_a_shifted_masked_model_is_scored_from_the_state_before_each_token():
    """shift: the bound of a model equals the unshifted bound of the same model whose states are moved one
    position right (the alignment the mdlm objective trains a shift_logits model with)."""
    model, (x, scored) = untrained(3), rows(3)

    def samples(m, shift):
        how = ScoringModel("mdlm", mask_id=V - 1, shift=shift)
        return nelbo_samples(m, x, scored, how, num_samples=4, generator=torch.Generator().manual_seed(5)).samples_BK

    shifted = samples(model, True)
    assert torch.equal(shifted, samples(ShiftedStates(model), False))
    assert not torch.allclose(shifted, samples(model, False))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny mdlm and bd3lm runs on rotations of a 16-letter cycle (every letter follows its neighbour)."""
    root = tmp_path_factory.mktemp("lik")
    text = "".join(json.dumps({"text": CYCLE[i % 16 :] + CYCLE[: i % 16]}) + "\n" for i in range(400))
    (root / "d.jsonl").write_text(text)
    prep = validate_config(PrepareSpec, {"sources": [{"path": "d.jsonl"}], "output": "p", "seq_len": 32},
                           source="prepare.yaml", base_dir=root)  # fmt: skip
    prepare(prep, root)
    runs = {}
    for name, objective, shift in (("mdlm", {"name": "mdlm"}, False), ("bd3lm", {"name": "bd3lm", "block_size": 8},
                                   False), ("mdlm_shift", {"name": "mdlm"}, True)):  # fmt: skip
        values = {
            "run": {"name": name, "output_dir": str(root / "runs")},
            "model": {"preset": "tiny", "shift_logits": shift},
            "data": {"path": "p", "seq_len": 32}, "objective": objective,
            "training": {"steps": 150, "global_batch_size": 16, "micro_batch_size": 16},
            "optimizer": {"lr": 3e-3}, "scheduler": {"warmup_steps": 5},
            "logging": {"progress": "off", "tensorboard": "off"},
        }  # fmt: skip
        spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=root))
        train_from_run_dir(prepare_run_dir(spec))
        runs[name] = root / "runs" / name
    return runs


@pytest.mark.parametrize("name", ["mdlm", "bd3lm", "mdlm_shift"])
def test_trained_model_prefers_the_right_continuation(trained, name):
    loaded = load_for_inference(run=trained[name])
    how = scoring_for(loaded)
    assert how.kind == ("block" if name == "bd3lm" else "mdlm") and how.shift == (name == "mdlm_shift")
    tok = loaded.tokenizer
    wins = 0
    for start in range(8):  # a training document is one 16-letter rotation: score its last 6 letters
        rotation = CYCLE[start:] + CYCLE[:start]
        context, right = rotation[:10], rotation[10:]
        wrong = right[::2] + right[1::2]  # the same letters, most neighbour pairs broken
        scores = []
        for cont in (right, wrong):
            ids = torch.tensor([tok.encode(context + cont)])
            scored = torch.zeros_like(ids, dtype=torch.bool)
            scored[:, -len(tok.encode(cont)) :] = True
            s = nelbo_samples(
                loaded.model, ids, scored, how, num_samples=16, generator=torch.Generator().manual_seed(start)
            )
            scores.append(float(s.samples_BK.mean()))
        wins += scores[0] < scores[1]
    assert wins == 8


def test_scoring_refuses_what_it_cannot_bound(trained):
    from dllm.errors import ConfigError

    loaded = load_for_inference(run=trained["bd3lm"])
    with pytest.raises(ConfigError, match="a block model"):
        scoring_for(loaded, "mdlm")
    with pytest.raises(ConfigError, match="kind: ar scores causal"):  # a block model's predictions are no AR NLL
        scoring_for(loaded, "ar")
    with pytest.raises(ConfigError, match="not one of"):
        scoring_for(loaded, "elbo")


def test_a_causal_run_is_scored_by_its_exact_likelihood():
    from types import SimpleNamespace

    from dllm.config.profile import DecodeProfile

    profile = DecodeProfile(objective="ar", attention="causal", shift=True, mask_id=3, pad_id=0, eos_id=1,
                            num_tokens=8, max_length=16)  # fmt: skip
    assert scoring_for(SimpleNamespace(profile=profile)).kind == "ar"
