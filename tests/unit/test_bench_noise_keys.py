"""bench/noise_keys.py: its NumPy MT19937 reproduces torch's CPU generator, and it prints one JSON line."""

from __future__ import annotations

import json

import pytest
import torch
from bench.noise_keys import main, mt19937_uniform

KEYS = [0, 1, 5489, 2**32 - 1, 2**32, 2**32 + 12345, 2**62 + 7, 2**63 - 1, 0x1234_5678_9ABC_DEF0]


@pytest.mark.parametrize("shape", [(), (1,), (623,), (624,), (625,), (1248,), (1249,), (2, 3)])
def test_mt19937_in_numpy_equals_torch_rand(shape):
    expected = torch.stack([torch.rand(shape, generator=torch.Generator().manual_seed(k)) for k in KEYS])
    assert torch.equal(mt19937_uniform(KEYS, shape), expected)


def test_the_bench_prints_one_json_line(capsys):
    out = main(["--rounds", "1"])
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and json.loads(line) == out
    assert out["bit_identical"] and [(c["B"], c["L"]) for c in out["configs"]] == [(64, 2048), (8, 512), (64, 0)]
    assert all(c["loop_over_shipped"] > 0 and c["loop_over_mt19937"] > 0 for c in out["configs"])
