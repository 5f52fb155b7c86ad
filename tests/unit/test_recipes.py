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
from dllm.data.synthetic import held_out_sums
from dllm.errors import UserError
from dllm.recipes import (
    AR_MODEL_DIR,
    BYTE_VOCAB_SIZE,
    CONFIG_FILES,
    ENCODER_MODEL_DIR,
    HELDOUT_MAX_OPERAND,
    RecipeInfo,
    chat_records,
    copy_recipe,
    list_recipes,
    recipe_files,
    rl_sums,
    sft_sums,
)
from dllm.training.preflight import resolve_run_spec

RECIPES = [r.name for r in list_recipes()]
TRAIN_STEPS_IN_TEST = {"grpo-smoke": 100, "editflow-smoke": 1000}
"""Recipes whose full run is their measured result (docs/rl.md, bench/edit_flow_eval.py: 800 and 3000
steps): this test trains the first steps of their own settings, keeping the suite short."""
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
    smoke = {"mdlm", "sft", "bd3lm", "fast-dllm-v2", "uniform", "a2d-mdlm", "a2d-bd3lm", "ar", "dflash", "grpo",
             "bert-chat", "editflow", "llada2", "nemotron-diffusion", "qwen3.5-fast-dllm-v2",
             "a2d-diffusiongemma"}  # fmt: skip
    templates = {"qwen3-0.6b-bd3lm", "llada-8b-sft", "qwen2.5-fast-dllm-v2", "mdlm-small-pretrain", "dflash-qwen3-8b",
                 "bert-chat-modernbert-large", "editflow-small-sft", "grpo-llada-8b-gsm8k",
                 "llada2-mini-sft", "nemotron-labs-diffusion-8b", "qwen3.5-fast-dllm-v2"}  # fmt: skip
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
        assert spec.data is None and spec.rl.prompts is not None
        assert INFO[name].after is not None or INFO[name].kind == "template"  # a start model: trained first, or yours
        from dllm.config.rules import check_rl

        check_rl(spec)  # rounds, checkpoints and groups per rank agree (no model folder needed)
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
        from dllm.cli.main import main

        train_from_run_dir(run_dir)
        if rl:
            assert main(["convert", "--to-hf", str(tmp_path / after / "model"), "--run", str(run_dir)]) == 0
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
        family = {"llama": "llama", "gemma4": "diffusion_gemma"}[INFO[name].ar_family]
        assert spec.model.family == family and spec.model.vocab_size == BYTE_VOCAB_SIZE
    if INFO[name].encoder_model:  # an encoder-only masked LM, imported from the Hugging Face folder `copy` wrote
        assert spec.model.init_from == (tmp_path / name / ENCODER_MODEL_DIR).absolute()
        assert spec.model.family == "modernbert" and spec.model.head == "mlm" and not spec.model.shift_logits


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


def test_bert_chat_template_starts_from_a_hub_id_without_the_network(tmp_path: Path):
    """Validating the template reads no hub: its init_from stays the id; its data trains assistant replies only."""
    spec, prep = _write_configs("bert-chat-modernbert-large", tmp_path)
    assert spec.model.init_from == "answerdotai/ModernBERT-large" and spec.model.preset is None
    assert prep.sources[0].supervision == "assistant_only" and prep.tokenizer.mask_token == "[MASK]"
    assert spec.training.autocast_dtype == "bfloat16" and spec.topology.data_parallel == "fsdp"
    assert 1024 <= spec.data.seq_len <= 2048 and spec.optimizer.lr == 1e-4


def test_bert_chat_template_documents_a_working_chat_template(tmp_path: Path):
    """The chat template its prepare.yaml spells out marks the reply and its [SEP] as the only supervised
    tokens, and ends a generation prompt with the assistant header (checked on a local BPE tokenizer)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from dllm.tokenization.hf import HFTokenizer
    from tests.helpers import save_bpe

    lines = recipe_files("bert-chat-modernbert-large")["prepare.yaml"].splitlines()
    (jinja,) = [ln.removeprefix("  #   ") for ln in lines if ln.startswith("  #   {%- for m in messages")]
    tok = AutoTokenizer.from_pretrained(str(save_bpe(tmp_path / "src", eos=False)))
    tok.add_special_tokens({"sep_token": "[SEP]", "mask_token": "[MASK]"})
    tok.eos_token, tok.chat_template = "[SEP]", jinja  # what the comment tells to do
    tok.save_pretrained(str(tmp_path / "chat"))
    hf = HFTokenizer(tmp_path / "chat", mask_token="[MASK]")
    turns = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}]
    enc = hf.apply_chat_template(turns)
    supervised = [i for i, m in zip(enc.ids, enc.assistant_mask, strict=True) if m]
    assert hf.decode(supervised, skip_special=False) == "2 + 3 = 5.[SEP]" and supervised[-1] == hf.eos_id
    prompt = hf.apply_chat_template(turns[:1], add_generation_prompt=True).ids
    assert hf.decode(prompt) == "<|user|>\nWhat is 2 + 3?\n<|assistant|>\n" and enc.ids[: len(prompt)] == prompt


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


def test_rl_sums_leave_out_the_held_out_examples():
    """grpo-smoke's prompts: every sum up to HELDOUT_MAX_OPERAND once, right, and none that `dllm eval tasks
    --tasks addition --limit 200` scores (seed 0), so that evaluation is on prompts never rewarded."""
    from dllm.evaluation.tasks import load_task

    records = rl_sums(10_000)
    held_out = {e.prompt for e in load_task("addition", 200).examples}
    assert {f"{a} + {b} =" for a, b in held_out_sums()} == held_out and len(held_out) == 154  # distinct prompts
    prompts = [r["prompt"] for r in records]
    assert len(set(prompts)) == len(prompts) == (HELDOUT_MAX_OPERAND + 1) ** 2 - len(held_out) == 746
    assert not set(prompts) & held_out
    for r in records:
        a, b = (int(x) for x in r["prompt"].removesuffix(" =").split(" + "))
        assert r["answer"] == r["completion"] == f" {a + b}"
    assert rl_sums(10) == records[:10] and rl_sums(10, seed=1) != records[:10]


def test_sft_start_data_leaves_out_the_held_out_examples(tmp_path: Path):
    """sft-start's copied corpus (sft_sums): right sums of operands up to HELDOUT_MAX_OPERAND, none of them a
    prompt that `dllm eval tasks --tasks addition --limit 200` scores, and the same trainable sums rl_sums has."""
    import json

    from dllm.evaluation.tasks import load_task

    assert INFO["sft-start"].data == "sft_sums" and INFO["grpo-smoke"].data == "rl_sums"
    copy_recipe("sft-start", tmp_path)
    records = [json.loads(line) for line in (tmp_path / "data/train.jsonl").read_text().splitlines()]
    assert records == sft_sums(len(records)) and len(records) == 2000
    held_out = {e.prompt for e in load_task("addition", 200).examples}
    prompts = {r["prompt"] for r in records}
    assert not prompts & held_out
    assert prompts <= {r["prompt"] for r in rl_sums(10_000)} and len(prompts) > 600  # most of the 746 drawn
    for r in records:
        a, b = (int(x) for x in r["prompt"].removesuffix(" =").split(" + "))
        assert r["completion"] == f" {a + b}" and max(a, b) <= HELDOUT_MAX_OPERAND
    assert max(max(int(x) for x in p.removesuffix(" =").split(" + ")) for p in prompts) == HELDOUT_MAX_OPERAND
    assert sft_sums(5, seed=1) != records[:5]


def test_grpo_smoke_reads_its_copied_sums_as_prompts(tmp_path: Path):
    """The copied data/train.jsonl is what rl.prompts.path reads: the same prompts, with their answers."""
    from dllm.rl.prompts import load_prompts
    from dllm.tokenization.byte import ByteTokenizer

    copy_recipe("grpo-smoke", tmp_path)
    spec = load_config(RunSpec, tmp_path / "train.yaml")
    assert spec.rl is not None and spec.rl.prompts is not None
    task = load_prompts(spec.rl.prompts, ByteTokenizer())
    records = rl_sums(spec.rl.prompts.num_prompts)
    assert [(e.prompt, e.answer) for e in task.examples] == [(r["prompt"], r["answer"]) for r in records]


def test_index_entries_are_checked():
    with pytest.raises(ValueError, match="must generate its data"):
        RecipeInfo(name="x", objective="mdlm", kind="smoke", description="d")
    with pytest.raises(ValueError, match="brings its own data"):
        RecipeInfo(name="x", objective="mdlm", kind="template", description="d", ar_model=True)
    with pytest.raises(ValueError, match="set ar_model: true"):
        RecipeInfo(name="x", objective="mdlm", kind="smoke", data="demo_sums", description="d", ar_family="gemma4")


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
    """Copy, prepare and train with the recipe's own settings: the loss falls, in under 60 s of one CPU core.

    Timed in this process's CPU time (the suite pins one thread per process): `make test` runs two workers
    on the machine's cores, so the wall time here depends on what the other worker runs."""
    from dllm.training.run import prepare_run_dir, train_from_run_dir

    _start_model(name, tmp_path, train=True)  # not timed
    t0 = time.process_time()
    spec = _copy_and_prepare(name, tmp_path / name)
    if name in TRAIN_STEPS_IN_TEST:
        training = spec.training.model_copy(update={"steps": TRAIN_STEPS_IN_TEST[name]})
        spec = spec.model_copy(update={"training": training})
    losses = train_from_run_dir(prepare_run_dir(spec))
    elapsed_s = time.process_time() - t0
    if spec.rl is not None:  # one loss per round, near 0 by construction (advantages have mean 0 per group)
        assert len(losses) == spec.training.steps // spec.rl.inner_updates and elapsed_s < 120
        return
    assert len(losses) == spec.training.steps
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.8 * first, f"{name}: loss {first:.3f} -> {last:.3f}"
    assert elapsed_s < 60, f"{name} took {elapsed_s:.1f} s of CPU time"
