"""DFlash drafter folders through the command line: a drafter run of architecture dflash exports the public
layout, which `generate --draft` decodes with (lossless against --ar), and `dllm convert` rewrites drafter
folders between dllm's format and the public layout; a public drafter that does not fit the target, or a
drafter with no public layout, is one line and exit code 2 (generate, serve and convert)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dllm.config.drafter import DFlashConfig
from dllm.errors import CheckpointError
from dllm.models.dflash import DFlashDrafter
from dllm.models.dflash_io import load_drafter, save_drafter
from tests.unit.test_dflash import write_causal_target


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from dllm.cli.main import main as dllm

    capsys.readouterr()
    code = dllm([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line_error(code: int, err: str, message: str) -> None:
    assert code == 2 and err.startswith("dllm: error: ") and err.count("\n") == 1 and message in err, err


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_a_dflash_run_exports_the_public_layout_and_converts_both_ways(workdir: Path, capsys):
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir
    from tests.helpers import load_spec, tiny_train_values, write_yaml

    write_causal_target(workdir / "target")  # 3 layers: 0 and 1 readable in the public layout, not 2
    objective = {"name": "dflash_distillation", "target": "target", "target_layer_ids": [0, 1], "block_size": 4,
                 "num_anchors": 4, "architecture": "dflash"}  # fmt: skip
    spec, _ = resolve_run_spec(load_spec(write_yaml(workdir / "train.yaml", tiny_train_values(objective=objective))))
    trainer = build_trainer(spec, prepare_run_dir(spec))
    trainer.fit()
    trainer.metrics.close()
    run_dir = workdir / "runs" / "t"

    code, _, err = run_cli(["convert", "--to-hf", workdir / "drafter", "--run", run_dir], capsys)
    assert code == 0 and "public DFlash layout" in err, err
    config = json.loads((workdir / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [0, 1]
    for k, v in weights(workdir / "drafter").items():
        torch.testing.assert_close(v, trainer.model.state_dict()[k], atol=0, rtol=0)

    outs = {}
    for flag in (["--ar"], ["--draft", workdir / "drafter"]):
        args = ["generate", "--model", workdir / "target", *flag, "-p", "the cat", "--gen-length", "12", "--json"]
        code, out, err = run_cli(args, capsys)
        assert code == 0, err
        outs[flag[0]] = json.loads(out)
    assert outs["--draft"]["completion"] == outs["--ar"]["completion"] and outs["--draft"]["tau"] >= 1

    # public -> dllm's format (the target checked and recorded) -> public again: the same weights and settings
    code, _, err = run_cli(["convert", "--from-hf", workdir / "drafter", "--to", workdir / "old"], capsys)
    one_line_error(code, err, "a DFlash drafter; give --target TARGET")
    args = ["convert", "--from-hf", workdir / "drafter", "--to", workdir / "old", "--target", workdir / "target"]
    code, _, err = run_cli(args, capsys)
    assert code == 0 and "dllm's format" in err, err
    old = json.loads((workdir / "old" / "config.json").read_text())
    assert old["model_type"] == "dflash" and old["architecture"] == "dflash"
    code, _, err = run_cli(["convert", "--to-hf", workdir / "again", "--model", workdir / "old"], capsys)
    assert code == 0, err
    again = json.loads((workdir / "again" / "config.json").read_text())
    assert {k: v for k, v in again.items() if k != "dllm"} == {k: v for k, v in config.items() if k != "dllm"}
    assert again["dllm"]["target"]["weights_sha256"] == config["dllm"]["target"]["weights_sha256"]
    first, second = weights(workdir / "drafter"), weights(workdir / "again")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    code, _, err = run_cli(["convert", "--to-hf", workdir / "x", "--model", workdir / "drafter"], capsys)
    one_line_error(code, err, "already a drafter in the public DFlash layout")


def public_folder(tmp_path: Path, edit=None) -> tuple[Path, Path]:
    """(target folder, a public drafter folder for it, its config.json edited by `edit`)."""
    from dllm.checkpoint.loading import load_target

    write_causal_target(tmp_path / "target")
    target = load_target(tmp_path / "target").model
    cfg = DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(0, 1), mask_id=target.cfg.vocab_size - 1,
                       target=target.cfg, architecture="dflash")  # fmt: skip
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(torch.Generator().manual_seed(0))
    folder = save_drafter(tmp_path / "drafter", drafter.attach(target))  # type: ignore[arg-type]
    if edit is not None:
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    return tmp_path / "target", folder


def test_a_public_drafter_that_does_not_fit_the_target_is_one_line(tmp_path: Path, capsys):
    """target_layer_ids outside the target, or another hidden size: generate and serve refuse it, one line."""

    def far_layers(c):
        c["dflash_config"]["target_layer_ids"] = [0, 5]

    target, folder = public_folder(tmp_path / "a", far_layers)
    code, _, err = run_cli(["generate", "--model", target, "--draft", folder, "-p", "x"], capsys)
    one_line_error(code, err, "target_layer_ids [5] are outside the target's 3 layers")

    def narrow(c):
        c["hidden_size"] = 32

    target_b, folder_b = public_folder(tmp_path / "b", narrow)
    code, _, err = run_cli(["generate", "--model", target_b, "--draft", folder_b, "-p", "x"], capsys)
    one_line_error(code, err, "the drafter's hidden size 32 is not the target's 64")

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from tests.distributed.harness import free_port

    for draft in (folder, folder_b):  # serve loads the drafter before it binds the port
        code, _, err = run_cli(["serve", "--model", target, "--draft", draft, "--port", str(free_port())], capsys)
        one_line_error(code, err, "does not fit the given target")


def _set(path: str, value):
    def edit(c):
        *parents, key = path.split(".")
        node = c
        for p in parents:
            node = node[p]
        if value is _DROP:
            del node[key]
        else:
            node[key] = value

    return edit


_DROP = object()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("num_target_layers", 5), "reads a target of 5 layers (num_target_layers); the given target has 3"),
        (_set("dflash_config.target_layer_ids", [0, 2]), "include the target's last layer 2"),
        (_set("dflash_config.target_layer_ids", [1]), "weights do not fit the drafter config"),
        (_set("dflash_config.mask_token_id", _DROP), "no dflash_config.mask_token_id"),
        (_set("architectures", ["DFlash2DraftModel"]), "a DFlash2 drafter without conv_kernel_size"),
        (_set("layer_types", ["sliding_attention"]), "sliding_attention blocks but sliding_window is not set"),
        (_set("layer_types", ["chunked_attention"]), "full_attention and sliding_attention blocks only"),
        (_set("use_swa", True), "use_swa=True is not supported"),
        (_set("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "RoPE scaling 'yarn'"),
    ],
)
def test_a_public_drafter_dllm_does_not_compute_is_refused(tmp_path: Path, edit, message: str):
    from dllm.checkpoint.loading import load_target
    from dllm.sampling.speculative import load_drafter as load_any_drafter

    target_dir, folder = public_folder(tmp_path, edit)
    target = load_target(target_dir).model
    with pytest.raises(CheckpointError) as e:
        load_any_drafter(folder, target)  # the registry path --draft takes
    assert message in str(e.value) and "\n" not in str(e.value), e.value


def test_a_drafter_with_no_public_layout_is_refused_by_convert(tmp_path: Path, capsys):
    """A dllm-architecture drafter folder (dllm's format) converted to the public layout: one line saying why."""
    from dllm.checkpoint.loading import load_target

    write_causal_target(tmp_path / "target")
    target = load_target(tmp_path / "target").model
    drafter = DFlashDrafter(DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(0, 2),
                                         mask_id=target.cfg.vocab_size - 1, target=target.cfg))  # fmt: skip
    drafter.init_weights(torch.Generator().manual_seed(0))
    folder = save_drafter(tmp_path / "old", drafter.attach(target))  # type: ignore[arg-type]
    assert load_drafter(folder, target).dcfg.architecture == "dllm"  # type: ignore[arg-type]
    code, _, err = run_cli(["convert", "--to-hf", tmp_path / "public", "--model", folder], capsys)
    one_line_error(code, err, "architecture dllm")
    assert not (tmp_path / "public").exists()
    code, _, err = run_cli(["convert", "--to-hf", tmp_path / "x", "--model", folder, "--target", "t"], capsys)
    one_line_error(code, err, "--target goes with --from-hf")


def test_a_dflash_run_reading_the_targets_last_layer_is_refused_before_launch(workdir: Path, capsys):
    """architecture dflash cannot read the target's last layer (the public code takes it after the final norm):
    `dllm launch --dry-run` says so in one line, before any worker starts."""
    from tests.helpers import tiny_train_values, write_yaml

    write_causal_target(workdir / "target")
    objective = {"name": "dflash_distillation", "target": "target", "target_layer_ids": [0, 2], "block_size": 4,
                 "architecture": "dflash"}  # fmt: skip
    train_yaml = write_yaml(workdir / "train.yaml", tiny_train_values(objective=objective))
    code, _, err = run_cli(["launch", "--config", train_yaml, "--dry-run"], capsys)
    one_line_error(code, err, "objective (dflash_distillation): architecture dflash: target_layer_ids include the "
                              "target's last layer 2")  # fmt: skip
