"""Import hygiene: `import dllm` and the CLI entry do not pull heavy optional libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["dllm", "dllm.cli.main", "dllm.training.build", "dllm.inference.engine"])
def test_import_does_not_load_transformers(module: str):
    code = (
        f"import sys, {module}\n"
        "heavy = [m for m in ('transformers', 'datasets', 'tensorboard', 'wandb') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


def test_import_dllm_does_not_import_torch():
    res = subprocess.run(
        [sys.executable, "-c", "import sys, dllm; print('torch' in sys.modules)"], capture_output=True, text=True
    )
    assert res.stdout.strip() == "False"
