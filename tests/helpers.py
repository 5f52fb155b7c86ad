"""Helpers shared by the tests (importable as `tests.helpers`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dllm.config.loading import load_config
from dllm.config.spec import RunSpec
from dllm.data.synthetic import demo_corpus
from dllm.models.output import ModelOutput


def write_corpus(path: Path, num_records: int = 400, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for text in demo_corpus(num_records, seed=seed):
            fh.write(json.dumps({"text": text}) + "\n")
    return path


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


PREPARE = {"sources": [{"path": "data/train.jsonl"}], "output": "data/prepared", "seq_len": 32}


def tiny_train_values(**sections: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "run": {"name": "t"},
        "model": {"preset": "tiny"},
        "data": {"path": "data/prepared", "seq_len": 32},
        "training": {"steps": 4, "global_batch_size": 8, "micro_batch_size": 4},
        "optimizer": {"lr": 1e-3},
        "checkpointing": {"every_steps": 2},
        "logging": {"every_steps": 1, "progress": "off", "tensorboard": "off"},
    }
    for name, upd in sections.items():
        values[name] = {**values.get(name, {}), **upd}
    return values


def load_spec(path: Path, *overrides: str) -> RunSpec:
    return load_config(RunSpec, path, list(overrides))


EOS = "<|endoftext|>"


def save_bpe(folder: Path, *, eos: bool = True, chat_template: str | None = None) -> Path:
    """A byte-level BPE trained here on generated text, saved as a transformers tokenizer folder."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(list(demo_corpus(300, seed=1)), trainer=trainer)
    kwargs = {"eos_token": EOS} if eos else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False, **kwargs)
    assert fast.mask_token_id is None
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return folder


def output_of_logits(logits_BLV: torch.Tensor) -> ModelOutput:
    """Ready-made logits as a model's output: an identity head over V features (fake models, losses)."""
    eye = torch.eye(logits_BLV.shape[-1], dtype=logits_BLV.dtype, device=logits_BLV.device)
    return ModelOutput(logits_BLV, lambda h: (h, eye, None))
