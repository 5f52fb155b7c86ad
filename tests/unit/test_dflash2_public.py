"""DFlash2 drafters in the public layout (z-lab's DFlash2DraftModel): a drafter saved here loads into the dflash
package and gives its draft logits and selected drafts from the same target features; a drafter built and saved by
the package loads here and proposes its tokens; speculative decoding with a public-layout DFlash2 drafter (its
candidate selector picking the drafts) is lossless at batch 1 and 8; one that does not fit the target is refused in
one line by the CLI.

The reference is the `dflash` package (release 0.1.0, an optional test dependency of the dev extra): tests that need
it skip without it. Helpers (the tiny target, its features) are test_dflash_public's.

Shapes: B batch, C context positions, b block size, E hidden, F features, V vocab.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.drafter import DFlashConfig, DynamicConvConfig, SelectorConfig
from dllm.models.dflash import DraftTokens
from dllm.models.dflash2 import DFlash2Drafter, dynamic_causal_conv
from dllm.models.dflash_io import load_drafter, save_drafter
from dllm.models.transformer import Transformer
from tests.unit.test_dflash_public import (
    LAYERS,
    MASK,
    V,
    dflash_package,
    draft_block,
    features,
    hf_target,
    make_target,
    tokens,
)

CONV, SELECTOR = DynamicConvConfig(kernel_size=3, group_size=8), SelectorConfig(rank=8, top_k=6)


def dflash2_config(target_cfg, **over) -> DFlashConfig:
    values = {"num_layers": 2, "block_size": 4, "target_layer_ids": LAYERS, "mask_id": MASK, "target": target_cfg,
              "architecture": "dflash2", "conv": CONV, "selector": SELECTOR, **over}  # fmt: skip
    return DFlashConfig(**values)


def randomize(drafter: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms in [0.5, 1.5], the rest 0.3 N(0, 1)): nothing near an identity hides a
    misplaced part."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            noise = (
                torch.rand(p.shape, generator=g) if name.endswith("norm.weight") else torch.randn(p.shape, generator=g)
            )
            p.copy_(0.5 + noise if name.endswith("norm.weight") else 0.3 * noise)


def make_dflash2(target: Transformer, seed: int = 1, **over) -> DFlash2Drafter:
    drafter = DFlash2Drafter(dflash2_config(target.cfg, **over))
    randomize(drafter, seed)
    return drafter.attach(target).eval()


def reference_conv(x_BLE, dynamic_BLkG, base_kE, group):
    """The public convolution as its docstring states it, one row and tap at a time (the plain reference)."""
    B, L, E = x_BLE.shape
    y = torch.zeros_like(x_BLE)
    for l in range(L):  # noqa: E741
        for o in range(min(base_kE.shape[0], l + 1)):
            y[:, l] += (base_kE[o] + dynamic_BLkG[:, l, o].repeat_interleave(group, -1)) * x_BLE[:, l - o]
    return y


def test_the_convolution_is_causal_inside_each_block():
    """Blocks of 4 rows in one sequence: each convolved as on its own (the row-and-tap reference), nothing
    read across a block boundary."""
    g = torch.Generator().manual_seed(0)
    x, dyn, base = (
        torch.randn(2, 12, 16, generator=g),
        torch.randn(2, 12, 3, 2, generator=g),
        torch.randn(3, 16, generator=g),
    )
    y = dynamic_causal_conv(x, dyn, base, 4)
    for a in range(3):
        rows = slice(4 * a, 4 * a + 4)
        torch.testing.assert_close(y[:, rows], reference_conv(x[:, rows], dyn[:, rows], base, 8), atol=1e-6, rtol=0)


def test_a_dflash2_config_names_both_parts_and_fits_the_target():
    target = make_target()
    with pytest.raises(ValueError, match="conv and selector are required"):
        dflash2_config(target.cfg, selector=None)
    with pytest.raises(ValueError, match="conv and selector are DFlash2 parts"):
        dflash2_config(target.cfg, architecture="dflash")
    with pytest.raises(ValueError, match="conv.group_size 5 does not divide the hidden size 32"):
        dflash2_config(target.cfg, conv=DynamicConvConfig(kernel_size=3, group_size=5))
    with pytest.raises(ValueError, match="selector.top_k 99 is more than the vocabulary of 64"):
        dflash2_config(target.cfg, selector=SelectorConfig(rank=4, top_k=99))
    with pytest.raises(ValueError, match="output_multiplier, final_logit_softcapping"):
        DFlashConfig(target_layer_ids=LAYERS, mask_id=MASK, target=target.cfg, output_multiplier=2.0)
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 drafter blocks"):
        dflash2_config(target.cfg, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="sliding_attention blocks but sliding_window is not set"):
        dflash2_config(target.cfg, layer_types=["sliding_attention", "full_attention"])
    kinds = dflash2_config(target.cfg, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    assert [kinds.layer_kind(i) for i in (0, 1)] == [(True, 3), (False, None)]
    assert dflash2_config(target.cfg, causal=True).layer_kind(1) == (True, None)


# --------------------------------------------------------------------------------------------------
# a DFlash2 drafter saved here is the package's DFlash2DraftModel


def test_a_saved_dflash2_drafter_loads_into_the_dflash_package(tmp_path: Path):
    """Saved in the public layout (its config and weight names as the package reads them), loaded by
    DFlash2DraftModel.from_pretrained: the same draft logits from the target's features (the package's own
    extract_context_feature over Hugging Face hidden states; float32, 1e-4), output multiplier and softcapping
    included, and its selector picks the same drafts, greedy."""
    dflash = dflash_package()
    target = make_target()
    drafter = make_dflash2(target, output_multiplier=0.8, final_logit_softcapping=6.0, input_embedding_scale=1.5)
    with torch.no_grad():  # a selector strong enough that its chain is not the argmax
        drafter.candidate_selector.predecessor_codebook.mul_(4.0)
    folder = save_drafter(tmp_path / "drafter", drafter)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": MASK, "conv_kernel_size": 3,
        "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6, "input_embedding_scale": 1.5,
        "output_multiplier": 0.8, "final_logit_softcapping": 6.0,
    }  # fmt: skip
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["layers.1.attention_conv.base_kernel"] == (2, 3, 32)
    assert shapes["layers.0.mlp_conv.kernel_projection.weight"] == (2 * 3 * 4, 32)
    assert (
        shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == (V, 8)
    )
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, 32)

    ref = dflash.DFlash2DraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    hf = hf_target(target, tmp_path / "target")
    x, C = tokens(), 12
    with torch.no_grad():
        context = dflash.extract_context_feature(hf(x, output_hidden_states=True).hidden_states, ref.target_layer_ids)
        block = draft_block(9)
        hidden = ref(position_ids=torch.arange(C + 4)[None], noise_embedding=1.5 * hf.model.embed_tokens(block),
                     target_hidden=context)[:, 1:]  # fmt: skip
        theirs = ref.compute_logits(hidden, hf.lm_head)
        their_drafts, _, _ = ref.propose(hidden, block[:, 0], hf.lm_head, 0.0)
        out = drafter(DraftTokens(block, features(target, x), torch.tensor([[C]])), C + torch.arange(4)[None])
        ours = drafter.draft_logits(out.hidden_BLE[:, 1:])
        our_drafts, q = drafter.candidate_selector.select(out.hidden_BLE[:, 1:], ours, block[:, 0], 0.0)
    diff = (ours - theirs).abs().max().item()
    print(f"dflash2 saved here vs the package: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4 and q is None
    assert torch.equal(our_drafts, their_drafts) and not torch.equal(our_drafts, ours.argmax(-1))


KINDS = [  # (layer_types, is_causal): sliding and causal blocks as the public config names them
    (["sliding_attention", "full_attention"], None),
    (["full_attention", "full_attention"], True),
    (["sliding_attention", "sliding_attention"], False),
]


@pytest.mark.parametrize(("layer_types", "causal"), KINDS)
def test_sliding_and_causal_blocks_compute_the_package_forward(tmp_path: Path, layer_types, causal):
    """Blocks with a sliding window of 5 (shorter than the 12 context positions) and/or causal inside the draft
    block, saved here and loaded by the package: the same draft logits (1e-4)."""
    dflash = dflash_package()
    target = make_target()
    drafter = make_dflash2(target, layer_types=layer_types, sliding_window=5, causal=causal)
    folder = save_drafter(tmp_path / "drafter", drafter)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == layer_types and config["sliding_window"] == 5 and config.get("is_causal") == causal
    ref = dflash.DFlash2DraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    x, C, block = tokens(), 12, draft_block(9)
    with torch.no_grad():
        feats = features(target, x)
        hidden = ref(position_ids=torch.arange(C + 4)[None], noise_embedding=target.embed_tokens(block),
                     target_hidden=feats)[:, 1:]  # fmt: skip
        theirs = ref.compute_logits(hidden, target.lm_head)
        ours = drafter(DraftTokens(block, feats, torch.tensor([[C]])), C + torch.arange(4)[None]).logits()[:, 1:]
        plain = make_dflash2(target)(DraftTokens(block, feats, torch.tensor([[C]])), C + torch.arange(4)[None])
    diff = (ours - theirs).abs().max().item()
    print(f"dflash2 {layer_types} causal={causal} vs the package: max |logit diff| {diff:.2e}")
    assert diff <= 1e-4 and not torch.allclose(ours, plain.logits()[:, 1:], atol=1e-3)


@pytest.mark.parametrize(("layer_types", "causal"), [(None, None), *KINDS])
def test_the_dflash2_decoding_path_equals_the_training_forward(layer_types, causal):
    """Two rows at anchors 12 and 9 (one rewrite of rejected positions between the extends) through start, extend
    and propose == the training forward of each row alone; and one training forward over both anchors of a row
    == two forwards of one anchor each (each block convolved and masked on its own)."""
    target = make_target()
    drafter = make_dflash2(target, layer_types=layer_types, sliding_window=5, causal=causal)
    x = torch.randint(0, MASK, (2, 20), generator=torch.Generator().manual_seed(6))
    feats = features(target, x)
    state = drafter.start(2, 32)
    drafter.extend(state, feats[:, :7], torch.arange(7).expand(2, 7))
    drafter.extend(state, torch.randn(2, 6, feats.shape[-1]), torch.arange(7, 13).expand(2, 6))
    drafter.extend(state, feats[:, 7:12], torch.arange(7, 12).expand(2, 5))
    anchor_pos = torch.tensor([12, 9])
    logits = drafter.propose(state, x.gather(1, anchor_pos[:, None])[:, 0], anchor_pos)
    alone = []
    for r, p in enumerate(anchor_pos.tolist()):
        inp = DraftTokens(draft_block(int(x[r, p])), feats[r : r + 1, :p], torch.tensor([[p]]))
        with torch.no_grad():
            alone.append(drafter(inp, p + torch.arange(4)[None]).logits())
        torch.testing.assert_close(logits[r : r + 1], alone[-1][:, 1:], atol=1e-5, rtol=1e-5)
    both = DraftTokens(torch.cat([draft_block(int(x[1, 9])), draft_block(int(x[1, 12]))], 1), feats[1:, :12],
                       torch.tensor([[9, 12]]))  # fmt: skip
    with torch.no_grad():
        out = drafter(both, torch.cat([9 + torch.arange(4), 12 + torch.arange(4)])[None]).logits()
        first = drafter(DraftTokens(draft_block(int(x[1, 12])), feats[1:, :12], torch.tensor([[12]])),
                        12 + torch.arange(4)[None]).logits()  # fmt: skip
    torch.testing.assert_close(out[:, :4], alone[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 4:], first, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("layer_types", "causal"), KINDS)
def test_flex_block_masks_of_sliding_and_causal_blocks_equal_the_dense_masks(layer_types, causal):
    """attention_backend flex (eager FlexAttention, forward on CPU): the training forward over two anchors of two
    documents, with sliding or causal blocks, equals the dense-mask SDPA forward."""
    target = make_target()
    dense = make_dflash2(target, layer_types=layer_types, sliding_window=5, causal=causal)
    flex_target = target.cfg.model_copy(update={"attention_backend": "flex", "flex_compile": False})
    flex = DFlash2Drafter(dense.dcfg.model_copy(update={"target": flex_target})).attach(target).eval()
    flex.load_state_dict(dense.state_dict())
    x = torch.randint(0, MASK, (1, 20), generator=torch.Generator().manual_seed(6))
    ids = torch.cat([draft_block(int(x[0, 9])), draft_block(int(x[0, 16]))], 1)
    inp = DraftTokens(ids, features(target, x), torch.tensor([[9, 16]]), torch.tensor([[0, 11]]))
    positions = torch.cat([9 + torch.arange(4), 5 + torch.arange(4)])[None]  # the second document restarts at 11
    with torch.no_grad():
        torch.testing.assert_close(flex(inp, positions).hidden_BLE, dense(inp, positions).hidden_BLE, atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


def test_dflash2_folders_convert_between_the_formats(tmp_path: Path):
    """A public DFlash2 folder written in dllm's format (with its target) and back: the same weights, config
    entries and proposals."""
    from dllm.models.dflash_io import convert_dllm_folder, save_dllm, target_identity

    target = make_target()
    drafter = make_dflash2(target, layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                           output_multiplier=0.5)  # fmt: skip
    public = save_drafter(tmp_path / "public", drafter)
    save_dllm(tmp_path / "dllm", load_drafter(public, target), target_identity(target))
    assert json.loads((tmp_path / "dllm" / "config.json").read_text())["conv"] == CONV.model_dump()
    again = convert_dllm_folder(tmp_path / "dllm", tmp_path / "again")
    configs = [json.loads((f / "config.json").read_text()) for f in (tmp_path / "again", public)]
    for c in configs:
        c.pop("initializer_range")  # the blocks' init std: not recorded in dllm's format (the weights are)
    assert configs[0] == configs[1]
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (public / "model.safetensors").read_bytes()
    x = tokens(20)
    ours, theirs = proposals(drafter, target, x, [5, 11]), proposals(again.attach(target).eval(), target, x, [5, 11])
    for (a, da), (b, db) in zip(ours, theirs, strict=True):
        assert torch.equal(a, b) and torch.equal(da, db)


def proposals(drafter, target: Transformer, x: torch.Tensor, anchors: list[int]):
    """(logits [1, b-1, V], selected drafts [1, b-1]) at each anchor through the decoding path (one state)."""
    feats = features(target, x, drafter.target_layer_ids)
    state, done, out = drafter.start(1, 32), 0, []
    for p in anchors:
        drafter.extend(state, feats[:, done:p], torch.arange(done, p)[None])
        logits = drafter.propose(state, x[:, p], torch.tensor([p]))
        out.append((logits, drafter.select_drafts(state, logits, x[:, p], 0.0)[0]))
        done = p
    return out


def test_a_dflash2_drafter_built_by_the_dflash_package_proposes_its_tokens(tmp_path: Path):
    """DFlash2DraftModel built by the package (blocks of their own widths and RoPE base, random weights), saved with
    its save_pretrained, loads here; at anchors 4, 9 and 15 the decoding path gives the package forward's logits
    (1e-4) and its selector's drafts."""
    dflash = dflash_package()
    from transformers import Qwen3Config

    dflash_config = {"target_layer_ids": [1, 2], "mask_token_id": MASK, "conv_kernel_size": 2, "conv_group_size": 16,
                     "selector_rank": 4, "selector_top_k": 5, "output_multiplier": 1.25}  # fmt: skip
    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=V, rope_theta=5000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=256, tie_word_embeddings=False, layer_types=["full_attention"] * 2,
                         num_target_layers=4, block_size=4, dflash_config=dflash_config,
                         architectures=["DFlash2DraftModel"])  # fmt: skip
    ref = dflash.DFlash2DraftModel(config).eval()
    randomize(ref, seed=3)
    ref.save_pretrained(str(tmp_path / "public"))
    target = make_target()
    drafter = load_drafter(tmp_path / "public", target)
    assert isinstance(drafter, DFlash2Drafter) and drafter.dcfg.conv == DynamicConvConfig(kernel_size=2, group_size=16)
    x, anchors, worst = tokens(20), [4, 9, 15], 0.0
    feats = features(target, x, (1, 2))
    for p, (logits, drafts) in zip(anchors, proposals(drafter, target, x, anchors), strict=True):
        block = draft_block(int(x[0, p]))
        with torch.no_grad():
            hidden = ref(position_ids=torch.arange(p + 4)[None], target_hidden=feats[:, :p],
                         noise_embedding=target.embed_tokens(block))[:, 1:]  # fmt: skip
            theirs = ref.compute_logits(hidden, target.lm_head)
            their_drafts = ref.propose(hidden, block[:, 0], target.lm_head, 0.0)[0]
        worst = max(worst, (logits - theirs).abs().max().item())
        assert torch.equal(drafts, their_drafts)
    print(f"dflash2 built by the package vs ours: max |logit diff| {worst:.2e}")
    assert worst <= 1e-4


# --------------------------------------------------------------------------------------------------
# speculative decoding with a public-layout DFlash2 drafter


def dflash2_of(v1_folder: Path, folder: Path) -> Path:
    """The distilled DFlash drafter of `v1_folder` turned into a public-layout DFlash2 drafter that still drafts
    well: its blocks' weights, convolutions near the identity (tap 0 of the base kernels 1, the rest and the
    dynamic kernels small and random) and a random selector of small codebooks (its chains differ from the argmax
    now and then)."""
    from tests.unit.test_sampling_ar import causal_model

    target = causal_model(seed=10, layers=3)
    v1 = load_drafter(v1_folder, target)
    drafter = DFlash2Drafter(v1.dcfg.model_copy(update={"architecture": "dflash2", "conv": CONV,
                                                        "selector": SelectorConfig(rank=4, top_k=4)}))  # fmt: skip
    randomize(drafter, seed=5)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "_conv." in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
                if name.endswith("base_kernel"):
                    p[:, 0] = 1.0
    drafter.load_state_dict(v1.state_dict(), strict=False)
    return save_drafter(folder, drafter.attach(target).eval())


def test_speculative_decoding_with_a_public_dflash2_drafter_is_lossless(tmp_path: Path):
    """A public-layout DFlash2 drafter on the float64 target: greedy output equals AR token for token on 200 prompts
    one at a time and the same 200 in batches of 8 (rows accepting different lengths), drafts picked by the
    selector and many accepted; sampled decoding (q from the selector's candidates) runs and accepts some."""
    from tests.unit.test_dflash_public import distilled_public_drafter
    from tests.unit.test_sampling_ar import causal_model, decode, random_prompts

    N, b = 12, 4
    known, new = random_prompts(40, seed=21), random_prompts(160, seed=22)
    folder = dflash2_of(distilled_public_drafter(tmp_path / "v1", known, N, b), tmp_path / "v2")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    target = causal_model(seed=10, layers=3, dtype=torch.float64)
    drafter = load_drafter(folder, target)
    assert isinstance(drafter, DFlash2Drafter) and drafter.fc.weight.dtype == torch.float64
    prompts = known + new
    ar = [s for i in range(0, 200, 8) for s in decode(target, prompts[i : i + 8], N).sequences]
    accepted = {1: 0, 8: 0}
    for batch in (1, 8):
        for i in range(0, 200, batch):
            out = decode(target, prompts[i : i + batch], N, drafter=drafter)
            assert out.sequences == ar[i : i + batch]
            accepted[batch] += out.counters.accepted
    assert accepted[1] == accepted[8] > 200, accepted
    sampled = decode(target, known[:8], N, drafter=drafter, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.counters.accepted > 0 and all(len(s) == N for s in sampled.sequences)


def test_sampled_decoding_with_the_selector_follows_the_target(tmp_path: Path):
    """10,000 rows of a 1-token prompt in one call, 3 tokens each at temperature 1 with the DFlash2 drafter (its
    selector draws a chain over 4 candidates per position; q is 0 outside them): the second and third tokens
    (drafted, then verified by the rejection rule) follow the target's marginals (chi-square, p > 0.01); some
    drafts are accepted, not all. And with --draft-block-size 3 (the first proposals of its chain) greedy output
    is still AR's."""
    from dllm.sampling.proposals import token_probs
    from dllm.sampling.speculative import check_drafter
    from tests.unit.test_dflash_public import distilled_public_drafter
    from tests.unit.test_sampling_ar import MASK_ID, causal_model, decode, new_tokens, random_prompts
    from tests.unit.test_sampling_ar import V as TV
    from tests.unit.test_sampling_speculative import chi_square_p

    known = random_prompts(40, seed=21)
    folder = dflash2_of(distilled_public_drafter(tmp_path / "v1", known, 12, 4), tmp_path / "v2")
    target = causal_model(seed=10, layers=3, dtype=torch.float64)
    drafter = load_drafter(folder, target)
    R, prompt = 10_000, [known[0][0]]

    def next_probs(rows_BL: torch.Tensor) -> torch.Tensor:
        L = rows_BL.shape[1]
        with torch.no_grad():
            logits = target(rows_BL, torch.arange(L).expand_as(rows_BL), AttentionMask("causal")).logits()[:, -1]
        return token_probs(logits.index_fill(-1, torch.tensor([MASK_ID]), float("-inf")), 1.0, None, None)

    p1 = next_probs(torch.tensor([prompt]))[0]
    t = torch.arange(TV)
    p2_given = next_probs(torch.stack([torch.full((TV,), prompt[0]), t], 1))  # [t1, V]
    pairs = torch.stack([torch.full((TV * TV,), prompt[0]), t.repeat_interleave(TV), t.repeat(TV)], 1)
    p3_given = next_probs(pairs).view(TV, TV, TV)  # [t1, t2, V]
    p2 = (p1[:, None] * p2_given).sum(0)
    p3 = (p1[:, None, None] * p2_given[:, :, None] * p3_given).sum((0, 1))
    out = decode(target, [prompt] * R, 3, drafter=drafter, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert 0 < out.counters.accepted < out.counters.drafted
    tokens_R3 = new_tokens(out, 3)
    for position, probs in ((1, p2), (2, p3)):
        assert chi_square_p(torch.bincount(tokens_R3[:, position], minlength=TV), probs) > 0.01, position
    short = check_drafter(drafter, target, 3)
    for chunk in (known[:8], known[8:16]):
        assert decode(target, chunk, 12, drafter=short).sequences == decode(target, chunk, 12).sequences


# --------------------------------------------------------------------------------------------------
# a DFlash2 drafter that does not fit the target


def test_a_dflash2_drafter_that_does_not_fit_the_target_is_one_line(tmp_path: Path, capsys):
    """generate --draft with a public DFlash2 folder whose target layers or hidden size do not fit the target, whose
    config lacks the selector's sizes or has layer types dllm does not compute: one line, exit 2; the folder as
    saved decodes what --ar decodes."""
    from dllm.checkpoint.loading import load_target
    from tests.unit.test_dflash import write_causal_target
    from tests.unit.test_dflash_convert import one_line_error, run_cli

    write_causal_target(tmp_path / "target")
    target = load_target(tmp_path / "target").model
    cfg = dflash2_config(target.cfg, num_layers=1, target_layer_ids=(0, 1), mask_id=target.cfg.vocab_size - 1)
    drafter = DFlash2Drafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(0))
    folder = save_drafter(tmp_path / "drafter", drafter.attach(target))  # type: ignore[arg-type]
    original = json.loads((folder / "config.json").read_text())
    cases = [
        (("dflash_config", "target_layer_ids", [0, 5]), "target_layer_ids [5] are outside the target's 3 layers"),
        ((None, "hidden_size", 32), "the drafter's hidden size 32 is not the target's 64"),
        (("dflash_config", "selector_top_k", None), "a DFlash2 drafter without selector_top_k"),
        ((None, "layer_types", ["sliding_attention"]), "sliding_attention blocks but sliding_window is not set"),
        ((None, "layer_types", ["local"]), "full_attention and sliding_attention blocks only"),
    ]
    for (section, key, value), message in cases:
        config = json.loads(json.dumps(original))
        where = config if section is None else config[section]
        if value is None:
            del where[key]
        else:
            where[key] = value
        (folder / "config.json").write_text(json.dumps(config))
        code, _, err = run_cli(["generate", "--model", tmp_path / "target", "--draft", folder, "-p", "x"], capsys)
        one_line_error(code, err, message)
    (folder / "config.json").write_text(json.dumps(original))  # as saved: generates what --ar generates
    base = ["generate", "--model", tmp_path / "target", "-p", "12 + 7 =", "--gen-length", "16"]
    (ar_code, ar, _), (code, spec, _) = (run_cli([*base, *flag], capsys) for flag in (["--ar"], ["--draft", folder]))
    assert ar_code == code == 0 and ar == spec and ar.strip()
