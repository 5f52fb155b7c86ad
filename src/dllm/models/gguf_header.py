"""The header of a GGUF file walked with every count checked, before the `gguf` package reads it.

gguf's `GGUFReader` trusts the counts of a header: an array of 10**18 numbers that runs past the end of
the file is read as that many empty items (for ever), and a tensor count, string length or dimension
past what the file holds builds lists and views before anything fails. `check_header` walks the header
as the format lays it out (gguf's docs/gguf.md: magic, version, tensor and metadata counts, key/value
pairs, tensor infos, aligned data) and checks every count, length, type and tensor extent against the
bytes the file holds and against caps, so the reader only ever sees a header whose loops end inside the
file. Nothing is allocated in proportion to a count: the walk reads through a memory map.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

from dllm.errors import ConfigError

MAX_ITEMS = 1 << 24
"""The most tensors, metadata pairs or array items a header may declare (vocabularies hold ~2**18)."""
MAX_DIMS = 4
"""Dimensions of a tensor (ggml's GGML_MAX_DIMS)."""
MAX_NESTING = 3
"""Arrays of arrays: how deep a metadata value may nest."""
SUPPORTED_VERSIONS = (2, 3)
"""The GGUF versions gguf's reader takes."""
DEFAULT_ALIGNMENT = 32

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
"""GGUF value type -> its size: uint8, int8, uint16, int16, uint32, int32, float32, bool, uint64, int64, float64."""
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_KV_BYTES = 8 + 4 + 1  # a key's length, the value type, the smallest value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimension count, one dimension, type, offset


class _Cursor:
    """Reads the header from `data`, refusing any read past its end (one line naming the file and the field)."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.path, self.pos, self.order = data, path, 0, "little"

    def damaged(self, problem: str) -> ConfigError:
        return ConfigError(f"--from-gguf: {self.path} is a truncated or damaged GGUF file ({problem}); download or "
                           "copy it again")  # fmt: skip

    def left(self) -> int:
        return len(self.data) - self.pos

    def skip(self, num_bytes: int, what: str) -> int:
        if num_bytes > self.left():
            raise self.damaged(f"{what} needs {num_bytes:,} bytes, more than the {self.left():,} left in the file")
        start, self.pos = self.pos, self.pos + num_bytes
        return start

    def uint(self, size: int, what: str) -> int:
        start = self.skip(size, what)
        return int.from_bytes(self.data[start : self.pos], self.order)  # type: ignore[arg-type]

    def string(self, what: str) -> str:
        length = self.uint(8, f"the length of {what}")
        start = self.skip(length, what)
        return bytes(self.data[start : self.pos]).decode("utf-8", errors="replace")

    def count(self, size: int, what: str, min_item_bytes: int) -> int:
        """A count of items of at least `min_item_bytes` each: at most MAX_ITEMS and what the file can hold."""
        n = self.uint(size, what)
        if n > MAX_ITEMS or n * min_item_bytes > self.left():
            raise self.damaged(f"{what} is {n:,}, more than the {self.left():,} bytes left in the file can hold "
                               f"(at most {MAX_ITEMS:,})")  # fmt: skip
        return n


def check_header(path: Path) -> None:
    """Walk the header of the GGUF file `path` (its magic already checked): every count, length and type in
    bounds, every tensor's bytes inside the file; else one ConfigError naming the file and the field."""
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        c = _Cursor(data, path)
        c.skip(4, "the magic")
        version = c.uint(4, "the version")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            c.order, version = "big", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in SUPPORTED_VERSIONS:
            raise c.damaged(f"version {version}, where the gguf package reads versions "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}")  # fmt: skip
        num_tensors = c.count(8, "the tensor count", _MIN_TENSOR_BYTES)
        num_fields = c.count(8, "the metadata count", _MIN_KV_BYTES)
        alignment = DEFAULT_ALIGNMENT
        for _ in range(num_fields):
            key = c.string("a metadata key")
            kind = c.uint(4, f"the type of {key}")
            start = c.pos
            _value(c, kind, key, 0)
            if key == "general.alignment":
                alignment = _alignment(c, kind, start)
        extents = [_tensor_extent(c) for _ in range(num_tensors)]
        data_start = -(-c.pos // alignment) * alignment
        for name, offset, num_bytes in extents:
            if data_start + offset + num_bytes > len(data):
                raise c.damaged(f"tensor {name}'s {num_bytes:,} bytes at offset {offset:,} run past the end of the "
                                f"file ({len(data):,} bytes)")  # fmt: skip


def _value(c: _Cursor, kind: int, key: str, depth: int) -> None:
    """Step over one metadata value of GGUF type `kind`; an array's items are skipped in one step when they
    have a fixed size, else one by one (each at least a length, so the loop ends inside the file)."""
    if kind in _SCALAR_BYTES:
        c.skip(_SCALAR_BYTES[kind], key)
    elif kind == _STRING:
        c.string(key)
    elif kind == _ARRAY and depth < MAX_NESTING:
        item = c.uint(4, f"the item type of {key}")
        if item in _SCALAR_BYTES:
            n = c.count(8, f"the length of {key}", _SCALAR_BYTES[item])
            c.skip(n * _SCALAR_BYTES[item], key)
            return
        if item not in (_STRING, _ARRAY):
            raise c.damaged(f"{key} holds items of type {item}, which GGUF does not define")
        for _ in range(c.count(8, f"the length of {key}", 8)):
            _value(c, item, key, depth + 1)
    else:
        raise c.damaged(f"{key} has value type {kind}, which GGUF does not define (or arrays nested too deeply)")


def _alignment(c: _Cursor, kind: int, start: int) -> int:
    """general.alignment, the value at `start`: a power of two stored as uint32 (as gguf's reader requires)."""
    value = int.from_bytes(c.data[start : start + 4], c.order) if kind == _UINT32 else 0
    if not value or value & (value - 1):
        raise c.damaged(f"general.alignment is {value if kind == _UINT32 else f'of type {kind}'}, not a power "
                        "of two stored as uint32")  # fmt: skip
    return value


def _tensor_extent(c: _Cursor) -> tuple[str, int, int]:
    """One tensor info: (name, offset in the data section, bytes), its dimensions and type checked."""
    import gguf

    name = c.string("a tensor name")
    num_dims = c.uint(4, f"the dimension count of tensor {name}")
    if not 1 <= num_dims <= MAX_DIMS:
        raise c.damaged(f"tensor {name} has {num_dims:,} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = [c.uint(8, f"the dimensions of tensor {name}") for _ in range(num_dims)]
    kind = c.uint(4, f"the type of tensor {name}")
    offset = c.uint(8, f"the offset of tensor {name}")
    try:
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (ValueError, KeyError):
        raise c.damaged(f"tensor {name} has type {kind}, which this gguf package does not know") from None
    if dims[0] % block:
        raise c.damaged(f"tensor {name}'s rows of {dims[0]:,} values do not fill whole blocks of {block}")
    return name, offset, math.prod(dims) // block * type_bytes
