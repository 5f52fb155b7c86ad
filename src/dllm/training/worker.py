"""Worker process entry: `python -m dllm.training.worker RUN_DIR/config.yaml` (what torchrun starts)."""

from __future__ import annotations

import sys
from pathlib import Path

from dllm.errors import UserError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dllm.training.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    from dllm.training.run import train_from_run_dir

    try:
        train_from_run_dir(Path(args[0]).parent)
    except UserError as e:
        print(f"dllm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
