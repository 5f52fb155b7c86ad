"""The exact AR log-likelihood with each distinct context computed once (evaluation/shared_context.py) against its
reference, one causal forward over each [context ; continuation] row (likelihood.nelbo_samples' AR path): groups of
choices sharing a context, one-token continuations, ragged lengths, a context of its own, any batch size."""

from __future__ import annotations

import random

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.evaluation.likelihood import ScoringModel, nelbo_samples
from dllm.evaluation.shared_context import score_shared_contexts
from dllm.models.transformer import Transformer

VOCAB = 96
MASK_ID = VOCAB - 1


@pytest.fixture(scope="module")
def model() -> Transformer:
    cfg = ModelConfig(family="llama", preset="tiny", vocab_size=VOCAB, max_seq_len=64, init_std=0.2)
    m = Transformer(cfg)
    m.init_weights(torch.Generator().manual_seed(0))
    return m.double().eval()  # float64: the two paths' sums agree to rounding


def _rows(seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(7):
        ctx = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 12))]
        for _ in range(rng.randint(1, 4)):  # 1 to 4 choices, some of one token
            rows.append((ctx, [rng.randrange(VOCAB - 1) for _ in range(rng.choice([1, 1, 2, 5, 9]))]))
    rng.shuffle(rows)
    return rows


def _reference(model, ctx: list[int], cont: list[int]) -> tuple[float, bool]:
    ids = torch.tensor([ctx + cont])
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[0, len(ctx) :] = True
    how = ScoringModel("ar", MASK_ID)
    ll = -float(nelbo_samples(model, ids, scored, how, num_samples=1, generator=torch.Generator()).samples_BK[0, 0])
    with torch.no_grad():
        out = model(ids, torch.arange(ids.shape[1])[None], AttentionMask("causal"))
        logits = model.logits(out.hidden_BLE[0, len(ctx) - 1 : -1])
    logits[:, MASK_ID] = float("-inf")
    return ll, bool((logits.argmax(-1) == torch.tensor(cont)).all())


@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_shared_contexts_equal_one_forward_per_row(model, batch_size):
    rows = _rows(batch_size)
    got = score_shared_contexts(model, rows, batch_size, MASK_ID)
    for (ctx, cont), (ll, greedy) in zip(rows, got, strict=True):
        want_ll, want_greedy = _reference(model, ctx, cont)
        assert ll == pytest.approx(want_ll, abs=1e-9) and greedy == want_greedy


def test_a_greedy_continuation_is_recognised(model):
    """A continuation built from the model's own argmax is greedy, through the shared path's second forward."""
    ctx = [3, 17, 42]
    cont: list[int] = []
    with torch.no_grad():
        for _ in range(4):
            ids = torch.tensor([ctx + cont])
            out = model(ids, torch.arange(ids.shape[1])[None], AttentionMask("causal"))
            logits = model.logits(out.hidden_BLE[0, -1:])
            logits[:, MASK_ID] = float("-inf")
            cont.append(int(logits.argmax()))
    other = [(cont[0] + 1) % (VOCAB - 1), *cont[1:]]
    rows = [(ctx, other), (ctx, cont), (ctx, cont[:1])]  # the first rides with its context: `cont` runs after it
    (_, not_greedy), (_, greedy), (_, short) = score_shared_contexts(model, rows, 2, MASK_ID)
    assert greedy and short and not not_greedy
