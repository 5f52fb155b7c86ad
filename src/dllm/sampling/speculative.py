"""Drafters of speculative decoding (the causal loop, causal_loop.py, verifies their proposals) and how a
drafter folder is loaded.

A drafter proposes b - 1 tokens after the anchor (the last token the target has not run); `NoDrafter`
(b = 1) proposes nothing, which makes the causal loop AR decoding. DFlash drafters (Chen et al. 2025)
condition on target hidden states: the target's blocks `target_layer_ids` are captured during every target
forward and handed to `extend` at their positions. A drafter whose proposals depend on each other (DFlash2's
candidate selector: a chain through each position's top candidates) picks its own drafts from its logits
(`SelectingDrafter.select_drafts`: tokens, and when sampling the distributions q they were drawn from).

Shapes: B batch, b block size, d = b - 1 drafts, V vocabulary, N positions, F captured target features.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from pydantic import ValidationError
from torch import nn

from dllm.config.drafter import DrafterKind
from dllm.config.registries import DRAFTER_ARCHITECTURES, DRAFTERS
from dllm.config.sampler import SamplerConfig
from dllm.errors import CheckpointError, ConfigError
from dllm.sampling.proposals import draw, token_probs


@runtime_checkable
class Drafter(Protocol):
    """What speculative decoding needs from a drafter (a DFlash model, or any proposer)."""

    block_size: int
    """b: one round proposes b - 1 tokens after the anchor."""
    target_layer_ids: tuple[int, ...]
    """Target blocks whose outputs it reads (0-based into target.layers); may be ()."""

    def start(self, batch_size: int, max_length: int) -> Any:
        """Fresh per-call state (e.g. the drafter's own K/V buffers over projected target features)."""
        ...

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        """Target features (the captured blocks' outputs concatenated in target_layer_ids order, F = len(ids)
        * E) of N positions per row, written at those positions; a later write to a position overwrites an
        earlier one (rejected positions get rewritten)."""
        ...

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, b-1, V] for positions anchor_pos+1 .. anchor_pos+b-1, attending to the context features
        of positions [0, anchor_pos_B) of each row plus its own block. It may overwrite what `extend` wrote
        at positions >= anchor_pos_B (the loop extends every verified position before it is read)."""
        ...


@runtime_checkable
class SelectingDrafter(Drafter, Protocol):
    """A drafter that picks its drafts itself rather than per position from its logits (DFlash2)."""

    def select_drafts(
        self, state: Any, logits_BdV: torch.Tensor, anchor_B: torch.Tensor, temperature: float,
        generator: torch.Generator | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """(drafts [B, d] for the first d positions of the last `propose`'s logits, and at temperature > 0 the
        distributions q [B, d, V] each was drawn from, given the drafts before it)."""
        ...


class NoDrafter:
    """The drafter of AR decoding: proposes nothing (b = 1), reads no target features."""

    block_size = 1
    target_layer_ids: tuple[int, ...] = ()

    def start(self, batch_size: int, max_length: int) -> None:
        return None

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        return None

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        return torch.empty(anchor_B.shape[0], 0, 0, device=anchor_B.device)


def choose(cfg: SamplerConfig, logits_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The target's own token: the argmax when greedy, else a draw from its sampling distribution."""
    if cfg.temperature == 0:
        return logits_BV.argmax(-1)
    return draw(token_probs(logits_BV, cfg.temperature, cfg.top_k, cfg.top_p), generator)


# ---------------------------------------------------------------------------------------------------
# loading a drafter folder: the seam a drafter family fills


def load_drafter(path: Path, target: nn.Module) -> Drafter:
    """The drafter saved in folder `path` for `target`. A drafter family (DFlash) fills this seam: its
    entry in config/registries.py, chosen by the folder's config.json (`model_type`, or a public layout's
    `architectures`), loads the weights and refuses a drafter trained for, or not fitting, another target."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"--draft: {path} is not a drafter folder (no config.json)")
    try:
        header = json.loads((path / "config.json").read_text(encoding="utf-8"))
        archs = header.get("architectures")
        public = [DRAFTER_ARCHITECTURES[a] for a in archs or [] if a in DRAFTER_ARCHITECTURES]
        kind = DrafterKind.model_validate({"model_type": public[0] if public else header.get("model_type")})
    except (ValueError, AttributeError, TypeError, ValidationError):
        raise CheckpointError(
            f"--draft: {path}/config.json names no drafter family (model_type one of {', '.join(DRAFTERS.names())}, "
            f"or architectures one of {', '.join(DRAFTER_ARCHITECTURES)}); export a drafter run with "
            "dllm convert --to-hf"
        ) from None
    return DRAFTERS.resolve(kind.model_type)(path, target)


def check_drafter(drafter: Drafter, target: nn.Module, block_size: int | None = None) -> Drafter:
    """The drafter that serves `target` with blocks of `block_size` (None: the drafter's own): the drafter
    itself, or for a shorter block `FirstProposals` of it. Refused: a longer block than it was trained for,
    or target layers the target does not have."""
    if block_size is not None and not 2 <= block_size <= drafter.block_size:
        raise ConfigError(
            f"--draft-block-size: the drafter was trained with blocks of {drafter.block_size}, not {block_size}; "
            f"use 2 to {drafter.block_size} (the target then verifies the drafter's first proposals) or a drafter "
            "trained for that block size"
        )
    num_layers = len(target.layers)  # type: ignore[arg-type]
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"--draft: the drafter reads target layers {bad}, but the target has {num_layers} layers; "
                          "it was trained for another target")  # fmt: skip
    if block_size is None or block_size == drafter.block_size:
        return drafter
    return FirstProposals(drafter, block_size)


class FirstProposals:
    """A drafter's first `block_size - 1` proposals: the target verifies blocks shorter than the drafter was
    trained with (a cheaper verification where one costs more per token, e.g. a large batch). The drafter
    still runs its whole block, the input it was trained on; its later proposals are dropped."""

    def __init__(self, drafter: Drafter, block_size: int) -> None:
        assert 2 <= block_size <= drafter.block_size
        self.drafter, self.block_size = drafter, block_size
        self.target_layer_ids = drafter.target_layer_ids
        if isinstance(drafter, SelectingDrafter):  # the first proposals of its chain (given its first logits)
            self.select_drafts = drafter.select_drafts

    def start(self, batch_size: int, max_length: int) -> Any:
        # the drafter's own block reaches block_size - self.block_size positions past the loop's
        return self.drafter.start(batch_size, max_length + self.drafter.block_size - self.block_size)

    def extend(self, state: Any, features_BNF: torch.Tensor, positions_BN: torch.Tensor) -> None:
        self.drafter.extend(state, features_BNF, positions_BN)

    def propose(self, state: Any, anchor_B: torch.Tensor, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        return self.drafter.propose(state, anchor_B, anchor_pos_B)[:, : self.block_size - 1]
