"""Worker process entry: `python -m dllm.training.worker [--watch-stdin] [--config-sha256=HEX]
RUN_DIR/config.yaml` (what torchrun starts). `--watch-stdin`: end when stdin closes, i.e. with the
launcher (dllm.parallel.launch). `--config-sha256`: the digest of the config the launch on this node
resolved (multi-node: node rank 0 writes the file every node reads)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dllm.errors import UserError

USAGE = "usage: python -m dllm.training.worker [--watch-stdin] [--config-sha256=HEX] RUN_DIR/config.yaml"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    from dllm.parallel.launch import CONFIG_SHA256, WATCH_STDIN, watch_launcher

    watch = WATCH_STDIN in args
    digests = [a.removeprefix(CONFIG_SHA256) for a in args if a.startswith(CONFIG_SHA256)]
    args = [a for a in args if a != WATCH_STDIN and not a.startswith(CONFIG_SHA256)]
    if len(args) != 1 or len(digests) > 1:
        print(USAGE, file=sys.stderr)
        return 2
    if watch:  # first, so that a worker started after the launcher died ends at once
        watch_launcher(announce=os.environ.get("RANK", "0") == "0")
    from dllm.training.run import train_from_run_dir

    try:
        train_from_run_dir(Path(args[0]).parent, digests[0] if digests else None)
    except UserError as e:
        print(f"dllm: error: {e}", file=sys.stderr)
        return 2
    return 0


def _exit(code: int) -> None:
    """End the process without running destructors: the files are closed and flushed, and tearing down
    gloo process groups at interpreter exit can deadlock (see training/run.py `_keep_until_exit`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
