"""bench/ar_decoding.py runs end to end on a tiny target (a llama, and a qwen3_5 hybrid) and reports every variant
at every batch size."""

from __future__ import annotations

import pytest
from bench.ar_decoding import BASELINE, VARIANTS, main


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_bench_reports_every_variant(capsys, family: str):
    result = main(["--family", family, "--layers", "4" if family == "qwen3_5" else "1", "--width", "64",
                   "--prompt-len", "6", "--gen", "5", "--repeats", "1"])  # fmt: skip
    assert capsys.readouterr().out.count("\n") == 1  # one JSON line
    for batch in ("batch_1", "batch_8"):
        row = result[batch]
        assert row[f"{BASELINE}_speedup_vs_{BASELINE}"] == 1.0 and row["tokens_equal"] == 1.0
        for name in VARIANTS:
            assert row[f"{name}_tok_s"] > 0
        # the cache runs one prefill and one forward per further token; recomputation the same count
        assert row["ar_cache_forwards_per_token"] == 5 / (5 * int(batch.split("_")[1]))
        # but the cache runs each prompt once and then a token per row: fewer positions than recomputing them
        assert row["ar_cache_query_tokens_per_token"] < row["ar_recompute_query_tokens_per_token"]
