"""PrepareSpec: the typed `prepare.yaml` that turns a corpus into a training artifact.

A source says where records come from (`kind`: jsonl, parquet, text, hf_dataset, npy) and how a
record becomes tokens (`format`: text, messages, prompt_completion, tokens) with which tokens are
supervised (`supervision`). The top level says how documents are cut and laid out.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dllm.config.base import Int, OutputFolder, PathPattern, Section
from dllm.config.data import TokenizerConfig
from dllm.config.registries import LAYOUTS, RECORD_FORMATS

Format = Literal[RECORD_FORMATS.names()]  # type: ignore[valid-type]
Supervision = Literal["auto", "full", "completion_only", "assistant_only", "provided"]

# which supervision each record format accepts; the first one is what `auto` means
_SUPERVISION: dict[str, tuple[str, ...]] = {
    "text": ("full",),
    "prompt_completion": ("completion_only", "full"),
    "messages": ("assistant_only", "full"),
    "tokens": ("full", "provided"),
}


class RecordFields(Section):
    """How one record becomes token ids and a supervision mask."""

    format: Format = "text"
    """Record shape: text, messages (chat turns), prompt_completion, or tokens (pre-tokenized ids)."""
    text_field: str = "text"
    """Dotted path of the text (format text), e.g. `text` or `meta.body`."""
    messages_field: str = "messages"
    """Dotted path of the list of {role, content} turns (format messages)."""
    prompt_field: str = "prompt"
    """Dotted path of the prompt, a string or a list of turns (format prompt_completion)."""
    completion_field: str = "completion"
    """Dotted path of the completion, a string or a list of turns (format prompt_completion)."""
    input_ids_field: str = "input_ids"
    """Dotted path of the token id list (format tokens)."""
    labels_field: str | None = None
    """Dotted path of per-token labels; -100 marks a token that is not trained on (format tokens)."""
    loss_mask_field: str | None = None
    """Dotted path of a per-token 0/1 loss mask (format tokens)."""
    supervision: Supervision = "auto"
    """Trained (and noised) tokens: full, completion_only, assistant_only (chat-template spans), provided."""

    @model_validator(mode="after")
    def _check_supervision(self) -> RecordFields:
        allowed = _SUPERVISION[self.format]
        if self.supervision != "auto" and self.supervision not in allowed:
            raise ValueError(
                f"supervision {self.supervision} does not apply to format {self.format}; use {' or '.join(allowed)}"
            )
        if self.format == "tokens" and self.labels_field and self.loss_mask_field:
            raise ValueError("give labels_field or loss_mask_field, not both")
        if self.resolved_supervision == "provided" and not (self.labels_field or self.loss_mask_field):
            raise ValueError("supervision provided needs labels_field or loss_mask_field")
        return self

    @property
    def resolved_supervision(self) -> str:
        if self.supervision != "auto":
            return self.supervision
        if self.format == "tokens" and (self.labels_field or self.loss_mask_field):
            return "provided"
        return _SUPERVISION[self.format][0]


class JsonlSourceConfig(RecordFields):
    """JSON Lines files (plain or .gz), one record per line."""

    kind: Literal["jsonl"] = "jsonl"
    """Source kind: jsonl."""
    path: PathPattern
    """File or glob relative to this config file (matches are read in sorted order)."""


class ParquetSourceConfig(RecordFields):
    """Parquet files; each row is a record (columns are fields)."""

    kind: Literal["parquet"] = "parquet"
    """Source kind: parquet."""
    path: PathPattern
    """File or glob relative to this config file (matches are read in sorted order)."""


class TextSourceConfig(RecordFields):
    """Plain text files: one document per file, or one per non-empty line."""

    kind: Literal["text"] = "text"
    """Source kind: text."""
    path: PathPattern
    """File or glob relative to this config file (matches are read in sorted order)."""
    per_line: bool = False
    """One document per non-empty line instead of one per file."""

    @model_validator(mode="after")
    def _text_only(self) -> TextSourceConfig:
        if self.format != "text" or self.text_field != "text":
            raise ValueError("a text source has format text and yields {text: ...}; leave format and text_field unset")
        return self


class HFDatasetSourceConfig(RecordFields):
    """A Hugging Face `datasets` dataset on local disk (never downloaded)."""

    kind: Literal["hf_dataset"] = "hf_dataset"
    """Source kind: hf_dataset."""
    path: PathPattern
    """A folder written by `save_to_disk`, or a builder name (json, parquet, csv, text) with data_files."""
    data_files: list[PathPattern] | None = None
    """Local files or globs for `load_dataset(path, data_files=...)`, relative to this config file."""
    split: str = "train"
    """Split to read."""


class NpySourceConfig(RecordFields):
    """Pre-tokenized ids in .npy files: a 1-D array is one document, a 2-D array one per row (-1 pads)."""

    kind: Literal["npy"] = "npy"
    """Source kind: npy."""
    path: PathPattern
    """File or glob relative to this config file (matches are read in sorted order)."""
    format: Format = "tokens"
    """Record shape: always tokens for npy."""

    @model_validator(mode="after")
    def _tokens_only(self) -> NpySourceConfig:
        if self.format != "tokens" or self.resolved_supervision != "full" or self.input_ids_field != "input_ids":
            raise ValueError("an npy source yields {input_ids: ...} with full supervision; leave format unset")
        return self


SourceConfig = Annotated[
    JsonlSourceConfig | ParquetSourceConfig | TextSourceConfig | HFDatasetSourceConfig | NpySourceConfig,
    Field(discriminator="kind"),
]

MAX_ROW_TOKENS = 1 << 20
"""Longest row (and padding multiple) prepare lays out, 1,048,576 tokens: a row is built in memory."""

_KIND_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text", ".npy": "npy"}


class PrepareSpec(Section):
    """How `dllm data prepare` reads, tokenizes, cuts and lays out a corpus."""

    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer (training must use the same one)."""
    sources: list[SourceConfig] = Field(min_length=1)
    """Where the records come from, read in the order listed."""
    output: OutputFolder
    """Artifact folder to write (staged in a temporary folder, then renamed into place)."""
    seq_len: Int = Field(gt=1, le=MAX_ROW_TOKENS)
    """Tokens per training row (the training data.seq_len); the longest sample in layout indexed."""
    layout: Literal[LAYOUTS.names()] = "packed"  # type: ignore[valid-type]
    """packed: several documents per row (see packing); indexed: one sample per row, stored at its own length."""
    packing: Literal["auto", "whole", "split"] = "auto"
    """Layout packed: whole keeps each record in one row (best fit), split cuts anywhere; auto: split text, bare ids."""
    append_eos: bool = True
    """Put EOS after every document (the separator between packed documents)."""
    add_bos: bool = False
    """Put BOS before every document (when the tokenizer has one)."""
    max_length: Int | None = Field(default=None, gt=0)
    """Longest document in tokens (EOS/BOS included); null: seq_len for records kept whole, else no limit."""
    overflow: Literal["reject", "truncate_left", "truncate_right", "split"] = "reject"
    """A longer document is skipped (counted), cut keeping its end or its start, or split in pieces."""
    pad_to_multiple: Int | None = Field(default=None, gt=0, le=MAX_ROW_TOKENS)
    """Pad each document with supervised EOS to a multiple of this (block alignment; teaches EOS fill)."""
    on_bad_record: Literal["fail", "skip"] = "fail"
    """A malformed record stops preparation with its file:line, or is skipped and counted."""

    @model_validator(mode="before")
    @classmethod
    def _infer_source_kind(cls, data: Any) -> Any:
        """A source without `kind` gets it from its file suffix (.parquet, .txt, .npy), else jsonl."""
        if isinstance(data, dict) and isinstance(data.get("sources"), list):
            sources = []
            for src in data["sources"]:
                if isinstance(src, dict) and "kind" not in src:
                    path = src.get("path") if isinstance(src.get("path"), str) else ""
                    path = path[: -len(".gz")] if path.endswith(".gz") else path  # x.txt.gz is text
                    suffix = "." + path.rsplit(".", 1)[-1] if "." in path else ""
                    src = {**src, "kind": _KIND_BY_SUFFIX.get(suffix, "jsonl")}
                sources.append(src)
            data = {**data, "sources": sources}
        return data

    @model_validator(mode="after")
    def _check_lengths(self) -> PrepareSpec:
        if self.layout == "indexed" and self.packing == "split":
            raise ValueError("packing split does not apply to layout indexed (a sample is one row); remove it")
        if self.layout == "indexed" and self.max_length is not None and self.max_length > self.seq_len:
            raise ValueError(
                f"max_length {self.max_length} exceeds seq_len {self.seq_len}: an indexed sample fills one row"
            )
        if self.layout == "indexed" and self.overflow == "split":
            raise ValueError(
                "overflow split does not apply to layout indexed (a sample is one row); use reject or truncate_*"
            )
        whole = [src for src in self.sources if self.keeps_whole(src)]
        if self.layout == "packed" and whole and self.max_length is not None and self.max_length > self.seq_len:
            raise ValueError(
                f"max_length {self.max_length} exceeds seq_len {self.seq_len}: packing {self.packing} keeps each "
                f"{whole[0].format} record whole in one row; lower max_length or set packing: split"
            )
        if self.pad_to_multiple:
            for limit in sorted({self.length_limit_of(src) for src in self.sources} - {None}):
                if limit % self.pad_to_multiple:
                    why = "" if self.max_length is not None else " (seq_len: the longest record kept whole in a row)"
                    raise ValueError(
                        f"pad_to_multiple {self.pad_to_multiple} must divide the length limit {limit}{why}"
                    )
        return self

    def keeps_whole(self, src: RecordFields) -> bool:
        """Whether the records of `src` are each kept in one row (always, in layout indexed).

        `auto` keeps whole the records whose supervised tokens need the rest of the record as context
        (a prompt, the earlier turns of a chat, tokens labelled by the user): a row boundary inside
        one would train its targets without that context. Text is split across rows as it comes."""
        if self.layout == "indexed" or self.packing == "whole":
            return True
        if self.packing == "split":
            return False
        return src.format in ("prompt_completion", "messages") or src.resolved_supervision == "provided"

    def length_limit_of(self, src: RecordFields) -> int | None:
        """The longest document of `src`: max_length, else seq_len when its records are kept whole."""
        if self.max_length is not None:
            return self.max_length
        return self.seq_len if self.keeps_whole(src) else None

    @property
    def packing_mode(self) -> str:
        """What the artifact records: whole or split (every source alike), or mixed."""
        modes = {"whole" if self.keeps_whole(src) else "split" for src in self.sources}
        return modes.pop() if len(modes) == 1 else "mixed"
