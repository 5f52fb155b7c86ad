"""Packing: concatenate documents into one stream and cut it into fixed-length sequences."""

from __future__ import annotations

import numpy as np

from dllm.data.artifact import ArrayWriter
from dllm.data.prepare.render import Document


class Packer:
    """Streams documents into `seq_len` rows; the last partial row is padded (not supervised)."""

    def __init__(self, seq_len: int, pad_id: int, tokens: ArrayWriter, mask: ArrayWriter, starts: ArrayWriter):
        self.seq_len = seq_len
        self.pad_id = pad_id
        self._tokens, self._mask, self._starts = tokens, mask, starts
        self._buf_ids: list[int] = []
        self._buf_mask: list[int] = []
        self._offset = 0  # tokens written so far
        self.num_sequences = 0
        self.num_padding = 0

    def add(self, doc: Document) -> None:
        if not doc.ids:
            return
        self._starts.write([self._offset + len(self._buf_ids)])
        self._buf_ids += doc.ids
        self._buf_mask += doc.loss_mask
        full = len(self._buf_ids) // self.seq_len * self.seq_len
        if full:
            self._emit(self._buf_ids[:full], self._buf_mask[:full])
            self._buf_ids, self._buf_mask = self._buf_ids[full:], self._buf_mask[full:]

    def finish(self) -> None:
        if self._buf_ids:
            pad = self.seq_len - len(self._buf_ids)
            self.num_padding += pad
            self._emit(self._buf_ids + [self.pad_id] * pad, self._buf_mask + [0] * pad)
            self._buf_ids, self._buf_mask = [], []

    def _emit(self, ids: list[int], mask: list[int]) -> None:
        self._tokens.write(np.asarray(ids))
        self._mask.write(np.asarray(mask))
        self._offset += len(ids)
        self.num_sequences += len(ids) // self.seq_len
