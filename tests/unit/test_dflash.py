"""DFlash drafters and dflash_distillation: the target stays frozen and outside the drafter, the draft
mask equals a loop over anchors, the cached decoding path equals a recomputation, the drafter folder
round-trips and refuses another target."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.drafter import DFlashConfig
from dllm.config.model import ModelConfig
from dllm.config.objectives import DFlashDistillationConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import TokenIds
from dllm.diffusion.objectives.dflash import DFlashDistillation, position_weights
from dllm.errors import CheckpointError
from dllm.models.capture import capture_layers
from dllm.models.dflash import DFlashDrafter, DraftTokens
from dllm.models.dflash_io import load_drafter, save_drafter
from dllm.models.transformer import Transformer
from dllm.training.trainer import run_model

V, MASK = 64, 63
IDS = TokenIds(mask_id=MASK, eos_id=1, pad_id=0, num_tokens=60)
LAYERS = (0, 2)


def make_target(seed: int = 0, **over) -> Transformer:
    cfg = ModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=V, **over)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def make_drafter(target: Transformer, block: int = 4, seed: int = 1, num_layers: int = 1) -> DFlashDrafter:
    cfg = DFlashConfig(
        num_layers=num_layers, block_size=block, target_layer_ids=LAYERS, mask_id=MASK, target=target.cfg
    )
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(seed))
    return drafter.attach(target)


def make_objective(target: Transformer, **over) -> DFlashDistillation:
    values = {"target": "unused", "target_layer_ids": list(LAYERS), "block_size": 4, "num_anchors": 5, **over}
    cfg = DFlashDistillationConfig(**values)
    return DFlashDistillation(cfg, IDS, target=target)


def make_batch(B: int = 3, L: int = 24, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, 60, (B, L), generator=g)
    sup = torch.ones(B, L, dtype=torch.bool)
    sup[0, :10] = False  # a prompt
    sup[1, 6:] = False  # a short answer: fewer valid anchors than num_anchors
    return Batch(tokens, sup, torch.arange(B))


def target_features(target: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    B, L = tokens.shape
    with torch.no_grad(), capture_layers(target, LAYERS) as cap:
        target(tokens, torch.arange(L).expand(B, L), AttentionMask("causal"))
    return cap.features()


def test_drafter_holds_the_target_by_reference_only():
    target = make_target()
    drafter = make_drafter(target)
    names = set(dict(drafter.named_parameters()))
    assert names and all(not n.startswith(("embed", "lm_head", "_target")) for n in names)
    assert set(drafter.state_dict()) == names  # nothing of the target saved
    target_ids = {id(p) for p in target.parameters()}
    assert not target_ids & {id(p) for p in drafter.parameters()}
    assert all(not p.requires_grad for p in target.parameters())
    # the output head is the target's weight itself (tied embedding here), not a copy
    assert drafter.head(torch.zeros(1, 32))[1] is target.embed_tokens.weight


def test_target_stays_frozen_and_unchanged_while_the_loss_falls():
    target = make_target(init_std=0.2)  # a target whose head separates tokens (0.02 leaves logits near flat)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    drafter = make_drafter(target)
    obj = make_objective(target)
    batch = make_batch()
    opt = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        inp = obj.prepare(batch, NoiseKeys(0, 3))
        out = obj.loss(run_model(drafter, inp), inp)
        loss = out.loss_sum / obj.normalizer(batch)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.1 * losses[0], losses
    assert all(p.grad is None for p in target.parameters())
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_anchors_are_keyed_valid_and_counted():
    target = make_target()
    obj = make_objective(target)
    batch = make_batch()
    a1, ok1 = obj.pick_anchors(batch, NoiseKeys(0, 3))
    a2, ok2 = obj.pick_anchors(batch, NoiseKeys(0, 3))
    assert torch.equal(a1, a2) and torch.equal(ok1, ok2)  # keyed by sample id: every rank and resume agree
    valid = obj.valid_anchors(batch)
    assert bool(valid.gather(1, a1)[ok1].all())
    assert int(ok1[1].sum()) == int(valid[1].sum()) < 5  # the short row: all its valid anchors
    assert bool(ok1[0].all()) and bool(ok1[2].all())
    assert obj.normalizer(batch) == int(ok1.sum()) * 3
    # anchors never start in the prompt's context-only region: their next token is supervised
    assert bool((a1[0][ok1[0]] >= 9).all())


def test_targets_are_the_targets_greedy_next_tokens_with_decayed_weights():
    target = make_target()
    obj = make_objective(target, decay=2.0)
    batch = make_batch()
    inp = obj.prepare(batch, NoiseKeys(0, 3))
    with torch.no_grad():
        logits = target(batch.tokens_BL, torch.arange(24).expand(3, 24), AttentionMask("causal")).logits()
    logits[..., 60:] = -float("inf")
    logits[..., MASK] = -float("inf")
    greedy = logits.argmax(-1)  # hidden i predicts token i + 1
    sel = inp.weights_BL > 0
    rows = torch.arange(3)[:, None].expand_as(sel)[sel]
    assert torch.equal(inp.targets_BL[sel], greedy[rows, inp.positions_BL[sel] - 1])
    w = position_weights(4, 2.0)
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 0.6065307, 0.3678794]))
    full = inp.weights_BL.view(3, 5, 4)[2]  # the fully supervised row: every anchor carries w
    torch.testing.assert_close(full, w.expand(5, 4))
    ids = inp.tokens_BL.ids_BN.view(3, 5, 4)
    assert bool((ids[..., 1:] == MASK).all())
    anchors = inp.tokens_BL.context_len_BA
    assert torch.equal(ids[..., 0], batch.tokens_BL.gather(1, anchors))


def test_data_labels_equal_the_targets_on_its_own_greedy_answers():
    """labels: data reads the data's next tokens; on rows the target wrote greedily after a prompt they are its
    argmax, so both settings give the same targets and weights (and kl with data labels is refused)."""
    target = make_target(seed=4)
    B, P, L = 3, 6, 24
    tokens = torch.randint(2, 60, (B, P), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        while tokens.shape[1] < L:  # the target's greedy answer, ids it may produce only
            logits = target(tokens, torch.arange(tokens.shape[1]).expand(B, -1), AttentionMask("causal")).logits()
            logits[..., 60:] = -float("inf")
            logits[..., MASK] = -float("inf")
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    sup = torch.arange(L).expand(B, L) >= P
    batch = Batch(tokens, sup, torch.arange(B))
    by_target = make_objective(target).prepare(batch, NoiseKeys(0, 3))
    by_data = make_objective(target, labels="data").prepare(batch, NoiseKeys(0, 3))
    assert torch.equal(by_target.weights_BL, by_data.weights_BL) and (by_data.weights_BL > 0).sum() > 20
    sel = by_data.weights_BL > 0
    assert torch.equal(by_target.targets_BL[sel], by_data.targets_BL[sel]) and by_data.teacher_logits_MV is None
    with pytest.raises(ValueError, match="labels: data gives next tokens"):
        DFlashDistillationConfig(target="t", target_layer_ids=[0], loss="kl", labels="data")


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_the_draft_mask_equals_a_loop_over_anchors(loss):
    target = make_target()
    drafter = make_drafter(target, num_layers=2)
    obj = make_objective(target, loss=loss)
    inp = obj.prepare(make_batch(), NoiseKeys(0, 3))
    all_at_once = obj.loss(run_model(drafter, inp), inp).loss_sum
    hidden = run_model(drafter, inp).hidden_BLE
    total = torch.zeros(())
    M = 0
    tok = inp.tokens_BL
    for a in range(5):  # one anchor per forward, its block alone
        cols = slice(4 * a, 4 * a + 4)
        single_tok = DraftTokens(tok.ids_BN[:, cols], tok.context_BCF, tok.context_len_BA[:, a : a + 1])
        sel = inp.weights_BL[:, cols] > 0
        n = int(sel.sum())
        teacher = None
        if loss == "kl":  # the supervised rows of this anchor, in the all-at-once row-major order
            order = torch.zeros_like(inp.weights_BL, dtype=torch.long)
            order[inp.weights_BL > 0] = torch.arange(int((inp.weights_BL > 0).sum()))
            teacher = inp.teacher_logits_MV[order[:, cols][sel]]
        M += n
        single = dataclasses.replace(
            inp, tokens_BL=single_tok, positions_BL=inp.positions_BL[:, cols], targets_BL=inp.targets_BL[:, cols],
            weights_BL=inp.weights_BL[:, cols], teacher_logits_MV=teacher,
        )  # fmt: skip
        out = run_model(drafter, single)
        torch.testing.assert_close(out.hidden_BLE, hidden[:, cols], atol=1e-5, rtol=1e-5)
        if n:
            total = total + obj.loss(out, single).loss_sum
    assert int((inp.weights_BL > 0).sum()) == M
    torch.testing.assert_close(all_at_once, total, atol=1e-5, rtol=1e-5)


def test_a_packed_rows_blocks_read_only_their_own_document():
    """Two documents packed in one row (document ids): every draft block equals the drafter run on its
    document alone (what decoding sees: one prompt), and no anchor sits on a document's first token."""
    target = make_target()
    drafter = make_drafter(target, num_layers=2)
    obj = make_objective(target, num_anchors=12)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(2, 60, (1, 10), generator=g), torch.randint(2, 60, (1, 14), generator=g)]
    tokens = torch.cat(docs, dim=1)
    doc_ids = torch.tensor([[0] * 10 + [1] * 14])
    batch = Batch(tokens, torch.ones(1, 24, dtype=torch.bool), torch.arange(1), doc_ids)
    inp = obj.prepare(batch, NoiseKeys(0, 3))
    anchors = inp.tokens_BL.context_len_BA[0].tolist()
    ok = (inp.weights_BL.view(12, 4) > 0).any(-1).tolist()
    assert inp.tokens_BL.context_start_BA[0].tolist() == [0 if a < 10 else 10 for a in anchors]
    assert 0 not in anchors and 10 not in anchors and any(a > 10 for a in anchors)
    with torch.no_grad():
        packed = run_model(drafter, inp).hidden_BLE
        alone_feats = [target_features(target, d) for d in docs]
        leaky = dataclasses.replace(inp.tokens_BL, context_start_BA=None)  # the mask without documents
        leaked = drafter(leaky, inp.positions_BL).hidden_BLE
        for a, (p, used) in enumerate(zip(anchors, ok, strict=True)):
            if not used:
                continue
            d, start = (0, 0) if p < 10 else (1, 10)
            ids = inp.tokens_BL.ids_BN[:, 4 * a : 4 * a + 4]
            alone = DraftTokens(ids, alone_feats[d][:, : p - start], torch.tensor([[p - start]]))
            ref = drafter(alone, (p - start) + torch.arange(4)[None]).hidden_BLE
            torch.testing.assert_close(packed[:, 4 * a : 4 * a + 4], ref, atol=1e-5, rtol=1e-5)
            if d == 1:  # without the document bound the block would read the other document
                assert not torch.allclose(leaked[:, 4 * a : 4 * a + 4], ref, atol=1e-3)


@pytest.mark.parametrize("anchors", [(12, 9), (10, 10)])
def test_cached_decoding_equals_a_recomputation(anchors):
    """extend (with rejected positions rewritten) + propose == the drafter's forward from scratch: rows at
    different lengths (a mask), or at one (none); propose's single pass writes the last extend's context,
    whose positions past a row's anchor (rejected drafts) its block overwrites."""
    target = make_target()
    drafter = make_drafter(target, num_layers=2).eval()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(2, 60, (2, 20), generator=g)
    feats = target_features(target, tokens)
    state = drafter.start(2, 32)
    drafter.extend(state, feats[:, :7], torch.arange(7).expand(2, 7))
    # a verification writes 6 more positions per row, of which later ones get rejected and rewritten
    junk = torch.randn(2, 6, feats.shape[-1], generator=g)
    drafter.extend(state, junk, torch.arange(7, 13).expand(2, 6))
    drafter.extend(state, feats[:, 7:12], torch.arange(7, 12).expand(2, 5))
    anchor_pos = torch.tensor(anchors)  # per-row lengths: (12, 9): row 1 accepted fewer
    anchor = tokens.gather(1, anchor_pos[:, None]).squeeze(1)
    logits = drafter.propose(state, anchor, anchor_pos)
    assert logits.shape == (2, 3, V)
    for r in range(2):
        p = int(anchor_pos[r])
        ids = torch.tensor([[int(anchor[r]), MASK, MASK, MASK]])
        inp = DraftTokens(ids, feats[r : r + 1, :p], torch.tensor([[p]]))
        with torch.no_grad():
            ref = drafter(inp, p + torch.arange(4)[None]).logits()[:, 1:]
        torch.testing.assert_close(logits[r : r + 1], ref, atol=1e-5, rtol=1e-5)


def test_drafter_folder_round_trip(tmp_path: Path):
    target = make_target()
    drafter = make_drafter(target, seed=3).eval()
    folder = save_drafter(tmp_path / "d", drafter, target_name="tiny-target")
    cfg = (folder / "config.json").read_text()
    assert '"model_type": "dflash"' in cfg and '"block_size": 4' in cfg and '"name": "tiny-target"' in cfg
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(drafter.state_dict())  # drafter weights only
    again = load_drafter(folder, target)
    assert again.block_size == 4 and again.target_layer_ids == LAYERS
    tokens = torch.randint(2, 60, (2, 10), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, tokens)
    inp = DraftTokens(torch.tensor([[5, MASK, MASK, MASK]] * 2), feats, torch.tensor([[10], [6]]))
    with torch.no_grad():
        a = drafter(inp, 10 + torch.arange(4).expand(2, 4)).logits()
        b = again(inp, 10 + torch.arange(4).expand(2, 4)).logits()
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_drafter_folder_refuses_another_target_and_block_size(tmp_path: Path):
    target = make_target()
    folder = save_drafter(tmp_path / "d", make_drafter(target), target_name="tiny-target")
    with pytest.raises(CheckpointError, match="trained for target tiny-target.*weights differs"):
        load_drafter(folder, make_target(seed=9))
    with pytest.raises(CheckpointError, match="architecture differs"):
        load_drafter(folder, make_target(rope_theta=500.0))
    with pytest.raises(CheckpointError, match="trained for block size 4"):
        load_drafter(folder, target, block_size=8)
    with pytest.raises(CheckpointError, match="not a drafter folder"):
        load_drafter(tmp_path, target)
    # the same weights in bfloat16 are the same target
    assert load_drafter(folder, make_target().to(torch.bfloat16)).block_size == 4


def test_config_refuses_layers_outside_the_target():
    with pytest.raises(ValueError, match=r"target_layer_ids \[3\] are outside the target's 3 layers"):
        DFlashConfig(target_layer_ids=(0, 3), mask_id=MASK, target=make_target().cfg)


# --------------------------------------------------------------------------------------------------
# a drafter run: build.py loads the target, the trainer trains the drafter, convert exports it


def write_causal_target(folder: Path, seed: int = 0) -> Transformer:
    """A tiny llama saved as a Hugging Face LlamaForCausalLM folder (byte tokenizer: no tokenizer files)."""
    from dllm.config.data import TokenizerConfig
    from dllm.models.hf_io import export_hf
    from dllm.tokenization import build_tokenizer

    vocab = -(-build_tokenizer(TokenizerConfig()).vocab_size // 64) * 64
    model = Transformer(ModelConfig(preset="tiny", vocab_size=vocab, num_layers=3, init_std=0.2))
    model.init_weights(torch.Generator().manual_seed(seed))
    export_hf(model.state_dict(), model.cfg, folder)
    return model


def test_a_drafter_run_trains_exports_and_checks_its_target(workdir: Path, capsys: pytest.CaptureFixture[str]):
    from dllm.checkpoint.loading import load_for_inference, load_target
    from dllm.cli.main import main as dllm
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir
    from tests.helpers import load_spec, tiny_train_values, write_yaml

    write_causal_target(workdir / "target")
    objective = {"name": "dflash_distillation", "target": "target", "target_layer_ids": [0, 2], "block_size": 4,
                 "num_anchors": 4}  # fmt: skip
    train_yaml = write_yaml(workdir / "train.yaml", tiny_train_values(objective=objective))
    spec, warnings = resolve_run_spec(load_spec(train_yaml))
    assert any("model section is ignored" in w for w in warnings)
    assert spec.model.num_layers == 3  # the target's architecture
    trainer = build_trainer(spec, prepare_run_dir(spec))
    target = trainer.objective.target
    before = {k: v.clone() for k, v in target.state_dict().items()}
    assert trainer.model.target is target  # the drafter's head and embedding are the objective's target
    losses = trainer.fit()
    trainer.metrics.close()
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    run_dir = workdir / "runs" / "t"
    with pytest.raises(CheckpointError, match="trained a DFlash drafter"):
        load_for_inference(run=run_dir)
    assert dllm(["convert", "--to-hf", str(workdir / "drafter"), "--run", str(run_dir)]) == 0
    loaded = load_target(workdir / "target")
    drafter = load_drafter(workdir / "drafter", loaded.model)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(v, trainer.model.state_dict()[k], atol=0, rtol=0)
    write_causal_target(workdir / "other", seed=1)
    with pytest.raises(CheckpointError, match="weights differs"):
        load_drafter(workdir / "drafter", load_target(workdir / "other").model)
    capsys.readouterr()
    # generate --draft: lossless against --ar; another target or block size is one line, exit 2
    outs = {}
    for flag in (["--ar"], ["--draft", str(workdir / "drafter")]):
        args = ["generate", "--model", str(workdir / "target"), *flag, "-p", "the cat", "--gen-length", "12", "--json"]
        assert dllm(args) == 0
        outs[flag[0]] = json.loads(capsys.readouterr().out)
    assert outs["--draft"]["completion"] == outs["--ar"]["completion"] and outs["--draft"]["tau"] >= 1
    for target, extra, message in (
        ("other", [], "this drafter was trained for target"),
        ("target", ["--draft-block-size", "8"], "trained with blocks of 4, not 8"),
    ):
        args = ["generate", "--model", str(workdir / target), "--draft", str(workdir / "drafter"), *extra, "-p", "x"]
        assert dllm(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("dllm: error: ") and err.count("\n") == 1 and message in err, err


def test_init_from_target_starts_the_blocks_and_final_norm_from_copies_of_the_targets():
    target = make_target()
    drafter = make_drafter(target, num_layers=2)
    drafter.init_from_target(target, (2, 0))
    for block, i in ((drafter.layers[0], 2), (drafter.layers[1], 0)):
        mine, theirs = block.state_dict(), target.layers[i].state_dict()
        assert mine.keys() == theirs.keys()
        for k, v in mine.items():
            torch.testing.assert_close(v, theirs[k], atol=0, rtol=0)
            assert v.data_ptr() != theirs[k].data_ptr()  # a copy: training the drafter leaves the target alone
    torch.testing.assert_close(drafter.norm.weight, target.norm.weight, atol=0, rtol=0)
    assert all(p.data_ptr() != q.data_ptr() for p in drafter.parameters() for q in target.parameters())
    with pytest.raises(ValueError, match="one target block per drafter block"):
        drafter.init_from_target(target, (0,))


def test_init_from_target_is_checked_before_any_worker_starts():
    from dllm.checkpoint.loading import drafter_config
    from dllm.errors import ConfigError

    with pytest.raises(ValueError, match="names 1 target blocks for 2 drafter blocks"):
        DFlashDistillationConfig(target="t", target_layer_ids=[0], num_layers=2, init_from_target=[1])
    with pytest.raises(ValueError, match="only architecture dllm's blocks"):
        DFlashDistillationConfig(target="t", target_layer_ids=[0], architecture="dflash", init_from_target=[1])
    obj = DFlashDistillationConfig(target="t", target_layer_ids=[0], num_layers=2, init_from_target=[2, 3])
    with pytest.raises(ConfigError, match=r"objective.init_from_target: \[3\] are outside the target's 3 layers"):
        drafter_config(obj, make_target().cfg, MASK)
    # a target whose first block has no input norm: only that block fits a drafter's first block
    bare_first = make_target(first_layer_attn_norm=False).cfg
    obj = DFlashDistillationConfig(target="t", target_layer_ids=[0], num_layers=2, init_from_target=[2, 1])
    with pytest.raises(ConfigError, match="target block 2 has other weights than drafter block 0"):
        drafter_config(obj, bare_first, MASK)
    obj = DFlashDistillationConfig(target="t", target_layer_ids=[0], num_layers=2, init_from_target=[0, 1])
    assert drafter_config(obj, bare_first, MASK).num_layers == 2


def test_a_drafter_run_starts_from_the_target_blocks_it_names(workdir: Path):
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir
    from tests.helpers import load_spec, tiny_train_values, write_yaml

    write_causal_target(workdir / "target")
    objective = {"name": "dflash_distillation", "target": "target", "target_layer_ids": [0, 2], "block_size": 4,
                 "num_anchors": 4, "num_layers": 2, "init_from_target": [1, 2]}  # fmt: skip
    train_yaml = write_yaml(workdir / "train.yaml", tiny_train_values(objective=objective))
    spec, _ = resolve_run_spec(load_spec(train_yaml))
    trainer = build_trainer(spec, prepare_run_dir(spec))
    target, drafter = trainer.objective.target, trainer.model
    for block, i in zip(drafter.layers, (1, 2), strict=True):
        for k, v in block.state_dict().items():
            torch.testing.assert_close(v, target.layers[i].state_dict()[k], atol=0, rtol=0)
    torch.testing.assert_close(drafter.norm.weight, target.norm.weight, atol=0, rtol=0)
    trainer.metrics.close()


def test_a_drafter_run_refuses_a_target_that_is_not_causal(workdir: Path, capsys: pytest.CaptureFixture[str]):
    from dllm.cli.main import main as dllm
    from dllm.config.data import TokenizerConfig
    from dllm.models.pretrained import save_model_folder
    from tests.helpers import tiny_train_values, write_yaml

    model = make_target()
    # no decode profile: a masked model
    save_model_folder(workdir / "masked", model.state_dict(), model.cfg, TokenizerConfig())
    objective = {"name": "dflash_distillation", "target": "masked", "target_layer_ids": [0]}
    train_yaml = write_yaml(workdir / "train.yaml", tiny_train_values(objective=objective))
    code = dllm(["launch", "--config", str(train_yaml), "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "masked: the target decodes with bidirectional attention" in err, err
    assert len(err.strip().splitlines()) == 1


def test_ranks_draw_the_anchors_of_the_whole_batch():
    """Anchors are keyed by sample id: two data-parallel ranks holding half the rows each prepare exactly
    the rows of the whole batch, and their normalisers add up to the whole batch's."""
    target = make_target()
    obj = make_objective(target)
    whole = make_batch(B=4)
    inp = obj.prepare(whole, NoiseKeys(0, 4))
    total = 0
    for rows in (slice(0, 2), slice(2, 4)):
        half = Batch(whole.tokens_BL[rows], whole.loss_mask_BL[rows], whole.sample_ids_B[rows])
        part = obj.prepare(half, NoiseKeys(0, 4))
        assert torch.equal(part.tokens_BL.ids_BN, inp.tokens_BL.ids_BN[rows])
        assert torch.equal(part.targets_BL, inp.targets_BL[rows])
        assert torch.equal(part.weights_BL, inp.weights_BL[rows])
        total += obj.normalizer(half)
    assert total == obj.normalizer(whole)


def test_anchors_and_targets_stay_inside_a_document():
    target = make_target()
    obj = make_objective(target, decay=None, num_anchors=20)  # every valid anchor
    tokens = torch.randint(2, 60, (1, 24), generator=torch.Generator().manual_seed(0))
    doc = torch.tensor([[0] * 12 + [1] * 12])
    batch = Batch(tokens, torch.ones(1, 24, dtype=torch.bool), torch.arange(1), doc)
    valid = obj.valid_anchors(batch)[0]
    assert not bool(valid[11])  # its next token starts the next document
    assert not bool(valid[12])  # a document's first token: no context of its own to draft from
    assert bool(valid[10]) and bool(valid[13])
    inp = obj.prepare(batch, NoiseKeys(0, 1))
    pos, anchors = inp.positions_BL.view(20, 4), inp.tokens_BL.context_len_BA[0]
    w = inp.weights_BL.view(20, 4)
    same = doc[0, pos] == doc[0, anchors][:, None]
    assert bool((~same).any()), "this draw has a block that crosses into the next document"
    assert bool((w[~same] == 0).all()) and bool((w[same] > 0).sum() > 0)


def test_kl_loss_is_the_weighted_kl_to_the_target():
    from dllm.diffusion.objectives.dflash import kl_loss
    from dllm.models.output import ModelOutput

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, 8, generator=g)
    weight = torch.randn(10, 8, generator=g)
    out = ModelOutput(hidden, lambda h: (h, weight, None))
    weights = torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 2.0]])
    teacher = torch.randn(3, 10, generator=g)
    teacher[:, 9] = -float("inf")  # an id the target may not produce: excluded from both
    inp = dataclasses.replace(
        make_objective(make_target(), loss="kl").prepare(make_batch(B=2), NoiseKeys(0, 2)),
        weights_BL=weights, targets_BL=torch.zeros(2, 3, dtype=torch.long), teacher_logits_MV=teacher,
    )  # fmt: skip
    logits = hidden[weights > 0] @ weight.T
    q = teacher[:, :9].log_softmax(-1)
    p = logits[:, :9].log_softmax(-1)
    expected = ((q.exp() * (q - p)).sum(-1) * torch.tensor([1.0, 0.5, 2.0])).sum()
    torch.testing.assert_close(kl_loss(out, inp).loss_sum, expected)


@pytest.mark.parametrize("documents", [False, True])
def test_flex_block_mask_equals_the_dense_draft_mask(monkeypatch: pytest.MonkeyPatch, documents: bool):
    """attention_backend flex: the training draft mask is a BlockMask (eager FlexAttention, which runs forward
    on CPU), and the drafter's output equals the dense-mask SDPA drafter's (also over packed documents); with
    gradients on CPU (no flex backward) it falls back to the dense mask and still trains."""
    from torch.nn.attention.flex_attention import BlockMask

    from dllm.models import dflash

    target = make_target()
    dense = make_drafter(target, num_layers=2)
    flex_cfg = dense.dcfg.model_copy(
        update={"target": target.cfg.model_copy(update={"attention_backend": "flex", "flex_compile": False})}
    )
    flex = DFlashDrafter(flex_cfg).attach(target)
    flex.load_state_dict(dense.state_dict())
    obj = make_objective(target)
    batch = make_batch()
    if documents:  # two documents per row
        batch = dataclasses.replace(batch, doc_ids_BL=torch.tensor([[0] * 10 + [1] * 14] * 3))
    inp = obj.prepare(batch, NoiseKeys(0, 4))
    assert (inp.tokens_BL.context_start_BA is not None) == documents
    masks = []
    create = dflash.create_block_mask

    def spy(*args, **kwargs):
        masks.append(create(*args, **kwargs))
        return masks[-1]

    monkeypatch.setattr(dflash, "create_block_mask", spy)
    with torch.no_grad():
        got = run_model(flex, inp).hidden_BLE
        ref = run_model(dense, inp).hidden_BLE
    assert len(masks) == 1 and isinstance(masks[0], BlockMask)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    loss = obj.loss(run_model(flex, inp), inp).loss_sum  # grad on CPU: the dense mask
    loss.backward()
    assert len(masks) == 1 and flex.fc.weight.grad is not None


def test_a_dflash_drafter_decodes_ragged_rows_as_each_row_alone():
    """Speculative decoding with a DFlash drafter over rows of different prompt lengths (propose's masked
    path over one shared buffer): lossless against AR, and every row's proposals, round by round, equal
    the ones it gets decoded alone (propose's unmasked batch-1 path)."""
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    target = make_target()
    drafter = make_drafter(target, block=4, num_layers=2).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [20], [30, 31, 32, 33]]
    cfg, special = SamplerConfig(generation="causal", gen_length=10, stop_at_eos=False), SpecialIds(MASK, 0, 0)
    proposals: list[torch.Tensor] = []
    propose = drafter.propose
    drafter.propose = lambda *a: proposals.append(x := propose(*a)) or x  # type: ignore[method-assign]
    batched = generate(target, prompts, cfg, special, drafter=drafter)
    assert batched.sequences == generate(target, prompts, cfg, special).sequences
    together = list(proposals)
    for r, prompt in enumerate(prompts):
        proposals.clear()
        generate(target, [prompt], cfg, special, drafter=drafter)
        assert len(proposals) >= 3
        for t, alone in enumerate(proposals):
            torch.testing.assert_close(together[t][r], alone[0], atol=1e-5, rtol=1e-5)
