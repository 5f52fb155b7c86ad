"""The gated delta rule: our chunked form equals transformers' recurrent reference (to 1e-5: the
reference computes in float32) and our recurrent form (1e-5 in float32, 1e-12 in float64), outputs and
final state, from a zero or a given initial state, lengths that are and are not whole chunks; the final
state continues a split sequence exactly; gradients agree."""

from __future__ import annotations

import pytest
import torch

from dllm.models import gated_delta

B, H, K, V = 2, 3, 8, 6


def _inputs(L: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q = torch.nn.functional.normalize(randn(B, H, L, K), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(randn(B, H, L, K), dim=-1)
    g = -torch.nn.functional.softplus(randn(B, H, L)) * 0.5  # log decays <= 0
    beta = torch.sigmoid(randn(B, H, L))
    return {"q_BHLK": q, "k_BHLK": k, "v_BHLV": randn(B, H, L, V), "g_BHL": g, "beta_BHL": beta}


def _reference(x: dict[str, torch.Tensor], state: torch.Tensor | None):
    """transformers' token-by-token reference; it takes [B, L, H, .] and scales queries by K^-0.5 itself."""
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    t = lambda a: a.transpose(1, 2)  # noqa: E731
    out, S = qwen.torch_recurrent_gated_delta_rule(
        t(x["q_BHLK"]) * K**0.5, t(x["k_BHLK"]), t(x["v_BHLV"]), t(x["g_BHL"]), t(x["beta_BHL"]),
        initial_state=state, output_final_state=True,
    )  # fmt: skip
    return t(out), S


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("L,chunk", [(64, 16), (37, 16), (5, 8), (20, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_the_recurrent_reference(dtype, tol, L, chunk, with_state):
    x = _inputs(L, dtype)
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(9), dtype=dtype) if with_state else None
    ref_out, ref_S = _reference(x, state)
    out, S = gated_delta.chunked(**x, state_BHKV=state, chunk=chunk)
    ours_out, ours_S = gated_delta.recurrent(**x, state_BHKV=state)
    assert out.dtype == dtype and S.shape == (B, H, K, V)
    for a, b in ((out, ref_out), (S, ref_S)):  # the reference computes in float32 whatever it is given
        torch.testing.assert_close(a, b.to(dtype), atol=1e-5, rtol=0)
    for a, b in ((out, ours_out), (S, ours_S)):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


def test_the_final_state_continues_a_split_sequence():
    x = _inputs(48, torch.float64, seed=3)
    whole, S_whole = gated_delta.chunked(**x, chunk=16)
    first = {k: v[:, :, :20] for k, v in x.items()}
    rest = {k: v[:, :, 20:] for k, v in x.items()}
    a, S = gated_delta.chunked(**first, chunk=16)
    b, S_end = gated_delta.chunked(**rest, state_BHKV=S, chunk=16)
    torch.testing.assert_close(torch.cat([a, b], dim=2), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(S_end, S_whole, atol=1e-12, rtol=0)


@pytest.mark.parametrize("segments", [False, True])
def test_gradients_match_the_recurrent_form(segments: bool):
    x = {k: v.requires_grad_() for k, v in _inputs(21, torch.float64, seed=5).items()}
    start = (torch.arange(21) % 6 == 5).expand(B, 21) if segments else None
    out, S = gated_delta.chunked(**x, chunk=8, start_BL=start)
    grads = torch.autograd.grad((out.sin().sum() + S.cos().sum()), list(x.values()))
    out_r, S_r = gated_delta.recurrent(**x, start_BL=start)
    grads_r = torch.autograd.grad((out_r.sin().sum() + S_r.cos().sum()), list(x.values()))
    for a, b in zip(grads, grads_r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_block_reads_write_the_whole_block_then_read_its_end_state():
    """Block n starts from its own state, writes its tokens, and each token reads the state after the block."""
    x = _inputs(12, torch.float64, seed=7)
    starts = torch.randn(B, H, 3, K, V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = gated_delta.block_reads(**x, starts_BHNKV=starts, block=4)
    for n in range(3):
        part = {k: v[:, :, 4 * n : 4 * n + 4] for k, v in x.items()}
        _, end = gated_delta.recurrent(**part, state_BHKV=starts[:, :, n])
        want = torch.einsum("bhlk,bhkv->bhlv", part["q_BHLK"], end)
        torch.testing.assert_close(out[:, :, 4 * n : 4 * n + 4], want, atol=1e-12, rtol=0)


def test_chunk_start_states():
    x = _inputs(10, torch.float64, seed=8)
    _, S, starts = gated_delta.chunked_states(**x, chunk=4)
    assert starts.shape == (B, H, 3, K, V) and not starts[:, :, 0].any()
    for n in (1, 2):
        _, want = gated_delta.recurrent(**{k: v[:, :, : 4 * n] for k, v in x.items()})
        torch.testing.assert_close(starts[:, :, n], want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("L,chunk", [(37, 8), (16, 16), (9, 64)])
def test_segment_starts_zero_the_state(L, chunk):
    """A segment start zeroes the state before its token: chunked equals recurrent, and each segment alone."""
    x = _inputs(L, torch.float64, seed=11)
    start = torch.zeros(B, L, dtype=torch.bool)
    start[0, [i for i in (3, 7, 8, 20) if i < L]] = True
    start[1, [0, L - 1]] = True
    state = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, S = gated_delta.chunked(**x, state_BHKV=state, chunk=chunk, start_BL=start)
    ref, S_ref = gated_delta.recurrent(**x, state_BHKV=state, start_BL=start)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-12, rtol=0)
    last = int(start[0].nonzero().max())  # row 0's last segment, alone from a zero state
    alone, S_alone = gated_delta.recurrent(**{k: v[:1, :, last:] for k, v in x.items()})
    torch.testing.assert_close(out[:1, :, last:], alone, atol=1e-12, rtol=0)
    torch.testing.assert_close(S[:1], S_alone, atol=1e-12, rtol=0)
