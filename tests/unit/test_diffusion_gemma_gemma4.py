"""Gemma 4's text model in the diffusion_gemma family (AR-to-diffusion): a tiny random transformers
Gemma4ForCausalLM (float32; dense with and without values-from-keys, and MoE; sliding layers with a window
shorter than the sequence and a full layer of its own head width, kv heads and proportional RoPE) saved and
imported gives its causal logits, with and without left padding; so does the multimodal Gemma 4 folder's text
model. The import is the stack without a self-conditioning block and exports back to a Gemma 4 folder that
transformers loads with the same logits. `canvas_conditioning: true` over it adds the block (seeded, a no-op
at start), so the encoder pass of the converted model still gives Gemma 4's logits, and a converted MoE model
exports as a DiffusionGemma folder with our canvas logits; `dllm convert`, five steps of
diffusiongemma_native_sft from it and `dllm generate` run end to end. A LoRA run over the import exports an
adapter in Gemma 4's module names, which peft loads onto the Gemma 4 folder with our merged model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")

V, P, C, W = 320, 9, 8, 4  # vocabulary (the byte tokenizer's, rounded), clean length, canvas, window (< P)
TEXT = dict(
    vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, sliding_window=W,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], max_position_embeddings=128,
    hidden_size_per_layer_input=0, final_logit_softcapping=30.0, attention_k_eq_v=True,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000000.0},
    },
)  # fmt: skip
VARIANTS = {
    "dense": {},
    "dense_own_values": {"attention_k_eq_v": False},  # full layers with a value projection and the sliding kv heads
    "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16},
}


def _perturb(model: torch.nn.Module, layers) -> None:
    """Norms start at 1, scalars at 1: make every weight matter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for layer in layers:
            layer.layer_scalar.fill_(float(torch.rand(())) + 0.5)


def _gemma4(variant: str):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**TEXT, **VARIANTS[variant]})).eval()
    _perturb(model, model.model.layers)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[torch.nn.Module, Path]]:
    out = {}
    for variant in VARIANTS:
        folder = tmp_path_factory.mktemp("gemma4") / variant
        hf = _gemma4(variant)
        hf.save_pretrained(folder)
        out[variant] = (hf, folder)
    return out


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder).model_copy(update={"attention_backend": "sdpa"})
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


def _inputs(padded: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, valid, positions): the second row left-padded by 3, its positions counting from its first token."""
    tokens = torch.randint(0, V, (2, P), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(2, P, dtype=torch.bool)
    if padded:
        valid[1, :3] = False
        tokens[1, :3] = 0
    return tokens, valid, (valid.cumsum(1) - 1).clamp_min(0)


def _theirs(hf, tokens, valid, positions) -> torch.Tensor:
    return hf(input_ids=tokens, attention_mask=valid.long(), position_ids=positions).logits


def _causal(model: Transformer, tokens, valid, positions) -> torch.Tensor:
    return model(tokens, positions, AttentionMask("causal", key_valid_BL=valid)).logits()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_logits_match_gemma4(saved, variant: str, padded: bool):
    hf, folder = saved[variant]
    ours = _import(folder)
    cfg = ours.cfg
    assert cfg.family == "diffusion_gemma" and not cfg.canvas_conditioning and cfg.canvas_length is None
    assert (cfg.num_experts > 0) == (variant == "moe") and cfg.global_values_are_keys == (variant != "dense_own_values")
    tokens, valid, positions = _inputs(padded)
    with torch.no_grad():
        ref = _theirs(hf, tokens, valid, positions)
        assert _max_diff(_causal(ours, tokens, valid, positions)[valid], ref[valid]) <= 1e-4
    assert float(ref.abs().max()) > 1.0  # logits of some size: the comparison is not of near-zeros


def test_multimodal_folder_reads_its_text_model(tmp_path: Path):
    """The `gemma4` folder (Gemma4ForConditionalGeneration): its text model, the vision tower skipped."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.unit.test_diffusion_gemma import VISION

    torch.manual_seed(0)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(text_config=TEXT, vision_config=VISION)).eval()
    _perturb(hf, hf.model.language_model.layers)
    hf.save_pretrained(tmp_path / "mm")
    ours = _import(tmp_path / "mm")
    tokens, valid, positions = _inputs(padded=True)
    with torch.no_grad():
        ref = _theirs(hf, tokens, valid, positions)
        assert _max_diff(_causal(ours, tokens, valid, positions)[valid], ref[valid]) <= 1e-4


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_back_to_gemma4(saved, variant: str, tmp_path: Path):
    from transformers import Gemma4ForCausalLM

    hf, folder = saved[variant]
    ours = _import(folder)
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "gemma4_text"
    back = Gemma4ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    tokens, valid, positions = _inputs(padded=True)
    with torch.no_grad():
        assert _max_diff(_theirs(back, tokens, valid, positions), _theirs(hf, tokens, valid, positions)) <= 1e-5
    again = _import(tmp_path / "out")
    for k, v in ours.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_recipe_ar_model_is_a_gemma4_folder(tmp_path: Path):
    """a2d-diffusiongemma-smoke's generated ar-model: a from-scratch stack without the canvas block, written as
    gemma4_text, loads in transformers (no weight missing or left over) with our logits."""
    from transformers import Gemma4ForCausalLM

    from dllm.recipes import write_ar_model

    folder = write_ar_model(tmp_path / "ar-model", family="gemma4")
    back, info = Gemma4ForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = _import(folder)
    assert ours.cfg.layer_is_local(0) and ours.cfg.local_window is not None and ours.cfg.local_window < P
    tokens, valid, positions = _inputs(padded=True)
    with torch.no_grad():
        ref = _theirs(back.eval(), tokens, valid, positions)
        assert _max_diff(_causal(ours, tokens, valid, positions)[valid], ref[valid]) <= 1e-4


def _converted(folder: Path, seed: int = 0) -> Transformer:
    """The AR-to-diffusion start: the checkpoint plus a fresh self-conditioning block (as a run builds it)."""
    from dllm.models.factory import initial_state
    from dllm.models.pretrained import merge_pretrained

    cfg = merge_pretrained(ModelConfig(init_from=folder, canvas_conditioning=True))  # init_from sets the rest
    cfg = cfg.model_copy(update={"attention_backend": "sdpa"})
    model = Transformer(cfg)
    model.load_state_dict(initial_state(cfg, None, seed), strict=True)
    return model.eval()


@pytest.mark.parametrize("padded", [False, True])
def test_encoder_pass_of_the_converted_model_is_gemma4(saved, padded: bool):
    """Over [clean ; canvas] under prefix_canvas the clean rows are the encoder's: Gemma 4's causal logits; the
    added block starts as a no-op (canvas rows only normalised), seeded by the run's seed."""
    from dllm.models.output import CanvasConditioned

    hf, folder = saved["dense"]
    model = _converted(folder)
    assert model.cfg.canvas_conditioning and model.canvas_cond is not None
    assert not bool(model.canvas_cond.down_proj.weight.any()) and bool(model.canvas_cond.gate_proj.weight.any())
    again, other = _converted(folder).state_dict(), _converted(folder, seed=1).state_dict()
    assert torch.equal(again["canvas_cond.up_proj.weight"], model.state_dict()["canvas_cond.up_proj.weight"])
    assert not torch.equal(other["canvas_cond.up_proj.weight"], again["canvas_cond.up_proj.weight"])
    tokens, valid, positions = _inputs(padded)
    canvas = torch.randint(0, V, (2, C), generator=torch.Generator().manual_seed(2))
    mask = AttentionMask("prefix_canvas", key_valid_BL=torch.cat([valid, torch.ones(2, C, dtype=torch.bool)], 1),
                         block_size=C, num_clean=P, canvas_start=P)  # fmt: skip
    all_positions = torch.cat([positions, positions[:, -1:] + 1 + torch.arange(C)], dim=1)
    previous = torch.randn(2, C, V, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _theirs(hf, tokens, valid, positions)
        out = model(torch.cat([tokens, canvas], 1), all_positions, mask).logits()
        assert _max_diff(out[:, :P][valid], ref[valid]) <= 1e-4
        conditioned = model(CanvasConditioned(torch.cat([tokens, canvas], 1), previous), all_positions, mask).logits()
    assert bool(torch.isfinite(out).all()) and _max_diff(conditioned, out) == 0.0  # the block starts as a no-op


def test_converted_moe_exports_as_diffusion_gemma(saved, tmp_path: Path):
    """Gemma 4 MoE plus the added block is DiffusionGemma's layout: it exports to a folder that transformers'
    DiffusionGemmaForBlockDiffusion loads (no text weight missing or left over) with our canvas logits, with
    and without self-conditioning logits."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    from transformers.models.diffusion_gemma import DiffusionGemmaForBlockDiffusion

    from tests.unit import test_diffusion_gemma as dg

    model = _converted(saved["moe"][1])
    with torch.no_grad():  # a trained block: every weight of it matters
        for p in model.canvas_cond.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
    export_hf(model.state_dict(), model.cfg, tmp_path / "dgemma")
    hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path / "dgemma"), output_loading_info=True)
    vision = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
    text_missing = [k for k in info["missing_keys"] if not k.startswith(vision)]
    assert not (text_missing or info["unexpected_keys"] or info["mismatched_keys"]), info  # no vision tower written
    x = dg._inputs(padded=True)
    previous = torch.randn(2, dg.C, V, generator=torch.Generator().manual_seed(5)) * 3
    with torch.no_grad():
        for logits_BCV in (None, previous):
            ref = dg._theirs(hf.eval(), x, logits_BCV).logits
            assert _max_diff(dg._ours(model, x, logits_BCV).logits()[:, dg.P :], ref) <= 1e-4


def test_refusals_are_one_line(saved, tmp_path: Path):
    """What the native model lacks (per-layer embeddings, shared keys and values, no soft-capping) is refused when
    config.json is read; a dense model with the self-conditioning block has no Hugging Face layout."""
    from dllm.config.rules import check_objective
    from dllm.config.spec import RunSpec
    from dllm.models.pretrained import merge_pretrained
    from tests.helpers import tiny_train_values

    _, folder = saved["dense"]
    config = json.loads((folder / "config.json").read_text())
    for key, value, words in (
        ("hidden_size_per_layer_input", 8, "per-layer input embeddings"),
        ("num_kv_shared_layers", 1, "num_kv_shared_layers 1"),
        ("final_logit_softcapping", None, "final_logit_softcapping null"),
    ):
        (tmp_path / key).mkdir()
        (tmp_path / key / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ConfigError, match=words) as e:
            model_config_from_hf(tmp_path / key)
        assert "\n" not in str(e.value)
    model = _converted(folder)
    with pytest.raises(ConfigError, match="^--to-hf: a dense DiffusionGemma has no Hugging Face layout") as e:
        export_hf(model.state_dict(), model.cfg, tmp_path / "dense")
    with pytest.raises(ConfigError, match="^model.canvas_length: 8 but the checkpoint"):
        merge_pretrained(ModelConfig(init_from=folder, canvas_length=8))
    values = tiny_train_values(model={"init_from": str(folder)},
                               objective={"name": "diffusiongemma_native_sft", "block_size": C})  # fmt: skip
    values["model"].pop("preset")  # init_from sets the sizes
    spec = RunSpec.model_validate(values)
    spec = spec.model_copy(update={"model": merge_pretrained(spec.model)})
    with pytest.raises(ConfigError, match="^model.canvas_conditioning: .* set it true to add it") as e:
        check_objective(spec)
    assert "\n" not in str(e.value)


def test_convert_train_and_generate(saved, tmp_path: Path, capsys):
    """`dllm convert --from-hf` of the Gemma 4 folder keeps its logits; five steps of diffusiongemma_native_sft
    from it (the canvas block added) have finite losses, the last not above the first; the run decodes."""
    from dllm.cli.main import main
    from dllm.config.loading import load_config, validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.config.spec import RunSpec
    from dllm.data.prepare import prepare
    from dllm.models.pretrained import pretrained_config, pretrained_state
    from dllm.training.metrics import read_metrics
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import PREPARE, tiny_train_values, write_yaml

    hf, folder = saved["dense"]
    assert main(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "dllm-gemma4")]) == 0
    capsys.readouterr()
    cfg = pretrained_config(tmp_path / "dllm-gemma4").model_copy(update={"init_from": tmp_path / "dllm-gemma4"})
    converted = Transformer(cfg).eval()
    converted.load_state_dict(pretrained_state(cfg), strict=True)
    tokens, valid, positions = _inputs(padded=True)
    with torch.no_grad():
        ref = _theirs(hf, tokens, valid, positions)
        assert _max_diff(_causal(converted, tokens, valid, positions)[valid], ref[valid]) <= 1e-4

    records = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    sources = [{"path": "data/sft.jsonl", "format": "prompt_completion"}]
    write_yaml(tmp_path / "prepare.yaml", {**PREPARE, "sources": sources, "layout": "indexed"})
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    model = {"init_from": str(tmp_path / "dllm-gemma4"), "canvas_conditioning": True, "attention_backend": "sdpa"}
    values = tiny_train_values(run={"name": "g4", "output_dir": str(tmp_path / "runs")}, model=model,
                               objective={"name": "diffusiongemma_native_sft", "block_size": C},
                               training={"steps": 5}, optimizer={"lr": 3e-3})  # fmt: skip
    values["model"].pop("preset")  # init_from sets the sizes
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    assert spec.model.canvas_conditioning and spec.model.num_experts == 0
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] <= losses[0], losses
    args = ["generate", "--run", str(run_dir), "-p", "3+4=", "-p", "12+30=", "--gen-length", "8", "--json"]
    assert main(args) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 and all(1 <= r["nfe"] == r["steps"] <= 48 and r["tokens_committed"] > 0 for r in rows)
    assert "canvas_denoise/canvas 8" in err


def test_lora_adapter_of_a_gemma4_run_loads_in_peft(saved, tmp_path: Path, capsys):
    """`convert --adapter-only` of a LoRA run over the imported Gemma 4 (no canvas block) names Gemma4ForCausalLM's
    modules (model.layers.*): peft loads it onto the Gemma 4 folder with the logits of our merged model."""
    peft = pytest.importorskip("peft")
    from dllm.checkpoint.loading import load_for_inference
    from dllm.cli.main import main
    from dllm.config.loading import load_config, validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.config.spec import RunSpec
    from dllm.data.prepare import prepare
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import PREPARE, tiny_train_values, write_yaml

    _, folder = saved["dense"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"text": f"a dog finds {i} apples"}) + "\n"
                                                           for i in range(64)))  # fmt: skip
    write_yaml(tmp_path / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    values = tiny_train_values(run={"name": "lora", "output_dir": str(tmp_path / "runs")},
                               model={"init_from": str(folder), "attention_backend": "sdpa"}, objective={"name": "ar"},
                               training={"steps": 2}, optimizer={"lr": 0.05})  # fmt: skip
    values["model"].pop("preset")
    values["lora"] = {"rank": 4, "alpha": 8, "targets": targets}
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    assert main(["convert", "--to-hf", str(tmp_path / "adapter"), "--run", str(run_dir), "--adapter-only"]) == 0
    assert "a LoRA adapter for a Gemma4ForCausalLM" in capsys.readouterr().err
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == sorted(targets)
    base = transformers.Gemma4ForCausalLM.from_pretrained(str(folder))  # (peft adapts the model it is given)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    lora_B = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert len(lora_B) == 6 * 3 - 1 and all(bool(p.any()) for p in lora_B)  # no v_proj in the full layer; trained
    merged = load_for_inference(run=run_dir).model
    tokens, valid, positions = _inputs(padded=True)
    with torch.no_grad():
        ref = _theirs(adapted, tokens, valid, positions)
        diff = _max_diff(_causal(merged, tokens, valid, positions)[valid], ref[valid])
        with adapted.disable_adapter():
            moved = _max_diff(ref[valid], _theirs(adapted, tokens, valid, positions)[valid])
    print(f"gemma4 LoRA adapter in peft vs our merged model: logits max|diff| {diff:.1e} (adapter moves {moved:.2f})")
    assert diff <= 1e-4 and moved > 1e-2
