"""The decode profile: written once when a run is built, saved with every checkpoint and exported
folder, and read (never re-derived) by sampling, evaluation and export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dllm.checkpoint.files import MANIFEST, write_manifest
from dllm.checkpoint.loading import load_for_inference
from dllm.config.loading import validate_config
from dllm.config.model import ModelConfig
from dllm.config.objectives import ARConfig, BD3LMConfig, FastDLLMv2Config, MDLMConfig, UniformConfig
from dllm.config.profile import PROFILE_FILE, DecodeProfile, build_profile, read_profile, write_profile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.config.spec import RunSpec
from dllm.errors import CheckpointError, ConfigError
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import tiny_train_values

IDS = {"mask_id": 3, "pad_id": 0, "eos_id": 1, "num_tokens": 64}


def _profile(objective, shift_logits: bool = False) -> DecodeProfile:
    return build_profile(objective, shift_logits=shift_logits, max_length=128, **IDS)


@pytest.mark.parametrize(
    ("objective", "expected"),
    [
        (MDLMConfig(schedule="cosine"), ("bidirectional", None, None, False, "cosine", "mask")),
        (BD3LMConfig(block_size=8), ("block", 8, None, False, "linear", "mask")),
        (BD3LMConfig(block_size=4, shift=True, corruption="uniform"), ("block", 4, None, True, "linear", "uniform")),
        (FastDLLMv2Config(block_size=8, sub_block_size=4), ("block", 8, 4, True, "linear", "mask")),
        (UniformConfig(), ("bidirectional", None, None, False, "linear", "uniform")),
        (None, ("bidirectional", None, None, False, "linear", "mask")),
        (ARConfig(), ("causal", None, None, True, "linear", "mask")),
    ],
)
def test_each_objective_states_how_its_models_decode(objective, expected):
    p = _profile(objective)
    assert (p.attention, p.block_size, p.sub_block_size, p.shift, p.schedule, p.corruption) == expected
    assert p.objective == (objective.name if objective is not None else None)
    assert (p.mask_id, p.pad_id, p.eos_id, p.num_tokens, p.max_length) == (3, 0, 1, 64, 128)


def test_a_shifted_family_shifts_whatever_the_objective():
    dream = ModelConfig(family="dream", preset="tiny", vocab_size=64)
    assert _profile(None, shift_logits=dream.shift_logits).shift
    assert _profile(MDLMConfig(), shift_logits=True).shift


def test_canvas_models_draw_from_the_model_vocabulary():
    """prefix_canvas decoding (a DiffusionGemma folder, or a run of its objective) draws random canvases from the
    model's whole vocabulary, as transformers' DiffusionGemma; uniform noise elsewhere from the tokenizer's ids."""
    from dllm.config.objectives import DiffusionGemmaSFTConfig

    folder = build_profile(None, shift_logits=False, max_length=128, canvas_length=8, vocab_size=96, **IDS)
    trained = build_profile(DiffusionGemmaSFTConfig(block_size=8), shift_logits=False, max_length=128,
                            vocab_size=96, **IDS)  # fmt: skip
    assert folder.num_tokens == trained.num_tokens == 96
    uniform = build_profile(UniformConfig(), shift_logits=False, max_length=128, vocab_size=96, **IDS)
    assert uniform.num_tokens == IDS["num_tokens"]


def test_profile_rules_and_file_round_trip(tmp_path: Path):
    with pytest.raises(ValueError, match="attention block needs block_size"):
        DecodeProfile(attention="block", max_length=8, **IDS)
    with pytest.raises(ValueError, match="apply to attention block only"):
        DecodeProfile(block_size=4, max_length=8, **IDS)
    p = _profile(FastDLLMv2Config(block_size=8, sub_block_size=2))
    assert read_profile(tmp_path) is None
    write_profile(p, tmp_path)
    assert read_profile(tmp_path) == p and not list(tmp_path.glob("*.tmp"))
    (tmp_path / PROFILE_FILE).write_text('{"attention": "sideways"}')
    with pytest.raises(CheckpointError, match=rf"{PROFILE_FILE}: not a valid decode profile"):
        read_profile(tmp_path)


def test_a_causal_model_decodes_causally_unasked_and_the_diffusion_sampler_refuses_it():
    assert resolve_sampler(SamplerConfig(gen_length=16), _profile(ARConfig())).generation == "causal"
    with pytest.raises(ConfigError, match=r"generation: canvas cannot .* autoregressive \(trained with ar: attention"):
        resolve_sampler(SamplerConfig(gen_length=16, generation="canvas"), _profile(ARConfig()))
    with pytest.raises(ValueError, match="apply to attention block only"):
        DecodeProfile(attention="causal", block_size=4, max_length=8, **IDS)


def test_the_sampler_reads_the_profile_not_the_objective():
    cfg = resolve_sampler(SamplerConfig(gen_length=16), _profile(FastDLLMv2Config(block_size=8, sub_block_size=4)))
    assert (cfg.attention, cfg.block_length, cfg.sub_block_length, cfg.shift) == ("block", 8, 4, "on")
    folder = resolve_sampler(SamplerConfig(gen_length=16), _profile(None))
    assert (folder.attention, folder.shift) == ("bidirectional", "off")


@pytest.fixture(scope="module")
def bd3lm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dllm.config.loading import load_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare
    from tests.helpers import PREPARE, write_corpus, write_yaml

    root = tmp_path_factory.mktemp("profile")
    write_corpus(root / "data" / "train.jsonl", num_records=100)
    write_yaml(root / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, root / "prepare.yaml"), root)
    values = tiny_train_values(
        run={"name": "b", "output_dir": str(root / "runs")},
        objective={"name": "bd3lm", "block_size": 8, "shift": True},
        training={"steps": 2},
    )
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=root))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    return run_dir


def test_every_checkpoint_carries_the_profile_and_loading_reads_it(bd3lm_run: Path, tmp_path: Path):
    ckpts = sorted((bd3lm_run / "checkpoints").glob("step_*"))
    assert ckpts and all((c / PROFILE_FILE).is_file() for c in ckpts)
    loaded = load_for_inference(run=bd3lm_run)
    p = loaded.profile
    assert (p.objective, p.attention, p.block_size, p.shift) == ("bd3lm", "block", 8, True)
    assert (p.mask_id, p.num_tokens) == (loaded.tokenizer.mask_id, loaded.tokenizer.vocab_size)
    # the saved file is what inference reads: an edited profile is honoured (nothing re-derived)
    copy = tmp_path / "runs" / "b"
    shutil.copytree(bd3lm_run, copy)
    step = sorted((copy / "checkpoints").glob("step_*"))[-1]
    data = json.loads((step / PROFILE_FILE).read_text())
    (step / PROFILE_FILE).write_text(json.dumps({**data, "sub_block_size": 4}))
    with pytest.raises(CheckpointError, match=f"{PROFILE_FILE}: .* bytes where manifest.json records"):
        load_for_inference(checkpoint=step)  # an edit the manifest does not know is damage
    write_manifest(step, int(step.name.split("_")[1]))  # sealed as written: the file, not a re-derivation
    assert load_for_inference(checkpoint=step).profile.sub_block_size == 4


def test_an_older_checkpoint_without_a_profile_loads_with_a_warning(bd3lm_run: Path, tmp_path: Path):
    copy = tmp_path / "b"
    shutil.copytree(bd3lm_run, copy)
    step = sorted((copy / "checkpoints").glob("step_*"))[-1]
    (step / PROFILE_FILE).unlink()
    (step / MANIFEST).unlink()  # older checkpoints predate both files
    cfg = yaml.safe_load((copy / "config.yaml").read_text())
    cfg["checkpointing"]["verify"] = False  # what the user who trusts it does (a refusal says so)
    (copy / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.warns(UserWarning, match="an older checkpoint"):
        loaded = load_for_inference(checkpoint=step)
    assert loaded.profile == load_for_inference(run=bd3lm_run).profile


def test_an_exported_folder_decodes_as_its_run(bd3lm_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    pytest.importorskip("transformers")
    from dllm.cli.main import main as dllm

    out = tmp_path / "hf"
    assert dllm(["convert", "--to-hf", str(out), "--run", str(bd3lm_run)]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / PROFILE_FILE).is_file()
    run_profile = load_for_inference(run=bd3lm_run).profile
    assert load_for_inference(model_dir=out).profile == run_profile
    sampler = resolve_sampler(SamplerConfig(gen_length=16), load_for_inference(model_dir=out).profile)
    assert (sampler.attention, sampler.block_length, sampler.shift) == ("block", 8, "on")


def test_a_flex_run_samples_with_auto_off_cuda():
    import torch

    from dllm.checkpoint.loading import _attention_for

    cfg = ModelConfig(preset="tiny", vocab_size=64, attention_backend="flex")
    assert _attention_for(cfg, torch.device("cpu")).attention_backend == "auto"
    assert _attention_for(cfg, torch.device("cuda")).attention_backend == "flex"
    blockwise = cfg.model_copy(update={"attention_backend": "blockwise"})
    assert _attention_for(blockwise, None).attention_backend == "blockwise"
