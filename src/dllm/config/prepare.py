"""PrepareSpec: the typed `prepare.yaml` that turns a corpus into a training artifact."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dllm.config.base import RelPath, Section
from dllm.config.spec import TokenizerConfig


class JsonlSourceConfig(Section):
    """JSON Lines files, one record per line."""

    kind: Literal["jsonl"] = "jsonl"
    """Source kind: jsonl."""
    path: str
    """File or glob relative to this config file (matches are read in sorted order)."""
    format: Literal["text", "prompt_completion"] = "text"
    """Record shape: text (one field) or prompt_completion (two fields, joined without a separator)."""
    text_field: str = "text"
    """Dotted path of the text inside each record (format text), e.g. `text` or `meta.body`."""
    prompt_field: str = "prompt"
    """Dotted path of the prompt (format prompt_completion)."""
    completion_field: str = "completion"
    """Dotted path of the completion (format prompt_completion)."""
    supervision: Literal["auto", "full", "completion_only"] = "auto"
    """Which tokens are trained on (and noised): auto is full for text, completion_only for prompt_completion."""

    @model_validator(mode="after")
    def _check_supervision(self) -> JsonlSourceConfig:
        if self.format == "text" and self.supervision == "completion_only":
            raise ValueError("supervision completion_only needs format prompt_completion")
        return self

    @property
    def completion_only(self) -> bool:
        return self.supervision == "completion_only" or (
            self.supervision == "auto" and self.format == "prompt_completion"
        )


class PrepareSpec(Section):
    """How `dllm data prepare` reads, tokenizes and packs a corpus."""

    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer (training must use the same one)."""
    sources: list[JsonlSourceConfig] = Field(min_length=1)
    """Where the records come from, read in the order listed."""
    output: RelPath
    """Artifact folder to write (staged in a temporary folder, then renamed into place)."""
    seq_len: int = Field(gt=1)
    """Tokens per packed sequence (the training data.seq_len)."""
    layout: Literal["packed"] = "packed"
    """packed: documents concatenated with a separator and cut into seq_len sequences."""
    append_eos: bool = True
    """Put EOS after every document (the separator between packed documents)."""
    add_bos: bool = False
    """Put BOS before every document (when the tokenizer has one)."""
    pad_to_multiple: int | None = Field(default=None, gt=0)
    """Pad each document with supervised EOS to a multiple of this (block alignment; teaches EOS fill)."""
