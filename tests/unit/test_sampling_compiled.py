"""Compiled sampling (`sampler.compile`) against eager: the same greedy tokens, and one set of graphs
for every prompt length (dynamic shapes), counted with torch._dynamo's counters.

Models run in float64 (as in test_sampling_caches): inductor's fused kernels add in another order than
eager, and float32 rounding could flip a near-tied greedy argmax for reasons unrelated to compilation.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from dllm.errors import ConfigError
from dllm.sampling.compiled import compile_blocks
from tests.unit.test_sampling_caches import PROMPTS, make_tiny, run, sampler

OTHER_PROMPTS = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10]]  # new prompt lengths, a new canvas length


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def check_compiled_equals_eager(attention: str, caches: list[str]) -> None:
    eager, compiled = make_tiny(0), make_tiny(0)
    torch._dynamo.reset()
    for cache in caches:
        cfg = sampler(attention=attention, cache=cache, policy="low_confidence")
        expected = [run(eager, p, cfg).sequences for p in (PROMPTS, OTHER_PROMPTS)]
        got = run(compiled, PROMPTS, cfg.model_copy(update={"compile": True})).sequences
        assert got == expected[0], cache
        before = graphs()
        assert before > 0, "the blocks were compiled"
        got = run(compiled, OTHER_PROMPTS, cfg.model_copy(update={"compile": True})).sequences
        assert got == expected[1], cache
        assert graphs() == before, f"cache {cache}: a new prompt length recompiled"


def test_compiled_sampling_equals_eager_mdlm_with_and_without_cache() -> None:
    check_compiled_equals_eager("bidirectional", ["none", "dual"])


@pytest.mark.slow  # ~27 s: the CPU blockwise block-causal kernel breaks the graph, so more graphs compile
def test_compiled_sampling_equals_eager_block_model_with_block_cache() -> None:
    check_compiled_equals_eager("block", ["block"])


def test_compile_blocks_in_place_once_and_keeps_names() -> None:
    model = make_tiny(0)
    names = [n for n, _ in model.named_parameters()]
    assert compile_blocks(model) is model
    impls = [block._compiled_call_impl for block in model.layers]
    assert all(impl is not None for impl in impls)
    compile_blocks(model)  # a second generate call reuses the compiled blocks
    assert [block._compiled_call_impl for block in model.layers] == impls
    assert [n for n, _ in model.named_parameters()] == names


def test_compile_refuses_a_model_without_blocks() -> None:
    with pytest.raises(ConfigError, match="has no transformer blocks"):
        compile_blocks(torch.nn.Linear(2, 2))
