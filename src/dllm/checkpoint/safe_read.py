"""Reading a DCP checkpoint without running code from it.

torch.distributed.checkpoint's FileSystemReader unpickles `.metadata` with plain `pickle.load`, and
its default planner reads non-tensor items with `torch.load(weights_only=False)`: a checkpoint
someone hands you could run anything. Here `.metadata` goes through an unpickler that only knows the
DCP metadata classes (the set found by unpickling the metadata of real one- and two-rank
checkpoints), its shard names must stay inside the folder, and non-tensor items (only in checkpoints
written before the optimizer's hyper-parameters moved to trainer_state.json) are read with torch's
restricted `weights_only` unpickler. Anything else is one line naming the file.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from dllm.config.untrusted import open_regular
from dllm.errors import CheckpointError
from dllm.models.hf_io import load_plain

_CLASSES: tuple[Any, ...] = (
    md.Metadata,
    md.MetadataIndex,
    md.StorageMeta,
    md.TensorProperties,
    md.TensorStorageMetadata,
    md.ChunkStorageMetadata,
    md.BytesStorageMetadata,
    md._MEM_FORMAT_ENCODING,
    _StorageInfo,
    torch.Size,
    torch.serialization._get_layout,  # a layout by name (torch.strided): a dict lookup
    pathlib.PosixPath,  # StorageMeta.checkpoint_id
    pathlib.PurePosixPath,
)
_ALLOWED = {(c.__module__, c.__qualname__): c for c in _CLASSES}


class _Refused(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata: the classes above, torch dtypes and plain containers."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"it refers to {module}.{name}, which is not checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("it holds a persistent reference")


def read_metadata_file(path: Path) -> md.Metadata:
    """Unpickle a `.metadata` file with the restricted unpickler and check what it describes."""
    try:
        with open_regular(path) as fh:
            meta = _MetadataUnpickler(fh).load()
    except CheckpointError:
        raise
    except _Refused as e:
        raise CheckpointError(f"{path}: refused to load it: {e}; only use checkpoints you trust") from None
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete") from None
    except Exception as e:  # truncated or garbled: EOFError, UnpicklingError, a bad argument, ...
        raise CheckpointError(f"{path}: damaged ({type(e).__name__}); use another checkpoint") from None
    _check_metadata(meta, path)
    return meta


def _check_metadata(meta: Any, path: Path) -> None:
    if not isinstance(meta, md.Metadata) or not isinstance(meta.storage_data, dict):
        raise CheckpointError(f"{path}: damaged (not DCP metadata); use another checkpoint")
    for info in meta.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_name(name):
            raise CheckpointError(f"{path}: refused: it names a shard {name!r} outside the checkpoint folder")


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


class _RegularFiles(FileSystem):
    """DCP's local file system, reading regular files only (a shard linked to a FIFO would block the load)."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_regular(Path(path)) as stream:
            yield stream  # type: ignore[misc]


class SafeReader(FileSystemReader):
    """A FileSystemReader whose `.metadata` is read by the restricted unpickler, and which opens shards only
    when they are regular files."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self.fs = _RegularFiles()

    def read_metadata(self, *args: Any, **kwargs: Any) -> md.Metadata:
        meta = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = md.StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items through torch's `weights_only` unpickler (DCP uses `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = load_plain(value)
        except Exception:
            raise CheckpointError(f"refused to unpickle the checkpoint item {fqn}: it is not plain data") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def check_tensors(meta: md.Metadata, prefix: str, tensors: dict[str, Any], folder: Path, what: str) -> None:
    """Every tensor the caller loads is in the checkpoint as a tensor of the same (global) shape:
    otherwise one line, before DCP reports it with a traceback (a run config edited to another size)."""
    saved = meta.state_dict_metadata
    for name, t in tensors.items():
        entry = saved.get(f"{prefix}.{name}")
        if not isinstance(entry, md.TensorStorageMetadata):
            raise CheckpointError(f"{folder}: has no tensor {name}, which {what} needs; {_ADVICE}")
        if tuple(entry.size) != tuple(t.shape):
            raise CheckpointError(
                f"{folder}: {name} is {list(entry.size)} in the checkpoint but {list(t.shape)} in {what}; {_ADVICE}"
            )


_ADVICE = "the run's config.yaml was changed after training: restore its model section or start a new run"
