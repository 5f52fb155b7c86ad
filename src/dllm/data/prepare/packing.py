"""Layouts: how documents become training rows.

packed   documents are concatenated into one stream (EOS between them) and cut into seq_len rows;
         the last partial row is padded with unsupervised pad tokens. doc_starts records where each
         document begins, so attention can be kept inside documents.
indexed  one document per sample, stored at its own length; doc_starts are the sample offsets. The
         loader pads each sample to seq_len (pad tokens are not supervised and never attended to);
         the padding this will cost is recorded at preparation.
"""

from __future__ import annotations

import numpy as np

from dllm.data.artifact import ArrayWriter
from dllm.data.prepare.render import Document


class Layout:
    """Writes documents into the tokens / loss_mask / doc_starts arrays."""

    def __init__(self, seq_len: int, pad_id: int, tokens: ArrayWriter, mask: ArrayWriter, starts: ArrayWriter):
        self.seq_len = seq_len
        self.pad_id = pad_id
        self._tokens, self._mask, self._starts = tokens, mask, starts
        self._offset = 0  # tokens written so far
        self.num_sequences = 0
        self.num_padding = 0

    def _write(self, ids: list[int], mask: list[int]) -> None:
        self._tokens.write(np.asarray(ids))
        self._mask.write(np.asarray(mask))
        self._offset += len(ids)

    def add(self, doc: Document) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class Packed(Layout):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self._buf_ids: list[int] = []
        self._buf_mask: list[int] = []

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
        self._write(ids, mask)
        self.num_sequences += len(ids) // self.seq_len


class Indexed(Layout):
    def add(self, doc: Document) -> None:
        if not doc.ids:
            return
        assert len(doc) <= self.seq_len, "fit_length keeps samples within seq_len"
        self._starts.write([self._offset])
        self._write(doc.ids, doc.loss_mask)
        self.num_sequences += 1
        self.num_padding += self.seq_len - len(doc)
