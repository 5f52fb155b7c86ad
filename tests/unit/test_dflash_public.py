"""DFlash drafters in the public layout (z-lab's DFlashDraftModel: the folders SGLang, vLLM and the dflash
package load): a drafter saved here computes the published drafter's draft logits from the same target
features (and decodes in the package's own loop as in dllm's), a drafter written in that layout by the
reference code loads here and proposes the same tokens,
the target's layers are indexed as the public code indexes Hugging Face's hidden states, speculative
decoding with a public-layout drafter is lossless, and one that does not fit the target is refused.

Two references. `reference_draft_hidden` is a forward written in this test from the public code (z-lab's
dflash/model.py, release 0.1.0: DFlashDraftModel.forward, Qwen3DFlashDecoderLayer, Qwen3DFlashAttention) in
plain torch, reading the folder's config.json and safetensors; it always runs. The `dflash` package's own
DFlashDraftModel is the second (an optional test dependency, the dev extra; its tests skip without it).

Shapes: B batch, C context positions, b block size, E hidden, F features, H/K heads, D head width, V vocab.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.drafter import DFlashConfig
from dllm.config.model import ModelConfig
from dllm.errors import CheckpointError
from dllm.models.capture import capture_layers
from dllm.models.dflash import DFlashDrafter, DraftTokens
from dllm.models.dflash_io import convert_dllm_folder, load_drafter, save_drafter, save_public, target_identity
from dllm.models.transformer import Transformer

V, MASK = 64, 63
LAYERS = (0, 2)  # of 4: the last one (3) is refused in the public layout


def make_target(family: str = "llama", seed: int = 0) -> Transformer:
    cfg = ModelConfig(family=family, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=V,
                      init_std=0.2, tie_embeddings=False)  # fmt: skip
    target = Transformer(cfg)
    target.init_weights(torch.Generator().manual_seed(seed))
    return target.eval()


def make_drafter(target: Transformer, seed: int = 1, block: int = 4) -> DFlashDrafter:
    """A dflash-architecture drafter with random weights, its norms away from 1 (a unit-weight norm of an
    already normalised context is close to the identity, which would hide a misplaced norm)."""
    cfg = DFlashConfig(num_layers=2, block_size=block, target_layer_ids=LAYERS, mask_id=MASK, target=target.cfg,
                       architecture="dflash")  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return drafter.attach(target).eval()


def features(target: Transformer, tokens_BL: torch.Tensor, ids=LAYERS) -> torch.Tensor:
    B, L = tokens_BL.shape
    with torch.no_grad(), capture_layers(target, ids) as cap:
        target(tokens_BL, torch.arange(L).expand(B, L), AttentionMask("causal"))
    return cap.features()


def tokens(L: int = 12, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, MASK, (1, L), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------------
# the reference forward, written here from the public code


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x_BLHD: torch.Tensor, positions_L: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (the Qwen3 layout): x cos + rotate_half(x) sin."""
    D = x_BLHD.shape[-1]
    angle = positions_L[:, None].double() * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(x_BLHD.dtype)[None, :, None] for f in (torch.cos, torch.sin))
    x1, x2 = x_BLHD[..., : D // 2], x_BLHD[..., D // 2 :]
    return x_BLHD * cos + torch.cat([-x2, x1], -1) * sin


def reference_draft_hidden(folder: Path, features_BCF: torch.Tensor, noise_BbE: torch.Tensor) -> torch.Tensor:
    """The published drafter's final states [B, b, E] for context features at positions 0..C-1 and a block
    embedded at C..C+b-1, without a cache: the context is fc then hidden_norm, and enters every layer's k/v
    projections as it is; queries come from the block after the layer's input norm; q and k get their per-head
    norms, then RoPE; attention over [context ; block] is not causal; a Qwen3 MLP; the final norm."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    assert not cfg.get("attention_bias") and cfg.get("hidden_act", "silu") == "silu"
    eps, D = cfg["rms_norm_eps"], cfg["head_dim"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    context = _rms(features_BCF @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = noise_BbE
    (B, Q, _), C = h.shape, context.shape[1]
    positions = torch.arange(C + Q)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        rows = torch.cat([context, x], dim=1)
        q = _rms((x @ w[p + "self_attn.q_proj.weight"].T).view(B, Q, -1, D), w[p + "self_attn.q_norm.weight"], eps)
        k = _rms(
            (rows @ w[p + "self_attn.k_proj.weight"].T).view(B, C + Q, -1, D), w[p + "self_attn.k_norm.weight"], eps
        )
        v = (rows @ w[p + "self_attn.v_proj.weight"].T).view(B, C + Q, -1, D)
        q, k = _rope(q, positions[C:], theta), _rope(k, positions, theta)
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        attn = (torch.einsum("bqhd,bkhd->bhqk", q, k) / D**0.5).softmax(-1)
        h = h + torch.einsum("bhqk,bkhd->bqhd", attn, v).reshape(B, Q, -1) @ w[p + "self_attn.o_proj.weight"].T
        y = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        mlp = F.silu(y @ w[p + "mlp.gate_proj.weight"].T) * (y @ w[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ w[p + "mlp.down_proj.weight"].T
    return _rms(h, w["norm.weight"], eps)


def draft_block(anchor: int, b: int = 4) -> torch.Tensor:
    return torch.tensor([[anchor] + [MASK] * (b - 1)])


def dflash_package():
    dflash = pytest.importorskip("dflash", reason="no dflash package (make venv: pip install --no-deps dflash)")
    if not hasattr(dflash, "DFlashDraftModel"):
        pytest.skip("this dflash release has no DFlashDraftModel")
    return dflash


def hf_target(target: Transformer, folder: Path):
    """`target` as a transformers model (exported, then loaded by transformers itself)."""
    transformers = pytest.importorskip("transformers")
    from dllm.models.hf_io import export_hf

    export_hf(target.state_dict(), target.cfg, folder)
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


# --------------------------------------------------------------------------------------------------
# a drafter saved here computes the published drafter


def test_target_layers_are_hugging_face_hidden_states_shifted_by_one(tmp_path: Path):
    """The public code reads hidden_states[i + 1] for target layer i (entry 0: the embeddings); dllm captures
    block i's output: the same tensors, except the last block's, which Hugging Face gives after the final norm
    (why a drafter reading it has no public layout)."""
    target = make_target()
    hf = hf_target(target, tmp_path / "target")
    x = tokens()
    with torch.no_grad():
        hidden = hf(x, output_hidden_states=True).hidden_states
    captured = features(target, x, ids=(0, 1, 2, 3)).split(32, dim=-1)
    for i in range(3):
        torch.testing.assert_close(hidden[i + 1], captured[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[4], target.norm(captured[3]), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(hidden[4], captured[3], atol=1e-3)
    with pytest.raises(ValueError, match="include the target's last layer 3"):
        DFlashConfig(target_layer_ids=(0, 3), mask_id=MASK, target=target.cfg, architecture="dflash")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_saved_drafter_computes_the_reference_forward(tmp_path: Path, family: str):
    """Our drafter (its training forward), saved in the public layout, against the reference forward written
    here over that folder, fed the target's features as the public code takes them (Hugging Face hidden
    states, shifted by one): the same draft logits (float32, 1e-4)."""
    target = make_target(family)
    drafter = make_drafter(target)
    folder = save_drafter(tmp_path / "drafter", drafter, target_name="tiny")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"block_size": 4, "target_layer_ids": [0, 2], "mask_token_id": MASK}
    assert config["num_target_layers"] == 4 and config["tie_word_embeddings"] is False
    assert config["layer_types"] == ["full_attention"] * 2 and config["num_hidden_layers"] == 2
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert shapes["fc.weight"] == (32, 64) and shapes["layers.1.self_attn.k_norm.weight"] == (8,)
    assert not any(k.startswith(("embed", "lm_head")) for k in shapes)

    hf = hf_target(target, tmp_path / "target")
    x, C = tokens(), 12
    with torch.no_grad():
        hidden = hf(x, output_hidden_states=True).hidden_states
        public_features = torch.cat([hidden[i + 1] for i in LAYERS], dim=-1)
        ours = drafter(DraftTokens(draft_block(7), features(target, x), torch.tensor([[C]])),
                       C + torch.arange(4)[None]).logits()  # fmt: skip
        ref = hf.lm_head(reference_draft_hidden(folder, public_features, hf.model.embed_tokens(draft_block(7))))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_a_saved_drafter_loads_into_the_dflash_package(tmp_path: Path):
    """The dflash package's DFlashDraftModel.from_pretrained reads the folder we wrote, takes the target's
    features with its own extract_context_feature, and gives our draft logits (float32, 1e-4)."""
    dflash = dflash_package()
    target = make_target()
    drafter = make_drafter(target)
    folder = save_drafter(tmp_path / "drafter", drafter)
    ref = dflash.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert (ref.block_size, ref.mask_token_id, list(ref.target_layer_ids)) == (4, MASK, list(LAYERS))
    hf = hf_target(target, tmp_path / "target")
    x, C = tokens(), 12
    with torch.no_grad():
        out = hf(x, output_hidden_states=True)
        context = dflash.extract_context_feature(out.hidden_states, ref.target_layer_ids)
        hidden = ref(position_ids=torch.arange(C + 4)[None], noise_embedding=hf.model.embed_tokens(draft_block(9)),
                     target_hidden=context)  # fmt: skip
        theirs = hf.lm_head(hidden)
        ours = drafter(DraftTokens(draft_block(9), features(target, x), torch.tensor([[C]])),
                       C + torch.arange(4)[None]).logits()  # fmt: skip
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("anchors", [(12, 9), (10, 10)])
def test_the_decoding_path_equals_the_training_forward(anchors):
    """For architecture dflash (its context rows skip the block's input norm in propose's single pass): two
    extends (one rewriting rejected positions, so one written without a block), then propose over rows at
    different lengths (a mask) or at one (none) == the drafter's forward from scratch on each row."""
    target = make_target()
    drafter = make_drafter(target)
    x = torch.randint(0, MASK, (2, 20), generator=torch.Generator().manual_seed(6))
    feats = features(target, x)
    state = drafter.start(2, 32)
    drafter.extend(state, feats[:, :7], torch.arange(7).expand(2, 7))
    drafter.extend(state, torch.randn(2, 6, feats.shape[-1]), torch.arange(7, 13).expand(2, 6))
    drafter.extend(state, feats[:, 7:12], torch.arange(7, 12).expand(2, 5))
    anchor_pos = torch.tensor(anchors)
    logits = drafter.propose(state, x.gather(1, anchor_pos[:, None])[:, 0], anchor_pos)
    for r, p in enumerate(anchors):
        inp = DraftTokens(draft_block(int(x[r, p])), feats[r : r + 1, :p], torch.tensor([[p]]))
        with torch.no_grad():
            ref = drafter(inp, p + torch.arange(4)[None]).logits()[:, 1:]
        torch.testing.assert_close(logits[r : r + 1], ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# a drafter built in the public layout elsewhere loads here


def write_public_drafter(folder: Path, seed: int = 3) -> Path:
    """A drafter folder as the reference code writes one (transformers' save_pretrained of DFlashDraftModel:
    rope_parameters only, block_size at the top level, dflash_config without it), with blocks whose widths are
    not the target's (2 heads of 16, MLP 48, RoPE base 5000) and random weights."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "max_position_embeddings": 256, "vocab_size": V, "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * 2, "num_target_layers": 4, "block_size": 4, "dtype": "float32",
        "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": MASK},
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (32, 64), "hidden_norm.weight": (32,), "norm.weight": (32,)}
    for i in range(2):
        shapes |= {f"layers.{i}.{k}": s for k, s in {
            "input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,),
            "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (16, 32),
            "self_attn.v_proj.weight": (16, 32), "self_attn.o_proj.weight": (32, 32),
            "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
            "mlp.gate_proj.weight": (48, 32), "mlp.up_proj.weight": (48, 32), "mlp.down_proj.weight": (32, 48),
        }.items()}  # fmt: skip
    state = {k: (0.5 + torch.rand(s, generator=g)) if k.endswith("norm.weight") else 0.3 * torch.randn(s, generator=g)
             for k, s in shapes.items()}  # fmt: skip
    folder.mkdir(parents=True)
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def proposals_by_decoding(drafter: DFlashDrafter, target: Transformer, x: torch.Tensor, anchors: list[int]):
    """The drafter's proposal logits [1, b-1, V] at each anchor position, through the decoding path (one state:
    the context of each round extended, then one propose per anchor)."""
    feats = features(target, x, drafter.target_layer_ids)
    state, done, out = drafter.start(1, 32), 0, []
    for p in anchors:
        drafter.extend(state, feats[:, done:p], torch.arange(done, p)[None])
        out.append(drafter.propose(state, x[:, p], torch.tensor([p])))
        done = p
    return out


def test_a_public_drafter_loads_and_proposes_the_reference_tokens(tmp_path: Path):
    """A folder written as the reference writes one loads here (its own widths and RoPE base); through the
    decoding path it proposes, at anchors 4, 9 and 15, the tokens of the reference forward written here (its
    logits within 1e-4)."""
    target = make_target()
    folder = write_public_drafter(tmp_path / "public")
    drafter = load_drafter(folder, target)
    assert drafter.block_size == 4 and drafter.target_layer_ids == (1, 2) and drafter.cfg.dim_per_head == 16
    x, anchors = tokens(20), [4, 9, 15]
    feats = features(target, x, (1, 2))
    for p, logits in zip(anchors, proposals_by_decoding(drafter, target, x, anchors), strict=True):
        with torch.no_grad():
            ref = target.logits(
                reference_draft_hidden(folder, feats[:, :p], target.embed_tokens(draft_block(int(x[0, p]))))
            )
        torch.testing.assert_close(logits, ref[:, 1:], atol=1e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), ref[:, 1:].argmax(-1))


def test_a_drafter_built_by_the_dflash_package_proposes_its_tokens(tmp_path: Path):
    """DFlashDraftModel built by the dflash package (random weights), saved with save_pretrained, loads here and
    proposes through the decoding path the tokens the package's forward proposes (logits within 1e-4)."""
    dflash = dflash_package()
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=V, rope_theta=5000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=256, tie_word_embeddings=False, layer_types=["full_attention"] * 2,
                         num_target_layers=4, block_size=4,
                         dflash_config={"target_layer_ids": [1, 2], "mask_token_id": MASK})  # fmt: skip
    torch.manual_seed(3)
    ref = dflash.DFlashDraftModel(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape) if name.endswith("norm.weight") else 0.3 * torch.randn(p.shape))
    ref.save_pretrained(str(tmp_path / "public"))
    target = make_target()
    drafter = load_drafter(tmp_path / "public", target)
    x, anchors = tokens(20), [4, 9, 15]
    feats = features(target, x, (1, 2))
    for p, logits in zip(anchors, proposals_by_decoding(drafter, target, x, anchors), strict=True):
        with torch.no_grad():
            hidden = ref(position_ids=torch.arange(p + 4)[None], target_hidden=feats[:, :p],
                         noise_embedding=target.embed_tokens(draft_block(int(x[0, p]))))  # fmt: skip
        theirs = target.logits(hidden)[:, 1:]
        torch.testing.assert_close(logits, theirs, atol=1e-4, rtol=0)
        assert torch.equal(logits.argmax(-1), theirs.argmax(-1))


# --------------------------------------------------------------------------------------------------
# the two formats


def test_formats_round_trip_and_a_dllm_architecture_drafter_has_no_public_layout(tmp_path: Path):
    """public -> dllm's format (recording the target) -> public again: the same logits; a drafter of
    architecture dllm (the context through each block's input norm) stays in dllm's format and is refused by
    the public writer and the converter, one line each."""
    from dllm.models.dflash_io import save_dllm

    target = make_target()
    public = write_public_drafter(tmp_path / "public")
    first = load_drafter(public, target)
    save_dllm(tmp_path / "dllm", first, target_identity(target, "tiny"))
    saved = json.loads((tmp_path / "dllm" / "config.json").read_text())
    assert saved["model_type"] == "dflash" and saved["architecture"] == "dflash" and saved["blocks"]["head_dim"] == 16
    convert_dllm_folder(tmp_path / "dllm", tmp_path / "again")
    again = load_drafter(tmp_path / "again", target)
    with pytest.raises(CheckpointError, match="trained for target tiny, and the given target's weights differs"):
        load_drafter(tmp_path / "again", make_target(seed=9))  # the recorded identity travels along
    x = tokens()
    inp = DraftTokens(draft_block(3), features(target, x, (1, 2)), torch.tensor([[12]]))
    with torch.no_grad():
        logits = [d(inp, 12 + torch.arange(4)[None]).logits() for d in (first, load_drafter(tmp_path / "dllm", target),
                                                                        again)]  # fmt: skip
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])

    old = DFlashDrafter(DFlashConfig(num_layers=1, block_size=4, target_layer_ids=LAYERS, mask_id=MASK,
                                     target=target.cfg))  # fmt: skip
    old.init_weights(torch.Generator().manual_seed(0))
    old.attach(target)
    folder = save_drafter(tmp_path / "old", old)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "dflash"
    for call in (lambda: save_public(tmp_path / "x", old, {}), lambda: convert_dllm_folder(folder, tmp_path / "y")):
        with pytest.raises(CheckpointError, match="architecture dllm") as e:
            call()
        assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------------
# speculative decoding with a public-layout drafter


def distilled_public_drafter(folder: Path, known: list[list[int]], n: int, b: int) -> Path:
    """A 1-block dflash drafter of test_sampling_ar's float32 target, distilled for 30 steps on the target's
    greedy continuations of the prompts `known` (so it proposes them well and other continuations badly),
    saved in the public layout."""
    from dllm.config.objectives import DFlashDistillationConfig
    from dllm.data.loader import Batch
    from dllm.diffusion.corruption import NoiseKeys
    from dllm.diffusion.objectives.base import TokenIds
    from dllm.diffusion.objectives.dflash import DFlashDistillation
    from dllm.training.trainer import run_model
    from tests.unit.test_sampling_ar import MASK_ID, causal_model, decode

    target = causal_model(seed=10, layers=3)
    answers = decode(target, known, n + b).sequences
    L = max(len(p) for p in known) + n + b
    tokens_BL, sup_BL = torch.zeros(len(known), L, dtype=torch.long), torch.zeros(len(known), L, dtype=torch.bool)
    for r, (p, a) in enumerate(zip(known, answers, strict=True)):
        tokens_BL[r, : len(p) + len(a)] = torch.tensor(p + a)
        sup_BL[r, len(p) : len(p) + len(a)] = True
    batch = Batch(tokens_BL, sup_BL, torch.arange(len(known)))
    cfg = DFlashDistillationConfig(target="unused", target_layer_ids=[0, 1], block_size=b, num_anchors=16,
                                   architecture="dflash", labels="data")  # fmt: skip
    objective = DFlashDistillation(cfg, TokenIds(MASK_ID, 0, 0, MASK_ID), target=target)
    drafter = DFlashDrafter(DFlashConfig(num_layers=1, block_size=b, target_layer_ids=(0, 1), mask_id=MASK_ID,
                                         target=target.cfg, architecture="dflash"))  # fmt: skip
    drafter.init_weights(torch.Generator().manual_seed(0))
    drafter.attach(target)
    opt = torch.optim.Adam(drafter.parameters(), lr=2e-2)
    for step in range(30):
        inputs = objective.prepare(batch, NoiseKeys(0, step))
        loss = objective.loss(run_model(drafter, inputs), inputs).loss_sum / objective.normalizer(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_drafter(folder, drafter.eval())


def test_speculative_decoding_with_a_public_drafter_is_lossless(tmp_path: Path):
    """A public-layout drafter loaded onto the float64 target (its weights cast with it): greedy output equals
    AR token for token on 200 prompts (40 it was distilled on: most drafts accepted; 160 new ones, whose drafts
    mostly fail), every prompt decoded one at a time and again in batches of 8 (rows accepting different
    lengths in one batch)."""
    from tests.unit.test_sampling_ar import causal_model, decode, random_prompts

    N, b = 12, 4
    known, new = random_prompts(40, seed=21), random_prompts(160, seed=22)
    folder = distilled_public_drafter(tmp_path / "public", known, N, b)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    target = causal_model(seed=10, layers=3, dtype=torch.float64)
    drafter = load_drafter(folder, target)
    assert drafter.fc.weight.dtype == torch.float64
    prompts = [p for i in range(20) for p in known[2 * i : 2 * i + 2] + new[6 * i : 6 * i + 6]] + new[120:]
    ar = [s for i in range(0, 200, 8) for s in decode(target, prompts[i : i + 8], N).sequences]
    totals = {1: [0, 0], 8: [0, 0]}
    for batch in (1, 8):
        for i in range(0, 200, batch):
            out = decode(target, prompts[i : i + batch], N, drafter=drafter)
            assert out.sequences == ar[i : i + batch]
            totals[batch] = [totals[batch][0] + out.counters.accepted, totals[batch][1] + out.counters.drafted]
    rate = {k: accepted / drafted for k, (accepted, drafted) in totals.items()}
    known_rate = []
    for p in known[:8]:
        out = decode(target, [p], N, drafter=drafter)
        known_rate.append(out.counters.accepted / out.counters.drafted)
    assert totals[1][0] == totals[8][0] and 0.02 < rate[8] < sum(known_rate) / 8, (rate, known_rate)


def test_the_dflash_packages_own_loop_decodes_with_our_drafter_as_ours_does(tmp_path: Path, monkeypatch):
    """The dflash package's speculative loop (dflash_generate: its drafter cache, context positions and greedy
    verification), run with a drafter distilled and saved here and the target as a transformers model, returns
    the target's greedy tokens in the same rounds, accepting as many drafts per round as dllm's loop (its last
    round cut at max_new_tokens). Its stats are timed with torch.cuda.synchronize: on CPU the test times them
    with perf_counter (only the timing changes)."""
    import time

    dflash = dflash_package()
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds
    from dllm.sampling.results import StepEvent
    from tests.unit.test_sampling_ar import MASK_ID, causal_model, decode, random_prompts

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)
    N, b = 20, 4
    known = random_prompts(8, seed=21)
    folder = distilled_public_drafter(tmp_path / "public", known, N, b)
    target = causal_model(seed=10, layers=3)
    hf = hf_target(target, tmp_path / "target")
    reference = dflash.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = load_drafter(folder, target)
    for p in known:
        stats = dflash.model.dflash_generate(reference, hf, torch.tensor([p]), N, None, 0.0, return_stats=True)
        events: list[StepEvent] = []
        cfg = SamplerConfig(generation="causal", gen_length=N, stop_at_eos=False)
        out = generate(target, [p], cfg, SpecialIds(MASK_ID, 0, 0), drafter=ours, callback=events.append)
        kept = [int(e.committed_BT.sum()) for e in events]
        assert stats.output_ids[0, len(p) :].tolist() == out.sequences[0] == decode(target, [p], N).sequences[0]
        rounds = kept[1:]  # the first event is the prefill's token
        assert len(stats.acceptance_lengths) == len(rounds) and stats.acceptance_lengths[:-1] == rounds[:-1]
        assert stats.acceptance_lengths[-1] <= rounds[-1]
