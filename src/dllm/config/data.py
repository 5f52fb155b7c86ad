"""The tokenizer and prepared-data sections of a RunSpec."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dllm.config.base import Int, PathOrHubId, RelPath, Section
from dllm.config.registries import TOKENIZERS


class TokenizerConfig(Section):
    """Which tokenizer turns text into ids (the same one must prepare the data and train)."""

    kind: Literal[TOKENIZERS.names()] = "byte"  # type: ignore[valid-type]
    """byte: 256 byte ids + specials, needs no files; hf: a Hugging Face tokenizer folder on disk."""
    path: PathOrHubId | None = None
    """Folder with tokenizer.json / tokenizer_config.json, or a hub id org/name[@revision] (kind hf only)."""
    mask_token: str = "<|mask|>"
    """Mask token added to an hf tokenizer that has none."""

    @model_validator(mode="after")
    def _check_path(self) -> TokenizerConfig:
        needs_path = TOKENIZERS.has(self.kind, "path")
        if needs_path and self.path is None:
            raise ValueError(f"kind {self.kind!r} needs path: a local tokenizer folder")
        if not needs_path and self.path is not None:
            raise ValueError(f"kind {self.kind!r} takes no path; remove it or use kind 'hf'")
        return self


class DataConfig(Section):
    """The prepared training data."""

    path: RelPath
    """Artifact folder written by `dllm data prepare`."""
    seq_len: Int = Field(gt=0)
    """Tokens per training sequence; must equal the artifact's packed length."""
    shuffle: bool = True
    """Visit sequences in a seeded random order (a new permutation each epoch)."""
    document_mask: bool = True
    """Packed documents attend only within themselves, not across the separator into their neighbours."""
