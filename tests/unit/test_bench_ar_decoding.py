"""bench/ar_decoding.py runs end to end on a tiny target and reports every variant at every batch size."""

from __future__ import annotations

from bench.ar_decoding import BASELINE, VARIANTS, main


def test_the_bench_reports_every_variant(capsys):
    result = main(["--layers", "1", "--width", "64", "--prompt-len", "6", "--gen", "5", "--repeats", "1"])
    assert capsys.readouterr().out.count("\n") == 1  # one JSON line
    for batch in ("batch_1", "batch_8"):
        row = result[batch]
        assert row[f"{BASELINE}_speedup_vs_{BASELINE}"] == 1.0
        for name in VARIANTS:
            assert row[f"{name}_tok_s"] > 0
        # the cache runs one prefill and one forward per further token; recomputation the same count
        assert row["ar_cache_forwards_per_token"] == 5 / (5 * int(batch.split("_")[1]))
