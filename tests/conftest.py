"""Shared fixtures: a tiny generated corpus, its prepared artifact, and tiny train configs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# one thread per process: the two cores are shared by everything the suite starts
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dllm.config.loading import load_config  # noqa: E402
from dllm.config.prepare import PrepareSpec  # noqa: E402
from tests.helpers import PREPARE, tiny_train_values, write_corpus, write_yaml  # noqa: E402


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder with data/train.jsonl, prepare.yaml and a prepared artifact."""
    from dllm.data.prepare import prepare

    write_corpus(tmp_path / "data" / "train.jsonl")
    write_yaml(tmp_path / "prepare.yaml", PREPARE)
    prepare(load_config(PrepareSpec, tmp_path / "prepare.yaml"), tmp_path)
    return tmp_path


@pytest.fixture
def train_yaml(workdir: Path) -> Path:
    return write_yaml(workdir / "train.yaml", tiny_train_values())
