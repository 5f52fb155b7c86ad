"""Packaged recipes: every one validates; smoke recipes prepare, resolve and (slow) train on a CPU."""

from __future__ import annotations

import time
from importlib import resources
from pathlib import Path

import pytest
import torch
import typer

from dllm.cli import main as cli_main
from dllm.cli import recipe_cmd
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.registries import OBJECTIVES
from dllm.config.rules import check_topology
from dllm.config.spec import RunSpec
from dllm.data.prepare import prepare
from dllm.errors import UserError
from dllm.recipes import (
    AR_MODEL_DIR,
    BYTE_VOCAB_SIZE,
    CONFIG_FILES,
    RecipeInfo,
    chat_records,
    copy_recipe,
    list_recipes,
    recipe_files,
)
from dllm.training.preflight import resolve_run_spec

RECIPES = [r.name for r in list_recipes()]
# smoke recipes that say in their header that they need more than a minute on 2 CPU cores
TRAIN_BUDGET_S = {"editflow-smoke": 600}
SMOKE = [r.name for r in list_recipes() if r.kind == "smoke"]
INFO = {r.name: r for r in list_recipes()}


def _write_configs(name: str, folder: Path) -> tuple[RunSpec, PrepareSpec]:
    folder.mkdir(parents=True, exist_ok=True)
    for fname, text in recipe_files(name).items():
        (folder / fname).write_text(text, encoding="utf-8")
    return load_config(RunSpec, folder / "train.yaml"), load_config(PrepareSpec, folder / "prepare.yaml")


def _copy_and_prepare(name: str, folder: Path) -> RunSpec:
    copy_recipe(name, folder)
    prepare(load_config(PrepareSpec, folder / "prepare.yaml"), folder)
    spec, warnings = resolve_run_spec(load_config(RunSpec, folder / "train.yaml"))
    assert warnings == [], f"{name}: a setting without effect: {warnings}"
    return spec


def test_index_matches_the_recipe_folders():
    package = resources.files("dllm.recipes")
    folders = {p.name for p in package.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert sorted(folders) == sorted(RECIPES)
    assert len(set(RECIPES)) == len(RECIPES)
    for name in RECIPES:
        assert all((package / name / f).is_file() for f in CONFIG_FILES)
    smoke = {
        "mdlm",
        "sft",
        "bd3lm",
        "fast-dllm-v2",
        "uniform",
        "a2d-mdlm",
        "a2d-bd3lm",
        "ar",
        "dflash",
        "grpo",
        "editflow",
    }
    templates = {
        "qwen3-0.6b-bd3lm",
        "llada-8b-sft",
        "qwen2.5-fast-dllm-v2",
        "mdlm-small-pretrain",
        "dflash-qwen3-8b",
        "editflow-small-sft",
    }
    for name in RECIPES:  # a recipe trained first is a smoke recipe listed before
        after = INFO[name].after
        assert after is None or (after in SMOKE and RECIPES.index(after) < RECIPES.index(name)), name
    assert {f"{s}-smoke" for s in smoke} <= set(SMOKE)
    assert templates <= set(RECIPES) - set(SMOKE)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_configs_validate_and_agree(name: str, tmp_path: Path):
    """Schema only (templates name folders that do not exist here), plus what must agree between the files."""
    spec, prep = _write_configs(name, tmp_path)
    assert spec.objective.name == INFO[name].objective
    assert spec.tokenizer == prep.tokenizer, "train.yaml must use the tokenizer that prepared the data"
    if spec.rl is not None:  # an rl run generates its batches from rl.prompts
        assert spec.data is None and spec.rl.prompts is not None and INFO[name].after is not None
    else:
        assert spec.data.path == prep.output and spec.data.seq_len == prep.seq_len
    check_topology(spec, spec.topology.world_size)
    block = getattr(spec.objective, "block_size", None)
    if block is not None and OBJECTIVES.has(spec.objective.name, "block"):  # a drafter's block is not the data's
        assert spec.data.seq_len % block == 0
        assert prep.pad_to_multiple == block, "documents start on block boundaries"
    assert spec.run.name == name


def _start_model(name: str, tmp_path: Path, train: bool = False) -> None:
    """What a recipe with `after` reads: the sibling recipe's folder, prepared (trained too when `train`),
    and for an rl recipe the model exported into it (random tiny weights when not trained: enough to resolve);
    a DFlash drafter's target run is read from its folder."""
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    after = INFO[name].after
    if after is None:
        return
    after_spec = _copy_and_prepare(after, tmp_path / after)
    run_dir = prepare_run_dir(after_spec)
    rl = "\nrl:" in recipe_files(name)["train.yaml"]
    if train:  # a drafter's target run, or an rl run's start model (exported from the trained run)
        from dllm.cli.convert_cmd import _export

        train_from_run_dir(run_dir)
        if rl:
            _export(tmp_path / after / "model", run_dir, None, None)
        return
    if not rl:  # a drafter reads its target run's folder and config (resolving reads no weights)
        return
    from dllm.models import Transformer
    from dllm.models.hf_io import export_hf

    model = Transformer(after_spec.model)
    model.init_weights(torch.Generator().manual_seed(0))
    export_hf(model.state_dict(), after_spec.model, tmp_path / after / "model")


@pytest.mark.parametrize("name", SMOKE)
def test_smoke_recipe_copies_prepares_and_resolves(name: str, tmp_path: Path):
    _start_model(name, tmp_path)
    spec = _copy_and_prepare(name, tmp_path / name)
    assert spec.training.device == "auto" and spec.topology.world_size == 1
    if INFO[name].ar_model:
        assert spec.model.init_from == (tmp_path / name / AR_MODEL_DIR).absolute()
        assert spec.model.family == "llama" and spec.model.vocab_size == BYTE_VOCAB_SIZE


def test_copy_refuses_unknown_names_and_non_empty_folders(tmp_path: Path):
    with pytest.raises(UserError, match="unknown recipe 'nope'; known: mdlm-smoke, sft-smoke"):
        copy_recipe("nope", tmp_path / "a")
    assert not (tmp_path / "a").exists()
    copy_recipe("sft-smoke", tmp_path / "a")
    with pytest.raises(UserError, match="not empty; choose a new folder or pass --force"):
        copy_recipe("mdlm-smoke", tmp_path / "a")
    written = copy_recipe("mdlm-smoke", tmp_path / "a", force=True)
    assert [p.name for p in written] == ["prepare.yaml", "train.yaml", "train.jsonl"]
    assert (tmp_path / "a" / "train.yaml").read_text() == recipe_files("mdlm-smoke")["train.yaml"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is not a folder"):
        copy_recipe("mdlm-smoke", tmp_path / "file", force=True)


def test_templates_copy_only_their_configs(tmp_path: Path):
    written = copy_recipe("llada-8b-sft", tmp_path / "t")
    assert [p.name for p in written] == ["prepare.yaml", "train.yaml"]
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["prepare.yaml", "train.yaml"]


def test_chat_records_are_seeded_sums():
    records = chat_records(3, seed=1)
    assert records == chat_records(3, seed=1) != chat_records(3, seed=2)
    user, assistant = records[0]["messages"]
    question = user["content"].removeprefix("What is ").removesuffix("?")
    a, b = (int(x) for x in question.split(" + "))
    assert assistant == {"role": "assistant", "content": f"{question} = {a + b}."}


def test_index_entries_are_checked():
    with pytest.raises(ValueError, match="must generate its data"):
        RecipeInfo(name="x", objective="mdlm", kind="smoke", description="d")
    with pytest.raises(ValueError, match="brings its own data"):
        RecipeInfo(name="x", objective="mdlm", kind="template", description="d", ar_model=True)


# ---- CLI ----------------------------------------------------------------------------------------


@pytest.fixture
def dllm(monkeypatch: pytest.MonkeyPatch):
    """`dllm.cli.main.main` over an app that has the recipe group (registered here, test-locally)."""
    app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
    app.add_typer(recipe_cmd.app, name="recipe")
    monkeypatch.setattr(cli_main, "app", app)
    return cli_main.main


def test_cli_list(dllm, capsys: pytest.CaptureFixture[str]):
    assert dllm(["recipe", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "objective", "kind", "description"]
    assert [ln.split()[0] for ln in lines[1:]] == RECIPES
    row = next(ln for ln in lines if ln.startswith("bd3lm-smoke "))
    assert row.split()[1:3] == ["bd3lm", "smoke"] and INFO["bd3lm-smoke"].description in row


def test_cli_show(dllm, capsys: pytest.CaptureFixture[str]):
    assert dllm(["recipe", "show", "uniform-smoke"]) == 0
    text = capsys.readouterr().out
    assert "# ==> uniform-smoke/prepare.yaml <==" in text and "# ==> uniform-smoke/train.yaml <==" in text
    assert recipe_files("uniform-smoke")["train.yaml"].strip() in text


def test_cli_copy_prints_the_next_commands(dllm, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    dest = tmp_path / "run"
    assert dllm(["recipe", "copy", "sft-smoke", str(dest)]) == 0
    err = capsys.readouterr().err
    assert f"dllm data prepare --config {dest / 'prepare.yaml'}" in err
    assert f"dllm launch --config {dest / 'train.yaml'}" in err
    assert (dest / "data" / "train.jsonl").is_file()
    assert dllm(["recipe", "copy", "sft-smoke", str(dest), "--force"]) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["recipe", "show", "nope"], "dllm: error: unknown recipe 'nope'; known: mdlm-smoke"),
        (["recipe", "copy", "nope", "{tmp}/x"], "dllm: error: unknown recipe 'nope'"),
        (["recipe", "copy", "mdlm-smoke", "{tmp}"], "dllm: error: {tmp} is not empty"),
        (["recipe", "copy", "mdlm-smoke"], "dllm: error: Missing argument"),
    ],
)
def test_cli_errors_are_one_line(dllm, tmp_path: Path, capsys, args: list[str], message: str):
    (tmp_path / "keep").write_text("x")
    assert dllm([a.format(tmp=tmp_path) for a in args]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message.format(tmp=tmp_path)) and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err and captured.out == ""


# ---- training (slow) ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOKE)
def test_smoke_recipe_trains_in_a_minute(name: str, tmp_path: Path):
    """Copy, prepare and train with the recipe's own settings: the loss falls, in under 60 s on a CPU."""
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    _start_model(name, tmp_path, train=True)  # not timed
    t0 = time.perf_counter()
    spec = _copy_and_prepare(name, tmp_path / name)
    losses = train_from_run_dir(prepare_run_dir(spec))
    elapsed_s = time.perf_counter() - t0
    if spec.rl is not None:  # one loss per round, near 0 by construction (advantages have mean 0 per group)
        assert len(losses) == spec.training.steps // spec.rl.inner_updates and elapsed_s < 120
        return
    assert len(losses) == spec.training.steps
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
    assert elapsed_s < TRAIN_BUDGET_S.get(name, 60), f"{name} took {elapsed_s:.1f} s"
