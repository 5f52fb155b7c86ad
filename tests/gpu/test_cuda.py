"""The CUDA fast paths against their references, on the same inputs (skipped without a GPU; CI has none).

Run on a GPU host with `pytest tests/gpu`. Each test checks a path that only a GPU takes by default:
compiled FlexAttention for the model's masks, the DFlash drafter's BlockMask in training (forward and
backward: FlexAttention has no CPU backward), speculative decoding against the KV cache in CUDA
kernels, and a compiled training step.
"""

from __future__ import annotations

import pytest
import torch

from dllm.attention.backends.flex import FlexBackend
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask
from dllm.config.drafter import DFlashConfig
from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models.dflash import DFlashDrafter, DraftTokens
from dllm.models.transformer import Transformer
from dllm.sampling.canvas import SpecialIds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")
V, MASK = 96, 95


def masks(B: int, L: int) -> dict[str, AttentionMask]:
    g = torch.Generator().manual_seed(0)
    valid = torch.ones(B, L, dtype=torch.bool)
    valid[0, L - 5 :] = False
    docs = torch.cumsum(torch.rand(B, L, generator=g) < 0.05, dim=1)
    return {
        "key_padding": AttentionMask("bidirectional", key_valid_BL=valid.to(CUDA)),
        "documents_causal": AttentionMask("causal", doc_ids_BL=docs.to(CUDA)),
        "block_causal": AttentionMask("block_causal", block_size=16),
        "window": AttentionMask("causal", window=24),
    }


@pytest.mark.parametrize(
    ("name", "dtype"),
    [(name, torch.float32) for name in ("key_padding", "documents_causal", "block_causal", "window")]
    + [("documents_causal", torch.bfloat16)],
)
def test_compiled_flex_equals_sdpa_forward_and_backward(name: str, dtype: torch.dtype):
    B, H, K, L, D = 2, 4, 2, 160, 32
    g = torch.Generator(device=CUDA).manual_seed(1)
    q, k, v = (torch.randn(B, h, L, D, device=CUDA, dtype=dtype, generator=g) for h in (H, K, K))
    mask = masks(B, L)[name]
    outs, grads = [], []
    for attend in (FlexBackend(compiled=True), sdpa_attention):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*qkv, mask)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in qkv])
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, **tol)


def make_target(**over) -> Transformer:
    cfg = ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=V, **over)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(CUDA).eval()


def make_drafter(target: Transformer, block: int, backend: str) -> DFlashDrafter:
    tcfg = target.cfg.model_copy(update={"attention_backend": backend, "flex_compile": True})
    cfg = DFlashConfig(num_layers=2, block_size=block, target_layer_ids=(0, 2), mask_id=MASK, target=tcfg)
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(1))
    return drafter.to(CUDA).attach(target)


@pytest.mark.parametrize("documents", [False, True])
def test_drafter_block_mask_equals_the_dense_draft_mask_with_gradients(documents):
    """Training: `auto` on CUDA builds the draft mask as a BlockMask (compiled FlexAttention, with a
    backward on GPU); its states and gradients equal the dense-mask SDPA drafter's (also with packed
    documents: each block reads context from its document's start)."""
    target = make_target()
    b, A, B, C = 4, 6, 2, 40
    g = torch.Generator().manual_seed(2)
    context = torch.randn(B, C, 2 * 64, generator=g).to(CUDA)
    lens = torch.sort(torch.randint(1, C, (B, A), generator=g), dim=1).values.to(CUDA)
    ids = torch.full((B, A * b), MASK, device=CUDA)
    ids[:, ::b] = torch.randint(0, V - 1, (B, A), generator=g).to(CUDA)
    positions = (lens[:, :, None] + torch.arange(b, device=CUDA)).reshape(B, A * b)
    starts = (lens * torch.rand(B, A, generator=g).to(CUDA)).long() if documents else None  # in [0, len)
    tokens = DraftTokens(ids, context, lens, starts)
    flex, dense = make_drafter(target, b, "auto"), make_drafter(target, b, "sdpa")
    dense.load_state_dict(flex.state_dict())
    results = []
    for drafter in (flex, dense):
        hidden = drafter(tokens, positions).hidden_BLE
        hidden.square().sum().backward()
        q_grad = drafter.layers[0].self_attn.q_proj.weight.grad
        results.append((hidden.detach(), drafter.fc.weight.grad.clone(), q_grad))
    for a, b_ in zip(*results, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 8])
def test_speculative_decoding_on_cuda_is_lossless(batch: int):
    """Greedy speculative decoding with a (random) DFlash drafter on CUDA equals the target's own greedy AR
    decoding token for token, over rows of different prompt lengths."""
    target = make_target()
    drafter = make_drafter(target, 4, "auto").eval()
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 12, (batch,), generator=g).tolist()
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in lengths]
    cfg, special = causal_sampler(24)
    spec = generate(target, prompts, cfg, special, drafter=drafter)
    assert spec.sequences == generate(target, prompts, cfg, special).sequences
    assert spec.counters.nfe <= cfg.gen_length + 1  # a random drafter may never be right


def test_cached_ar_decoding_on_cuda_equals_recomputation():
    target = make_target()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    cfg, special = causal_sampler(16)
    cached = generate(target, prompts, cfg, special)
    with torch.inference_mode():
        plain = generate(target, prompts, cfg, special, recompute=True)
    assert cached.sequences == plain.sequences


def causal_sampler(n: int) -> tuple[SamplerConfig, SpecialIds]:
    """Greedy causal decoding of n tokens, no EOS (every row runs n tokens)."""
    return SamplerConfig(generation="causal", gen_length=n, stop_at_eos=False), SpecialIds(MASK, 0, 0)


def test_compiled_training_step_equals_eager_on_cuda():
    """A compiled model's loss and gradients equal the eager model's on the same batch (block-diffusion
    mask: the flex path)."""
    from dllm.models.transformer import Transformer as T

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=V)
    eager = T(cfg)
    eager.init_weights(torch.Generator().manual_seed(0))
    eager = eager.to(CUDA)
    compiled_model = T(cfg).to(CUDA)
    compiled_model.load_state_dict(eager.state_dict())
    step = torch.compile(compiled_model)
    B, L = 2, 64
    tokens = torch.randint(0, V - 1, (B, L), device=CUDA)
    positions = torch.arange(L, device=CUDA).expand(B, L)
    mask = AttentionMask("block_causal", block_size=16)
    losses = []
    for model, call in ((eager, eager), (compiled_model, step)):
        logits = call(tokens, positions, mask).logits()
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append((loss.detach(), model.layers[0].mlp.down_proj.weight.grad.clone()))
    torch.testing.assert_close(losses[0][0], losses[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(losses[0][1], losses[1][1], atol=1e-4, rtol=1e-4)
