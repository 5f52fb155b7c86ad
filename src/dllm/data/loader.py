"""The training loader: memory-mapped artifact rows, sharded by data-parallel rank, exact resume.

The loader walks one infinite stream of sample positions p = 0, 1, 2, ...; position p reads row
perm_e[p mod N] with e = p // N and perm_e a permutation seeded by (seed, e). One optimizer step
consumes the next `global_batch_size` positions; rank r takes its contiguous share and splits it
into micro-batches. The state is the next position, so a resumed run sees the same batches, and the
global batch of a step is the same whatever the number of ranks.

Shapes: B = micro-batch rows, L = sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dllm.config.base import MAX_SEED
from dllm.config.untrusted import count
from dllm.data.artifact import Artifact
from dllm.errors import CheckpointError, DataError

MAX_EPOCHS = 2**32
"""The most passes over an artifact a loader position may stand for (a bound on a checkpoint's record)."""


@dataclass(frozen=True)
class Batch:
    """One micro-batch as the objective receives it."""

    tokens_BL: torch.Tensor
    """Token ids (int64)."""
    loss_mask_BL: torch.Tensor
    """True where the token is a training target (bool)."""
    sample_ids_B: torch.Tensor
    """Global stream position of each row: keys the per-sample diffusion noise (int64)."""
    doc_ids_BL: torch.Tensor | None = None
    """Document index of each token (int64) when attention is kept inside documents."""

    def to(self, device: torch.device) -> Batch:
        doc = None if self.doc_ids_BL is None else self.doc_ids_BL.to(device, non_blocking=True)
        return Batch(
            self.tokens_BL.to(device, non_blocking=True),
            self.loss_mask_BL.to(device, non_blocking=True),
            self.sample_ids_B.to(device, non_blocking=True),
            doc,
        )

    @property
    def num_targets(self) -> int:
        return int(self.loss_mask_BL.sum())


class StepLoader:
    """Yields, per optimizer step, this rank's micro-batches of the global batch."""

    def __init__(
        self,
        artifact: Artifact,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        document_ids: bool = False,
    ) -> None:
        per_rank, rem = divmod(global_batch_size, dp_size)
        assert rem == 0 and per_rank % micro_batch_size == 0, "checked by config rules"
        self.artifact = artifact
        self.tokens = artifact.array("tokens")
        self.loss_mask = artifact.array("loss_mask")
        self.seq_len = artifact.seq_len
        self.num_rows = artifact.num_sequences
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.num_micro = per_rank // micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.indexed = artifact.manifest["layout"] == "indexed"
        self.pad_id = int(artifact.tokenizer["special_ids"]["pad"])
        self.vocab_size = int(artifact.tokenizer["vocab_size"])
        # document start offsets in memory (8 bytes per document): per-token document index (packed),
        # sample boundaries (indexed, which always needs them: padding must not be attended to)
        starts = np.asarray(artifact.array("doc_starts"), dtype=np.int64)
        self.doc_starts = starts if document_ids or self.indexed else None
        self.sample_ends = np.append(starts[1:], len(self.tokens)) if self.indexed else None
        self.position = 0
        self._perm_epoch = -1
        self._perm = np.arange(self.num_rows)

    def _rows(self, positions: np.ndarray) -> np.ndarray:
        epochs = positions // self.num_rows
        out = np.empty_like(positions)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._permutation(int(e))[positions[sel] % self.num_rows]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return self._perm
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            self._perm_epoch = epoch
        return self._perm

    def read(self, positions: np.ndarray) -> Batch:
        """Rows for the given stream positions (also used by evaluation)."""
        rows = self._rows(positions)
        if self.indexed:
            return self._read_samples(rows, positions)
        L = self.seq_len
        idx = (rows[:, None] * L + np.arange(L)[None, :]).reshape(-1)
        tokens_raw, mask_raw = self.tokens[idx], self.loss_mask[idx]
        self._check_values(tokens_raw, mask_raw)
        tokens = torch.from_numpy(tokens_raw.astype(np.int64)).view(-1, L)
        mask = torch.from_numpy(mask_raw.astype(np.bool_)).view(-1, L)
        doc = None
        if self.doc_starts is not None:
            doc = torch.from_numpy(np.searchsorted(self.doc_starts, idx, side="right").astype(np.int64)).view(-1, L)
        return Batch(tokens, mask, torch.from_numpy(positions.astype(np.int64)), doc)

    def _read_samples(self, rows: np.ndarray, positions: np.ndarray) -> Batch:
        """Indexed layout: each sample padded to seq_len; padding is unsupervised and a separate
        "document", so neither side attends to the other."""
        assert self.doc_starts is not None and self.sample_ends is not None
        B, L = len(rows), self.seq_len
        tokens = np.full((B, L), self.pad_id, dtype=np.int64)
        mask = np.zeros((B, L), dtype=np.uint8)
        doc = np.ones((B, L), dtype=np.int64)
        for i, r in enumerate(rows):
            lo, hi = int(self.doc_starts[r]), int(self.sample_ends[r])
            tokens[i, : hi - lo] = self.tokens[lo:hi]
            mask[i, : hi - lo] = self.loss_mask[lo:hi]
            doc[i, : hi - lo] = 0
        self._check_values(tokens, mask)
        pos = torch.from_numpy(positions.astype(np.int64))
        return Batch(torch.from_numpy(tokens), torch.from_numpy(mask.astype(np.bool_)), pos, torch.from_numpy(doc))

    def _check_values(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        """Every batch read: the checks at launch trust the maxima the manifest records, so a file
        changed after preparation is caught here (one line) instead of as an out-of-range embedding
        index or a mask value silently read as True. Costs one max over the batch."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise DataError(
                f"{self.tokens.filename}: token id {int(tokens.max())} is outside the vocabulary ({self.vocab_size}); "
                "the file changed after preparation: run `dllm data validate` and prepare the data again"
            )
        if mask.size and int(mask.max()) > 1:
            raise DataError(
                f"{self.loss_mask.filename}: loss_mask holds values other than 0 and 1; "
                "the file changed after preparation: run `dllm data validate` and prepare the data again"
            )

    def next_step(self) -> list[Batch]:
        per_rank = self.global_batch_size // self.dp_size
        start = self.position + self.dp_rank * per_rank
        mine = np.arange(start, start + per_rank, dtype=np.int64)
        self.position += self.global_batch_size
        m = self.micro_batch_size
        return [self.read(mine[i * m : (i + 1) * m]) for i in range(self.num_micro)]

    @property
    def epoch(self) -> float:
        return self.position / max(self.num_rows, 1)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "fingerprint": self.artifact.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.artifact.fingerprint:
            raise CheckpointError(
                f"data.path: the artifact {self.artifact.path} (fingerprint {self.artifact.fingerprint[:12]}) "
                f"is not the one this checkpoint trained on ({str(state.get('fingerprint'))[:12]}); "
                "point data.path at the original artifact or start a new run"
            )
        # a ValueError (the trainer reports the checkpoint damaged) for a count no run of this artifact reaches
        self.position = count(state["position"], "loader.position", max(self.num_rows, 1) * MAX_EPOCHS)
        self.seed = count(state["seed"], "loader.seed", MAX_SEED)
        self._perm_epoch = -1  # the cached permutation may belong to another seed
