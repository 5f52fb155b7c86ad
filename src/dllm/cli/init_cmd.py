"""`dllm init DIR`: a ready-to-run folder with prepare.yaml, train.yaml, sample data and a README."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import typer

from dllm.cli.common import info
from dllm.cli.outputs import check_output_place
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.config.templates import commented_yaml
from dllm.data.synthetic import demo_records
from dllm.errors import UserError

NUM_RECORDS = 20000
MAX_RECORDS = 1_000_000
"""Most sample records `--num-records` may ask for (they are generated in memory)."""

PREPARE_VALUES: dict[str, Any] = {
    "tokenizer": {"kind": "byte"},
    "sources": [
        {"kind": "jsonl", "path": "data/sentences.jsonl", "format": "text", "text_field": "text"},
        {
            "kind": "jsonl",
            "path": "data/arithmetic.jsonl",
            "format": "prompt_completion",
            "supervision": "completion_only",
        },
    ],
    "output": "data/prepared",
    "seq_len": 64,
    # written out so the template shows the choice: sentences split across rows, each sum whole in one row
    "layout": "packed",
    "packing": "auto",
    "append_eos": True,
    "pad_to_multiple": 16,
}

TRAIN_VALUES: dict[str, Any] = {
    "run": {"name": "demo", "output_dir": "runs"},
    "model": {"preset": "demo"},
    "tokenizer": {"kind": "byte"},
    "data": {"path": "data/prepared", "seq_len": 64},
    "objective": {"name": "mdlm", "schedule": "linear", "eps": 0.001, "antithetic": True},
    "training": {"steps": 600, "global_batch_size": 64, "micro_batch_size": 32, "seed": 0, "device": "auto"},
    "optimizer": {"name": "adamw", "lr": 5e-3, "weight_decay": 0.1},
    "scheduler": {"name": "cosine", "warmup_steps": 30, "min_lr_ratio": 0.05},
    "checkpointing": {"every_steps": 100, "keep_last_n": 2},
    "logging": {"every_steps": 20},
    "topology": {"nproc_per_node": 1, "data_parallel": "fsdp"},
}

PREPARE_HEADER = "dllm data preparation config. `dllm config schema --prepare` lists every field."
TRAIN_HEADER = (
    "dllm training config (RunSpec). `dllm config schema` lists every field; paths are relative to this file."
)

README = """# A dllm run folder

    dllm data prepare --config prepare.yaml          # data/*.jsonl -> data/prepared
    dllm data validate data/prepared --config train.yaml
    dllm config validate --config train.yaml
    dllm launch --config train.yaml                  # add --nproc-per-node 2 for two processes
    dllm generate --run runs/latest --prompt "12 + 7 ="

The data is generated so that you can see the model learn: `data/sentences.jsonl` holds templated
sentences ({"text": ...} records, every token trained on) and `data/arithmetic.jsonl` addition
problems ({"prompt": "12 + 7 =", "completion": " 19"}; only the completion is noised and trained on).
Rows of 64 tokens hold several records: sentences are cut across rows wherever a row ends, and each
prompt/completion record is kept whole in one row (`packing: auto`), so that no completion trains
without its prompt; `dllm data stats data/prepared` shows how many records a row boundary split.
Replace them with your own JSONL records and edit `sources` in prepare.yaml.
Every config field is described in `dllm config schema`.
"""


def init(
    directory: Path = typer.Argument(..., help="Folder to create (must be empty or absent)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty folder, replacing these files."),
    num_records: int = typer.Option(
        NUM_RECORDS, "--num-records", min=1, max=MAX_RECORDS, help="Sample records to generate."
    ),
) -> None:
    """Create a run folder with configs and a generated sample corpus."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UserError(f"{directory} exists and is not a folder")
    check_output_place(directory, "DIRECTORY", folder=True)
    if directory.exists() and any(directory.iterdir()) and not force:
        raise UserError(f"{directory} is not empty; choose a new folder or pass --force")
    texts, sums = demo_records(num_records, seed=0)
    files = {
        "data/sentences.jsonl": "".join(json.dumps(r) + "\n" for r in texts),
        "data/arithmetic.jsonl": "".join(json.dumps(r) + "\n" for r in sums),
        "prepare.yaml": commented_yaml(PrepareSpec, PREPARE_VALUES, PREPARE_HEADER),
        "train.yaml": commented_yaml(RunSpec, TRAIN_VALUES, TRAIN_HEADER),
        "README.md": README,
    }
    _write_all(directory, files)
    info(
        f"wrote {directory}/prepare.yaml, train.yaml, data/sentences.jsonl ({len(texts)} records), "
        f"data/arithmetic.jsonl ({len(sums)} records), README.md"
    )
    info(f"next: cd {directory} && dllm data prepare --config prepare.yaml")


def _write_all(directory: Path, files: dict[str, str]) -> None:
    """Write every file (each through a temp file renamed into place); a failure (no permission, a full
    disk, a folder that takes no files such as /proc) is one line and removes what this call created."""
    created = [p for p in (directory / "data", directory, *directory.parents) if not p.exists()]
    written: list[Path] = []
    try:
        (directory / "data").mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = directory / name
            tmp = path.with_name(path.name + ".tmp")
            written.append(tmp)
            tmp.write_text(text, encoding="utf-8")
            if not path.exists():
                written.append(path)
            tmp.replace(path)
    except OSError as e:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        for folder in created:  # the folders this call made, deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or type(e).__name__)
        raise UserError(f"{directory}: cannot write the run folder ({reason.lower()}); choose another folder") from None
