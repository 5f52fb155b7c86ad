"""Layouts: how documents become training rows.

packed   several documents share a row of seq_len tokens, each document kept whole or split as
         the source's packing says (PrepareSpec.keeps_whole):
         split  documents are concatenated into one stream and cut into rows wherever a row ends
                (pretraining text); the last partial row is padded with unsupervised pad tokens.
         whole  each document lies inside one row (it is at most seq_len long: longer records follow
                `overflow`). Best fit over a bounded window of open rows: a document goes into the
                open row with the least room that still holds it (the oldest on a tie), else into a
                new row; when more than `open_rows` rows are open the fullest is written out, and a
                row that is exactly full is written at once. Deterministic: a pure function of the
                documents in order. A row's unused tail is unsupervised padding that starts a
                document of its own, so that with data.document_mask no document attends to it.
         doc_starts records where each document begins, so attention can be kept inside documents.
         A source of each kind (text and prompt/completion) packs its documents both ways in one
         artifact: the split stream's rows and the whole rows are written as each fills.
indexed  one document per sample, stored at its own length; doc_starts are the sample offsets. The
         loader pads each sample to seq_len (pad tokens are not supervised and never attended to);
         the padding this will cost is recorded at preparation.

Every layout counts what packing cost: padding tokens, the documents cut by a row boundary and the
supervised tokens that land in a later row than the one their document starts in (trained without
the prompt or the earlier turns before the cut).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dllm.data.artifact import ArrayWriter
from dllm.data.prepare.render import Document

OPEN_ROW_TOKENS = 1 << 22
"""Tokens the open rows of whole packing may hold together (bounds memory for long rows)."""
MAX_OPEN_ROWS = 64
"""Open rows of whole packing: a wider window fills rows better and holds more in memory."""


class Layout:
    """Writes documents into the tokens / loss_mask / doc_starts arrays."""

    def __init__(self, seq_len: int, pad_id: int, tokens: ArrayWriter, mask: ArrayWriter, starts: ArrayWriter):
        self.seq_len = seq_len
        self.pad_id = pad_id
        self._tokens, self._mask, self._starts = tokens, mask, starts
        self._offset = 0  # tokens written so far
        self.num_sequences = 0
        self.num_padding = 0
        self.num_split_supervised = 0  # supervised tokens in a later row than their document's start

    def _write(self, ids: list[int], mask: list[int]) -> None:
        self._tokens.write(np.asarray(ids))
        self._mask.write(np.asarray(mask))
        self._offset += len(ids)

    def add(self, doc: Document, whole: bool) -> bool:
        """Lay out one document (kept in one row when `whole`); True when a row boundary cuts it."""
        raise NotImplementedError

    def finish(self) -> None:
        pass


@dataclass(eq=False)  # rows are told apart by identity
class _Row:
    """An open row of whole packing: its documents in order and the tokens they fill."""

    docs: list[Document] = field(default_factory=list)
    used: int = 0


class Packed(Layout):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.open_rows = max(1, min(MAX_OPEN_ROWS, OPEN_ROW_TOKENS // self.seq_len))
        self._buf_ids: list[int] = []  # the split stream: less than one row between calls
        self._buf_mask: list[int] = []
        self._buf_starts: list[int] = []  # where its documents start, relative to the buffer
        self._rows: list[_Row] = []  # whole packing's open rows, oldest first

    def add(self, doc: Document, whole: bool) -> bool:
        if not doc.ids:
            return False
        return self._add_whole(doc) if whole else self._add_split(doc)

    def _add_split(self, doc: Document) -> bool:
        L = self.seq_len
        start = len(self._buf_ids)  # < L: full rows leave at once
        room = L - start
        self._buf_starts.append(start)
        self._buf_ids += doc.ids
        self._buf_mask += doc.loss_mask
        self.num_split_supervised += sum(doc.loss_mask[room:])
        full = len(self._buf_ids) // L * L
        if full:
            self._emit(self._buf_ids[:full], self._buf_mask[:full], self._buf_starts)
            self._buf_ids, self._buf_mask, self._buf_starts = self._buf_ids[full:], self._buf_mask[full:], []
        return len(doc) > room

    def _add_whole(self, doc: Document) -> bool:
        n = len(doc)
        assert n <= self.seq_len, "fit_length keeps documents packed whole within seq_len"
        fits = [i for i, r in enumerate(self._rows) if self.seq_len - r.used >= n]
        if fits:
            row = self._rows[min(fits, key=lambda i: self.seq_len - self._rows[i].used)]  # first on a tie
        else:
            if len(self._rows) == self.open_rows:
                self._close(max(range(len(self._rows)), key=lambda i: self._rows[i].used))  # fullest, first
            row = _Row()
            self._rows.append(row)
        row.docs.append(doc)
        row.used += n
        if row.used == self.seq_len:
            self._close(self._rows.index(row))
        return False

    def _close(self, i: int) -> None:
        """Write open row `i` out, its unused tail as padding that is a document of its own."""
        row = self._rows.pop(i)
        ids = [t for d in row.docs for t in d.ids]
        mask = [m for d in row.docs for m in d.loss_mask]
        starts = list(np.cumsum([0] + [len(d) for d in row.docs]))  # the last one starts the padding
        pad = self.seq_len - row.used
        if not pad:
            starts.pop()
        self.num_padding += pad
        self._emit(ids + [self.pad_id] * pad, mask + [0] * pad, starts)

    def finish(self) -> None:
        while self._rows:
            self._close(0)
        if self._buf_ids:
            pad = self.seq_len - len(self._buf_ids)
            self.num_padding += pad
            self._emit(self._buf_ids + [self.pad_id] * pad, self._buf_mask + [0] * pad, self._buf_starts)
            self._buf_ids, self._buf_mask, self._buf_starts = [], [], []

    def _emit(self, ids: list[int], mask: list[int], starts: list[int]) -> None:
        """Whole rows of tokens, with the starts of the documents in them (relative to `ids`)."""
        self._starts.write([self._offset + int(s) for s in starts])
        self._write(ids, mask)
        self.num_sequences += len(ids) // self.seq_len


class Indexed(Layout):
    def add(self, doc: Document, whole: bool) -> bool:
        if not doc.ids:
            return False
        assert len(doc) <= self.seq_len, "fit_length keeps samples within seq_len"
        self._starts.write([self._offset])
        self._write(doc.ids, doc.loss_mask)
        self.num_sequences += 1
        self.num_padding += self.seq_len - len(doc)
        return False
