"""flash-linear-attention's chunked gated delta rule (models/fla_rule.py, `model.linear_attention_kernel: fla`)
against the pure-torch chunked form, the reference, on the same bf16 inputs (skipped without a CUDA GPU or
without the fla package; this project's CI and development machines have neither, so these tests have not run
there: a GPU session runs them through `make gpu-check`, whose section delta_rule makes the same comparison).

The reference computes in float32 from the same bf16-rounded inputs; the kernel in bf16 with float32
accumulation, so the bound is bf16's: max |fla - torch| <= ATOL + RTOL * max |torch|.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models import Transformer, gated_delta
from dllm.models.fla_rule import FlaRule, load_kernel

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(load_kernel() is None, reason="needs the flash-linear-attention package (fla)"),
]
CUDA = torch.device("cuda")
ATOL, RTOL = 2e-2, 2e-2


def rule_inputs(B: int, H: int, L: int, K: int, V: int, with_state: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 queries (L2-normalised, scaled by K^-1/2), keys (L2-normalised), values; float32 log decays and
    write strengths (rounded to bf16, as the adapter hands them), an initial state or none."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = F.normalize(torch.randn(B, H, L, K, device=CUDA, generator=g), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(B, H, L, K, device=CUDA, generator=g), dim=-1)
    return {
        "q_BHLK": q.bfloat16(), "k_BHLK": k.bfloat16(),
        "v_BHLV": torch.randn(B, H, L, V, device=CUDA, generator=g).bfloat16(),
        "g_BHL": -F.softplus(torch.randn(B, H, L, device=CUDA, generator=g)),
        "beta_BHL": torch.rand(B, H, L, device=CUDA, generator=g).bfloat16().float(),
        "state_BHKV": torch.randn(B, H, K, V, device=CUDA, generator=g) * 0.1 if with_state else None,
    }  # fmt: skip


def within(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    diff = float((got.float() - want.float()).abs().max())
    return diff <= ATOL + RTOL * float(want.float().abs().max()), diff


def compare_rule(B: int, H: int, L: int, K: int, V: int, with_state: bool) -> dict[str, float | bool]:
    """fla's outputs and final state against `gated_delta.chunked` (float32 over the same inputs)."""
    x = rule_inputs(B, H, L, K, V, with_state)
    rule = FlaRule()
    assert rule.takes(x["v_BHLV"], None)
    out, S = rule(**x)
    ref_out, ref_S = gated_delta.chunked(**{n: (t.float() if t is not None else None) for n, t in x.items()})
    ok_out, d_out = within(out, ref_out)
    ok_S, d_S = within(S, ref_S)
    return {"ok": ok_out and ok_S, "out_max_abs_diff": d_out, "state_max_abs_diff": d_S}


@pytest.mark.parametrize(("B", "H", "L", "K", "V"), [(2, 4, 256, 64, 64), (1, 8, 300, 128, 128), (3, 2, 17, 32, 48)])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_rule_equals_the_torch_rule(B: int, H: int, L: int, K: int, V: int, with_state: bool):
    result = compare_rule(B, H, L, K, V, with_state)
    assert result["ok"], result


def compare_model(L: int = 200) -> dict[str, float | bool]:
    """A random qwen3_5 in bf16 on CUDA, the same weights with each kernel: the logits of a causal forward."""
    fields = dict(family="qwen3_5", preset="tiny", vocab_size=256, num_layers=4, hidden_size=128, num_heads=4,
                  num_kv_heads=2, init_std=0.05)  # fmt: skip
    models = [Transformer(ModelConfig(**fields, linear_attention_kernel=kind)) for kind in ("torch", "fla")]
    models[0].init_weights(torch.Generator().manual_seed(0))
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(1)).to(CUDA)
    pos = torch.arange(L, device=CUDA).expand(2, L)
    with torch.no_grad():
        torch_logits, fla_logits = (
            m.to(CUDA, torch.bfloat16).eval()(x, pos, AttentionMask("causal")).logits() for m in models
        )
    ok, diff = within(fla_logits, torch_logits)
    return {"ok": ok, "logits_max_abs_diff": diff}


def test_a_bf16_hybrid_gives_the_same_logits_with_either_kernel():
    result = compare_model()
    assert result["ok"], result
