"""One logits function (models/output.py: `token_logits`): a model with Gemma's final logit soft-capping decodes
the same tokens through `generate` and through every shared forward of the engine (canvases uncached and
block-cached, causal rows), sampled at temperature 1 from the same seed (the served paths:
tests/integration/test_serve.py).

A cap of 0.5 squeezes every logit into (-0.5, 0.5), so at temperature 1 the distribution with the cap is
near uniform and the one without it is not: a path that skips the cap draws other tokens (as the running
canvas batch once did). The models are float64 so that batches of other shapes agree far below any draw.
"""

from __future__ import annotations

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import Engine, generate, make_loop
from dllm.inference.scheduler import Limits
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds

V = 32
SPECIAL = SpecialIds(mask_id=31, pad_id=30, eos_id=8, num_tokens=29)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 9]]
SEED = 11


def _model(cap: float | None = 0.5) -> Transformer:
    """One model for every mask (the sampler's attention picks it): soft-capped, or the same weights without."""
    cfg = ModelConfig(preset="tiny", vocab_size=V, init_std=0.5, num_layers=1, final_logit_softcap=cap)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(5))
    return model.double().eval()


def _alone(model, cfg: SamplerConfig):
    return generate(model, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(SEED))


def _batched(model, cfg: SamplerConfig):
    """The request beside another (another prompt, greedy) in the engine's shared forwards, as the server runs it."""
    engine = Engine(model, SPECIAL, Limits(max_rows=8))
    other = engine.add(make_loop(model, [[12, 13]], cfg.model_copy(update={"temperature": 0.0}), SPECIAL))
    req = engine.add(make_loop(model, PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(SEED)))
    while engine.busy:
        engine.step()
    assert req.error is None and other.error is None and req.batch_rows > req.rows * req.counters.nfe // 2
    return req.result


CANVAS = {
    "bidirectional": dict(attention="bidirectional", cache="none"),
    "block": dict(attention="block", cache="none"),
    "block_cached": dict(attention="block", cache="block"),
}


@pytest.mark.parametrize("case", list(CANVAS))
def test_a_soft_capped_canvas_draws_the_same_tokens_batched_as_alone(case: str):
    kw = CANVAS[case]
    model = _model()
    cfg = SamplerConfig(gen_length=8, block_length=4, steps=8, stop_at_eos=False, shift="off", temperature=1.0,
                        policy="random", **kw)  # fmt: skip
    alone = _alone(model, cfg)
    assert _batched(model, cfg).sequences == alone.sequences
    # the cap matters here: without it the same seed draws other tokens
    assert _alone(_model(None), cfg).sequences != alone.sequences


def test_a_soft_capped_causal_model_draws_the_same_tokens_in_the_running_batch_as_alone():
    model = _model()
    cfg = SamplerConfig(generation="causal", gen_length=8, temperature=1.0, stop_at_eos=False)
    alone = _alone(model, cfg)
    assert _batched(model, cfg).sequences == alone.sequences
    assert _alone(_model(None), cfg).sequences != alone.sequences


def test_scoring_reads_the_soft_capped_logits():
    """The ELBO's fused head + CE (evaluation/likelihood.py) and GRPO's completion log-probabilities (rl/logprob.py)
    score the logits decoding samples from, soft-cap included."""
    from dllm.attention.masks import AttentionMask
    from dllm.evaluation.likelihood import _row_ce
    from dllm.rl.logprob import completion_logprobs

    model = _model()
    exclude = torch.tensor([SPECIAL.mask_id])
    prompt_BP = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completion_BC = torch.tensor([[7, 9], [10, 11]])
    tokens_BL = torch.cat([prompt_BP, torch.full_like(completion_BC, SPECIAL.mask_id)], dim=1)
    positions_BL = torch.arange(5).expand(2, 5)
    hidden_BLE = model(tokens_BL, positions_BL, AttentionMask("bidirectional")).hidden_BLE
    logp_BCV = model.logits(hidden_BLE[:, 3:], exclude).log_softmax(-1)
    expected_BC = logp_BCV.gather(-1, completion_BC[..., None])[..., 0]
    got_BC = completion_logprobs(model, prompt_BP, completion_BC, SPECIAL.mask_id)
    torch.testing.assert_close(got_BC, expected_BC, rtol=1e-9, atol=1e-9)
    selected_BL = torch.zeros(2, 5, dtype=torch.bool)
    selected_BL[:, 3:] = True
    targets_BL = torch.cat([prompt_BP, completion_BC], dim=1)
    ce_B = _row_ce(model, hidden_BLE, selected_BL, targets_BL, SPECIAL.mask_id)
    torch.testing.assert_close(ce_B, -expected_BC.sum(-1), rtol=1e-9, atol=1e-9)
