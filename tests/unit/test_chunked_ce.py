"""The chunked LM head + CE (models/chunked_ce.py) against its plain reference, and its memory.

Shapes: N rows, E hidden width, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from bench.chunked_ce import make_inputs, step

from dllm.models.chunked_ce import CHUNK_ELEMENTS, Certainty, linear_cross_entropy, plain_cross_entropy
from dllm.profiling import LiveTensorBytes

N, E, V = 37, 16, 50
EXCLUDE = (0, 3)


def inputs(dtype: torch.dtype = torch.float32, n: int = N, seed: int = 0, zero_every: int = 3):
    """hidden, weight, bias, weights (every `zero_every`-th weight 0) require grad; targets avoid EXCLUDE."""
    g = torch.Generator().manual_seed(seed)
    hidden_NE = torch.randn(n, E, generator=g, dtype=dtype).requires_grad_()
    weight_VE = torch.randn(V, E, generator=g, dtype=dtype).requires_grad_()
    bias_V = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    targets_N = torch.randint(max(EXCLUDE) + 1, V, (n,), generator=g)
    weights_N = torch.rand(n, generator=g, dtype=dtype)
    weights_N[::zero_every] = 0.0
    return hidden_NE, weight_VE, bias_V, targets_N, weights_N.requires_grad_()


def run(fn, hidden_NE, weight_VE, bias_V, targets_N, weights_N, **kw):
    """Loss, per-row CE and the gradients of 2.5 * loss (a non-unit upstream gradient)."""
    weighted_sum, ce_N = fn(hidden_NE, weight_VE, targets_N, weights_N, bias_V=bias_V, **kw)
    wrt = [t for t in (hidden_NE, weight_VE, bias_V, weights_N) if t is not None]
    grads = torch.autograd.grad(2.5 * weighted_sum, wrt)
    return weighted_sum.detach(), ce_N, grads


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("softcap", [None, 2.0])  # Gemma's soft-capped logits: the gradient goes through tanh
def test_matches_plain(dtype, tol, chunk_size, softcap):
    args = inputs(dtype)
    want = run(plain_cross_entropy, *args, exclude_ids=EXCLUDE, softcap=softcap)
    got = run(linear_cross_entropy, *args, exclude_ids=EXCLUDE, chunk_size=chunk_size, softcap=softcap)
    assert got[1].dtype == dtype and not got[1].requires_grad
    for a, b in zip(got[:2] + got[2], want[:2] + want[2], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_no_bias_no_weights_default_chunk():
    hidden_NE, weight_VE, _, targets_N, _ = inputs(torch.float64)
    want = run(plain_cross_entropy, hidden_NE, weight_VE, None, targets_N, None)
    got = run(linear_cross_entropy, hidden_NE, weight_VE, None, targets_N, None)
    for a, b in zip(got[:2] + got[2], want[:2] + want[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_excluded_ids_never_predicted():
    hidden_NE, weight_VE, _, targets_N, weights_N = inputs(torch.float64)
    _, ce_N, (grad_h, grad_w, _) = run(
        linear_cross_entropy, hidden_NE, weight_VE, None, targets_N, weights_N, exclude_ids=EXCLUDE, chunk_size=4
    )
    # the excluded rows of the head get no gradient, and CE is over the remaining V - 2 classes
    assert float(grad_w[list(EXCLUDE)].abs().max()) == 0.0
    keep = [v for v in range(V) if v not in EXCLUDE]
    logits_NV = hidden_NE.detach() @ weight_VE.detach()[keep].T
    want = logits_NV.logsumexp(1) - (hidden_NE.detach() * weight_VE.detach()[targets_N]).sum(1)
    torch.testing.assert_close(ce_N, want, atol=1e-10, rtol=1e-10)


def test_zero_weights_give_zero_loss_and_grads():
    hidden_NE, weight_VE, bias_V, targets_N, _ = inputs(torch.float64)
    weights_N = torch.zeros(N, dtype=torch.float64, requires_grad=True)
    weighted_sum, ce_N, grads = run(linear_cross_entropy, hidden_NE, weight_VE, bias_V, targets_N, weights_N)
    assert float(weighted_sum) == 0.0 and bool((ce_N > 0).all())
    assert all(float(g.abs().max()) == 0.0 for g in grads[:3])
    torch.testing.assert_close(grads[3], 2.5 * ce_N)  # d loss / d weights = CE


def test_empty_rows():
    hidden_NE, weight_VE, bias_V, targets_N, weights_N = inputs(n=0)
    weighted_sum, ce_N, grads = run(
        linear_cross_entropy, hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_ids=EXCLUDE
    )
    assert float(weighted_sum) == 0.0 and ce_N.shape == (0,)
    assert [tuple(g.shape) for g in grads] == [(0, E), (V, E), (V,), (0,)]
    assert all(float(g.abs().sum()) == 0.0 for g in grads)


def test_bf16_autocast_close_to_float32_reference():
    hidden_NE, weight_VE, bias_V, targets_N, weights_N = inputs(torch.float32)
    h16 = hidden_NE.detach().bfloat16().requires_grad_()  # bf16 activations, float32 weights
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(linear_cross_entropy, h16, weight_VE, bias_V, targets_N, weights_N, exclude_ids=EXCLUDE)
    # the reference sees the same (bf16-representable) values in float32 without autocast
    h32 = h16.detach().float().requires_grad_()
    want = run(plain_cross_entropy, h32, weight_VE, bias_V, targets_N, weights_N, exclude_ids=EXCLUDE)
    assert got[0].dtype == torch.float32 and [g.dtype for g in got[2]] == [torch.bfloat16] + [torch.float32] * 3
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2][0].float(), want[2][0], atol=1e-2, rtol=1e-2)  # rounded to bf16
    for a, b in zip(got[2][1:], want[2][1:], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_no_grad_builds_no_gradient_buffers():
    hidden_NE, weight_VE, _, targets_N, weights_N = (t.detach() if t is not None else t for t in inputs())
    with torch.no_grad(), LiveTensorBytes(exclude=(hidden_NE, weight_VE, targets_N, weights_N)) as tracker:
        weighted_sum, ce_N = linear_cross_entropy(hidden_NE, weight_VE, targets_N, weights_N, chunk_size=4)
    assert not weighted_sum.requires_grad
    # a grad_weight buffer alone would be V * E floats; one chunk's logits are 4 * V
    assert tracker.largest_numel <= 4 * V and tracker.peak_bytes < V * E * 4
    torch.testing.assert_close(ce_N, plain_cross_entropy(hidden_NE, weight_VE, targets_N)[1])


def test_peak_memory_far_below_plain():
    """Peak bytes of tensors alive at once (forward + backward), counted by a TorchDispatchMode.

    The chunked path runs for real on CPU. The plain path runs on the meta device: the same aten
    ops and allocations, no arithmetic (on CPU it takes seconds and 3 GB); the bench runs both on CPU.
    """
    n, v, e = 8192, 32000, 64
    cpu = make_inputs(n, v, e)
    meta = tuple(t.detach().to("meta").requires_grad_(t.requires_grad) for t in cpu)
    peaks, largest = {}, {}
    for name, fn, args in [("chunked", linear_cross_entropy, cpu), ("plain", plain_cross_entropy, meta)]:
        with LiveTensorBytes(exclude=args) as tracker:
            step(fn, args)
        peaks[name], largest[name] = tracker.peak_bytes, tracker.largest_numel
    assert largest["plain"] == n * v  # the tracker sees the full logits of the plain path
    assert largest["chunked"] <= CHUNK_ELEMENTS  # and never anything bigger than a chunk here
    assert peaks["plain"] >= 2 * n * v * 4
    assert peaks["chunked"] * 10 < peaks["plain"], peaks


def certain_inputs(dtype: torch.dtype, softcap: float | None = None):
    """`inputs`, with the even rows' targets their argmax over the valid ids (rows the model gets right) and
    the odd rows' their argmin, so that the certainty term has rows in it, some of them with weight 0."""
    hidden_NE, weight_VE, bias_V, targets_N, weights_N = inputs(dtype)
    with torch.no_grad():
        logits_NV = hidden_NE @ weight_VE.T + bias_V
        logits_NV = logits_NV if softcap is None else softcap * torch.tanh(logits_NV / softcap)
        logits_NV[:, list(EXCLUDE)] = float("-inf")
        argmin_N = logits_NV.masked_fill(logits_NV.isinf(), float("inf")).argmin(1)
        targets_N = torch.where(torch.arange(N) % 2 == 0, logits_NV.argmax(1), argmin_N)
    return hidden_NE, weight_VE, bias_V, targets_N, weights_N


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_certainty_forcing_matches_plain(dtype, tol, chunk_size, softcap):
    """The chunked entropy term and its hand-written logits gradient equal autograd through the reference."""
    args = certain_inputs(dtype, softcap)
    certainty = Certainty(weight=0.7, temperature=0.5)
    outs = {}
    for name, fn in (("plain", plain_cross_entropy), ("chunked", linear_cross_entropy)):
        hidden_NE, weight_VE, bias_V, targets_N, weights_N = args
        total, ce_N, entropy_N, forced_N = fn(
            hidden_NE, weight_VE, targets_N, weights_N, bias_V=bias_V, exclude_ids=EXCLUDE,
            chunk_size=chunk_size, softcap=softcap, certainty=certainty,
        )  # fmt: skip
        grads = torch.autograd.grad(2.5 * total, [hidden_NE, weight_VE, bias_V, weights_N])
        outs[name] = (total.detach(), ce_N, entropy_N, forced_N, *grads)
    forced_N = outs["plain"][3]
    # the rows in the term: the argmax rows with a positive weight (rows 0, 6, 12, ... have weight 0)
    want_forced = (torch.arange(N) % 2 == 0) & (torch.arange(N) % 3 != 0)
    assert torch.equal(forced_N, want_forced) and torch.equal(outs["chunked"][3], want_forced)
    for a, b in zip(outs["chunked"], outs["plain"], strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_certainty_term_is_the_tempered_entropy_of_the_right_rows():
    """The loss grows by weight x sum of H(softmax(logits / T)) over the valid ids of the forced rows."""
    hidden_NE, weight_VE, bias_V, targets_N, weights_N = (t.detach() for t in certain_inputs(torch.float64))
    base, _ = linear_cross_entropy(hidden_NE, weight_VE, targets_N, weights_N, bias_V=bias_V, exclude_ids=EXCLUDE)
    total, _, entropy_N, forced_N = linear_cross_entropy(
        hidden_NE, weight_VE, targets_N, weights_N, bias_V=bias_V, exclude_ids=EXCLUDE, chunk_size=4,
        certainty=Certainty(weight=2.0, temperature=0.25),
    )  # fmt: skip
    keep = [v for v in range(V) if v not in EXCLUDE]
    logits_NV = (hidden_NE @ weight_VE.T + bias_V)[:, keep]
    want_H = torch.distributions.Categorical(logits=logits_NV / 0.25).entropy()
    torch.testing.assert_close(entropy_N, want_H, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(total, base + 2.0 * want_H[forced_N].sum(), atol=1e-10, rtol=1e-10)
    assert 0 < int(forced_N.sum()) < N


def test_certainty_forcing_sharpens_the_right_rows_only():
    """A few gradient steps on the certainty term alone lower the entropy of the rows it holds and leave the
    others' predictions: it never pushes a wrong prediction towards certainty."""
    hidden_NE, weight_VE, bias_V, targets_N, _ = (t.detach() for t in certain_inputs(torch.float64))
    weights_N = torch.ones(N, dtype=torch.float64)
    hidden_NE.requires_grad_()
    certainty = Certainty(weight=1.0, temperature=0.5)
    first = None
    for _ in range(20):
        _, _, entropy_N, forced_N = linear_cross_entropy(
            hidden_NE, weight_VE, targets_N, 0.0 * weights_N, bias_V=bias_V, certainty=certainty
        )
        assert int(forced_N.sum()) == 0  # weight 0 everywhere: no row in the term
        total, _, entropy_N, forced_N = linear_cross_entropy(
            hidden_NE, weight_VE, targets_N, 1e-12 * weights_N, bias_V=bias_V, certainty=certainty
        )
        first = (entropy_N, forced_N) if first is None else first
        (grad,) = torch.autograd.grad(total, [hidden_NE])
        assert float(grad[~first[1]].abs().max()) < 1e-9  # the wrong rows get (next to) nothing
        with torch.no_grad():
            hidden_NE -= 0.5 * grad
    assert bool((entropy_N[first[1]] < first[0][first[1]]).all())


def test_certainty_forcing_refuses_bad_settings():
    with pytest.raises(ValueError, match="temperature > 0"):
        Certainty(weight=1.0, temperature=0.0)
    with pytest.raises(ValueError, match="weight >= 0"):
        Certainty(weight=-1.0)
