"""The optional flash-linear-attention path of the linear layers (models/fla_rule.py), checked without a GPU
and without the fla package: the adapter hands a stand-in of the kernel's documented contract ([B, T, H, *]
tensors, a `scale`, an initial state [B, H, K, V], (o, final_state) back) exactly what the torch rule reads,
and its answer equals the torch rule's; the cases the kernel does not take (CPU or CUDA float32/float64 rows,
document starts) run the torch rule itself; a model that asks for fla where it is not installed warns and
computes what the torch rule computes, bit for bit. The kernel itself is compared on a GPU by
tests/gpu/test_fla.py and bench/gpu_check.py (section delta_rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models import Transformer, gated_delta
from dllm.models.fla_rule import FlaRule, load_kernel

B, H, L, K, V = 2, 3, 37, 8, 6


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = F.normalize(torch.randn(B, H, L, K, generator=g), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, H, L, K, generator=g), dim=-1)
    return {
        "q_BHLK": q.to(dtype), "k_BHLK": k.to(dtype), "v_BHLV": torch.randn(B, H, L, V, generator=g).to(dtype),
        "g_BHL": -torch.rand(B, H, L, generator=g), "beta_BHL": torch.rand(B, H, L, generator=g),
        "state_BHKV": torch.randn(B, H, K, V, generator=g),
    }  # fmt: skip


class StandIn:
    """fla's `chunk_gated_delta_rule` contract, computed by the recurrent reference; records what it was given."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False):  # fmt: skip
        self.calls.append(dict(shapes=[t.shape for t in (q, k, v, g, beta)], dtypes=[t.dtype for t in (q, g, beta)],
                               scale=scale, l2=use_qk_l2norm_in_kernel, state=initial_state))  # fmt: skip
        assert output_final_state and all(t.is_contiguous() for t in (q, k, v, g, beta))
        q = q.float() * (k.shape[-1] ** -0.5 if scale is None else scale)
        to_bhl = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
        o, S = gated_delta.recurrent(*to_bhl, state_BHKV=initial_state)
        return o.transpose(1, 2).to(v.dtype), S


def test_the_adapter_hands_the_kernel_what_the_torch_rule_reads():
    x = _inputs(torch.bfloat16)
    kernel = StandIn()
    rule = FlaRule(kernel, device_types=("cpu",))
    assert rule.takes(x["v_BHLV"], None)
    out, S = rule(**x)
    call = kernel.calls[0]
    assert call["shapes"] == [(B, L, H, K), (B, L, H, K), (B, L, H, V), (B, L, H), (B, L, H)]
    assert call["dtypes"] == [torch.bfloat16, torch.float32, torch.bfloat16] and call["scale"] == 1.0
    assert not call["l2"] and call["state"].dtype == torch.float32
    want_out, want_S = gated_delta.chunked(**{k: v.float() if k != "beta_BHL" else v.bfloat16().float()
                                              for k, v in x.items()})  # fmt: skip
    assert out.dtype == torch.bfloat16 and S.dtype == torch.float32 and out.shape == (B, H, L, V)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=0)  # the stand-in's output is bf16
    torch.testing.assert_close(S, want_S, atol=1e-5, rtol=0)


def test_what_the_kernel_does_not_take_runs_the_torch_rule():
    kernel = StandIn()
    on_cuda = FlaRule(kernel)  # the real device types: a CPU tensor is not for the kernel
    x = _inputs(torch.bfloat16)
    torch.testing.assert_close(on_cuda(**x)[0], gated_delta.chunked(**x)[0], atol=0, rtol=0)
    here = FlaRule(kernel, device_types=("cpu",))
    x32 = _inputs(torch.float32)
    torch.testing.assert_close(here(**x32)[0], gated_delta.chunked(**x32)[0], atol=0, rtol=0)
    start = torch.zeros(B, L, dtype=torch.bool)
    start[:, 10] = True
    torch.testing.assert_close(here(**x, start_BL=start)[0], gated_delta.chunked(**x, start_BL=start)[0], atol=0,
                               rtol=0)  # fmt: skip
    assert kernel.calls == []


@pytest.mark.skipif(load_kernel() is not None, reason="fla is installed here")
def test_a_model_asking_for_fla_without_it_warns_and_runs_the_torch_rule():
    fields = dict(family="qwen3_5", preset="tiny", vocab_size=48, num_layers=4)
    torch_model = Transformer(ModelConfig(**fields))
    torch_model.init_weights(torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="fla.* is not installed"):
        fla_model = Transformer(ModelConfig(**fields, linear_attention_kernel="fla"))
    fla_model.load_state_dict(torch_model.state_dict())
    x = torch.randint(0, 48, (2, 20), generator=torch.Generator().manual_seed(1))
    pos, mask = torch.arange(20).expand(2, 20), AttentionMask("causal")
    with torch.no_grad():
        assert torch.equal(fla_model(x, pos, mask).logits(), torch_model(x, pos, mask).logits())
