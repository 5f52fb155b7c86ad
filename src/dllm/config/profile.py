"""DecodeProfile: the facts a trained model needs at inference, recorded once when its run is built.

Sampling, evaluation, serving and export read these facts from the profile; none of them works
them out again from objective names or model fields. The profile is saved as `decode_profile.json`
in every checkpoint folder and beside `config.json` in every exported model folder.

Each objective section says how its models decode (`decode_facts()` in config/objectives.py), so
a new objective brings its own facts; `build_profile` adds the model's and the tokenizer's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from dllm.config.base import Float, Int, Section
from dllm.config.registries import SCHEDULES
from dllm.config.untrusted import read_json
from dllm.errors import CheckpointError

PROFILE_FILE = "decode_profile.json"
PROFILE_VERSION = 1
MAX_LENGTH = 2**24
"""The longest sequence a decode profile may record (16M positions, past any model's): a bound on what is
read from a folder a user was handed."""


class DecodeProfile(Section):
    """How a model decodes: attention layout, blocks, logit shift, noise, special ids, length."""

    version: Int = PROFILE_VERSION
    """Format version of this record."""
    objective: str | None = None
    """The objective the model was trained with (for messages); null for a model not trained here."""
    attention: Literal["bidirectional", "block", "causal", "prefix_canvas"] = "bidirectional"
    """bidirectional (MDLM, LLaDA, Dream), block-causal with the training block size (BD3LM, Fast-dLLM v2),
    causal: an autoregressive model (objective ar), decoded one token per forward or speculatively (`--ar`), or
    prefix_canvas: canvases of block_size decoded after a causally encoded prefix (DiffusionGemma)."""
    block_size: Int | None = Field(default=None, gt=0, le=MAX_LENGTH)
    """Tokens per block of a block model (its sampler must use the same); null for bidirectional models."""
    sub_block_size: Int | None = Field(default=None, gt=0, le=MAX_LENGTH)
    """Sub-block decoded in parallel inside a block (Fast-dLLM v2); null: whole blocks."""
    causal_context: bool = False
    """Block models whose clean context was trained token-causally (Nemotron-Labs-Diffusion): the prompt and
    committed blocks are read causally, only the active block bidirectionally."""
    shift: bool = False
    """Position i is predicted from the hidden state at i-1 (Dream, Fast-dLLM v2, BD3LM with shift)."""
    schedule: Literal[SCHEDULES.names()] = "linear"  # type: ignore[valid-type]
    """Noise schedule alpha(t) the model was trained under (likelihood bounds use it)."""
    corruption: Literal["mask", "uniform"] = "mask"
    """Noise: the mask token (absorbing) or uniformly random tokens (uniform-state models)."""
    generation: Literal["canvas", "edit_flow"] = "canvas"
    """canvas: a policy commits positions of a fixed canvas; edit_flow: insert/delete/substitute edits (tau-leaping)."""
    edit_kappa: Literal["cubic", "linear"] | None = None
    """Edit Flows: the coupling schedule kappa(t) the run was trained with (the sampler integrates its weight)."""
    edit_eps: Float | None = Field(default=None, gt=0, lt=1)
    """Edit Flows: the training's largest time was 1 - edit_eps (tau-leaping ends there); null: not edit_flow."""
    mask_id: Int = Field(ge=0)
    """Id of the mask token."""
    pad_id: Int = Field(ge=0)
    """Id of the padding token."""
    eos_id: Int = Field(ge=0)
    """Id of the end-of-sequence token."""
    num_tokens: Int = Field(gt=0)
    """Ids decoding draws random tokens from: the tokenizer's (uniform noise; the embedding may have more rows),
    or for prefix_canvas the model's whole vocabulary, which DiffusionGemma's random canvases are drawn from."""
    max_length: Int = Field(gt=0, le=MAX_LENGTH)
    """Longest sequence (prompt + generation) the model's positions cover."""

    @model_validator(mode="after")
    def _check_blocks(self) -> DecodeProfile:
        blocks = ("block", "prefix_canvas")
        if self.attention in blocks and self.block_size is None:
            raise ValueError(f"attention {self.attention} needs block_size")
        wrong_sub = self.sub_block_size is not None and self.attention != "block"
        if wrong_sub or (self.attention not in blocks and self.block_size is not None):
            raise ValueError("block_size and sub_block_size apply to attention block only (block_size also to "
                             "prefix_canvas)")  # fmt: skip
        if self.causal_context and self.attention != "block":
            raise ValueError("causal_context applies to attention block only")
        if self.sub_block_size is not None and self.block_size and self.block_size % self.sub_block_size:
            raise ValueError(f"sub_block_size {self.sub_block_size} must divide block_size {self.block_size}")
        return self


def build_profile(
    objective: object | None, *, shift_logits: bool, max_length: int, mask_id: int, pad_id: int, eos_id: int,
    num_tokens: int, canvas_length: int | None = None, family_block: int | None = None,
    vocab_size: int | None = None, folder_facts: dict[str, Any] | None = None,
) -> DecodeProfile:  # fmt: skip
    """The profile of a model trained with `objective` (an objective section, or None for a model
    folder that was not trained here: a bidirectional masked model; with `canvas_length` a DiffusionGemma
    one, which decodes canvases of that length; or a block-causal one in blocks of `family_block` when
    its family decodes so, LLaDA2). `shift_logits`: the model family predicts position i from i-1 by
    itself (Dream). `num_tokens`: the tokenizer's ids; `vocab_size`: the model's, which prefix_canvas
    decoding draws its random canvases from (transformers' DiffusionGemma draws from its config's
    vocab_size, whatever the tokenizer's size). `folder_facts`: what a folder not trained here records of how it
    decodes in its config.json (its family reads them: Nemotron-Labs-Diffusion's block size, paradigm, mask id)."""
    facts = objective.decode_facts() if objective is not None else {}  # type: ignore[attr-defined]
    if objective is None and folder_facts:
        facts = dict(folder_facts)
        mask_id = facts.pop("mask_id", mask_id)
    if objective is None and canvas_length is not None:
        facts = {"attention": "prefix_canvas", "block_size": canvas_length, "corruption": "uniform"}
    elif objective is None and family_block is not None:
        facts = {"attention": "block", "block_size": family_block}
    if facts.get("attention") == "prefix_canvas" and vocab_size is not None:
        num_tokens = vocab_size
    shift = bool(facts.pop("shift", False)) or shift_logits
    name = getattr(objective, "name", None)
    return DecodeProfile(objective=name, shift=shift, max_length=max_length, mask_id=mask_id, pad_id=pad_id,
                         eos_id=eos_id, num_tokens=num_tokens, **facts)  # fmt: skip


def write_profile(profile: DecodeProfile, folder: Path) -> Path:
    """Write `decode_profile.json` into `folder` (a temp file renamed into place)."""
    path = Path(folder) / PROFILE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.model_dump(mode="json"), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_profile(folder: Path, vocab_size: int | None = None) -> DecodeProfile | None:
    """The profile saved in `folder`, or None when it has none (written before profiles existed). With
    `vocab_size` (the model's embedding rows), its token ids must fit the model."""
    path = Path(folder) / PROFILE_FILE
    if not os.path.lexists(path):
        return None
    data = read_json(path, "a decode profile", "re-export the model")  # bounded, a regular file only
    try:
        profile = DecodeProfile.model_validate(data)
    except ValidationError as e:
        raise CheckpointError(f"{path}: not a valid decode profile ({_first_error(e)}); re-export the model") from None
    if vocab_size is not None:
        _check_ids(profile, vocab_size, path)
    return profile


def _first_error(e: ValidationError) -> str:
    err = e.errors(include_url=False)[0]
    field = ".".join(str(p) for p in err["loc"])
    return f"{field}: {err['msg']}" if field else str(err["msg"])


def _check_ids(profile: DecodeProfile, vocab_size: int, path: Path) -> None:
    """Special ids inside the model's vocabulary, and no more tokens than it has: sampling indexes the
    embedding with them (an edited or another model's profile would index past it)."""
    for name in ("mask_id", "pad_id", "eos_id", "num_tokens"):
        value = getattr(profile, name)
        if value > (vocab_size if name == "num_tokens" else vocab_size - 1):
            raise CheckpointError(
                f"{path}: {name} {value} does not fit the model's vocabulary of {vocab_size} ids; re-export the model"
            )
