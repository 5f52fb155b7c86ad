"""Guards for reading files a user may have been handed: checkpoints, model folders, their pointers.

Only regular files are opened (a FIFO, a device or a folder named like a shard blocks its reader forever
or never ends): the file is opened non-blocking and checked on its descriptor, so nothing swapped in
after a check is read. JSON is read up to a size and refused in one line when it is nested too deeply
for the parser. A count read from such a file is an integer (not a bool) inside its bounds before
anything uses it (a negative step would be trained and published as `step_-0000004`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from dllm.errors import CheckpointError, UserError

MAX_JSON_BYTES = 64 << 20
"""The largest JSON record read from a checkpoint or model folder (dllm writes a few kilobytes)."""


def not_regular(path: Path, error: type[UserError] = CheckpointError) -> UserError:
    return error(f"{path}: not a regular file (a FIFO, device or folder, or a link to one); replace it with the file")


def open_regular(path: Path, error: type[UserError] = CheckpointError) -> BinaryIO:
    """`path` opened for binary reading when it is a regular file (after symlinks), else `error` naming it;
    a missing file raises FileNotFoundError, for the caller to say what it means."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular(path, error)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def regular_size(path: Path, error: type[UserError] = CheckpointError) -> int | None:
    """The size of the regular file `path` (after symlinks); None when it does not exist; `error` when it is
    something else."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, error)
    return st.st_size


def read_json(path: Path, what: str, advice: str, error: type[UserError] = CheckpointError,
              max_bytes: int = MAX_JSON_BYTES) -> Any:  # fmt: skip
    """The JSON value of the regular file `path`: `error` in one line ("`path`: ... `what`; `advice`") when it
    is larger than `max_bytes`, not UTF-8, not JSON, or nested too deeply; FileNotFoundError when missing."""
    try:
        with open_regular(path, error) as fh:
            raw = fh.read(max_bytes + 1)
    except (FileNotFoundError, UserError):
        raise
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror}); {advice}") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: over {max_bytes} bytes, too large for {what}; {advice}")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise error(f"{path}: nested too deeply to be {what}; {advice}") from None
    except ValueError:  # not UTF-8, not JSON, an integer past Python's digit limit
        raise error(f"{path}: damaged (not {what}); {advice}") from None


def count(value: Any, name: str, upper: int, lower: int = 0) -> int:
    """`value` when it is an integer (not a bool) in [lower, upper], else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or not lower <= value <= upper:
        short = isinstance(value, (bool, float)) or (isinstance(value, int) and abs(value) < 10**24)
        shown = repr(value) if short else "a large number" if isinstance(value, int) else type(value).__name__
        raise ValueError(f"{name} is {shown}, not a whole number in [{lower}, {upper}]")
    return value
