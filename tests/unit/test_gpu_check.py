"""bench/gpu_check.py (`make gpu-check`) without a GPU: its no-device message, and a tiny CPU run of its
sections through main() (no compile, no pytest subprocess), so the script is known to run end to end
before a GPU session spends its minutes on it."""

from __future__ import annotations

import json
import time

import torch
from bench import gpu_check
from bench.gpu_check import (
    GPU,
    TINY,
    Guard,
    check_flex,
    main,
    make_objective,
    mask_cases,
    parse_junit,
    random_batch,
    sampler_cfg,
)

from dllm.attention.masks import dense_mask, mask_mod
from dllm.config.model import ModelConfig
from dllm.models.transformer import Transformer


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out == "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check\n"


def test_flex_forward_equals_the_dense_reference_for_every_mask_kind_on_cpu():
    # float32 only, to stay fast (each case traces FlexAttention once); the script's --tiny run covers bf16 too
    result = check_flex(TINY, torch.device("cpu"), compile=False, deadline=time.monotonic() + 120, dtypes=("float32",))
    names = list(mask_cases(2, 32, torch.device("cpu")))
    assert [c["name"] for c in result["cases"]] == [f"{n}/float32" for n in names]
    assert result["failures"] == [] and result["not_run"] == []
    for case in result["cases"]:
        assert case["ok"] is True, case
        assert set(case["max_abs_err"]) == {"out"}  # forward only: FlexAttention has no CPU backward
    kinds = {m.kind for m, *_ in mask_cases(2, 32, torch.device("cpu")).values()}
    assert kinds == {"bidirectional", "causal", "block_causal", "block_diffusion"}


def test_a_tiny_cpu_run_prints_one_json_line_with_every_section(capfd):
    sections = "compile_vs_eager,mfu,sampling"
    code = main(["--device", "cpu", "--tiny", "--no-compile", "--sections", sections])
    out = capfd.readouterr().out
    assert out.count("\n") == 1, out
    report = json.loads(out)
    assert code == 0 and report["ok"] is True and report["failures"] == [] and report["not_run"] == []
    assert {"device", "torch", "wall_s", "sections"} <= set(report)
    assert set(report["sections"]) == set(sections.split(","))
    compiled = report["sections"]["compile_vs_eager"]["cases"]
    assert [c["name"] for c in compiled] == ["bd3lm", "mdlm"] and all(c["max_rel_loss_diff"] == 0 for c in compiled)
    mfu = report["sections"]["mfu"]
    assert [c["name"] for c in mfu["cases"]] == ["bd3lm/seq64", "mdlm/seq64", "bd3lm/seq128", "mdlm/seq128"]
    assert all(c["tokens_per_s"] > 0 and c["mfu"] is None for c in mfu["cases"]) and "MFU is null" in mfu["peak_source"]
    sampling = {c["name"]: c for c in report["sections"]["sampling"]["cases"]}
    assert sampling["block/block"]["agreement_vs_none"] == 1.0
    assert sampling["block/exact_float64_sdpa"]["ok"] and sampling["bidirectional/none"]["speedup_vs_none"] == 1.0


def test_a_case_that_does_not_fit_the_budget_is_recorded_not_run():
    guard = Guard("s", budget_s=0.0, deadline=time.monotonic() + 10, first_estimate_s=1.0)
    assert guard.run("a", lambda: {"ok": True}) == {"name": "a", "ok": None, "status": "skipped: time budget"}
    guard = Guard("s", budget_s=10.0, deadline=time.monotonic() + 10, first_estimate_s=0.0)
    assert guard.run("b", lambda: 1 / 0)["error"].startswith("ZeroDivisionError")
    assert guard.result([])["failures"] == ["b: ZeroDivisionError: division by zero"]


def test_junit_report_counts_and_names_failures():
    xml = """<testsuites><testsuite name="pytest">
      <testcase classname="tests.gpu.test_cuda" name="test_a"/>
      <testcase classname="tests.gpu.test_cuda" name="test_b"><failure message="boom"/></testcase>
      <testcase classname="tests.gpu.test_cuda" name="test_c"><error message="setup"/></testcase>
      <testcase classname="tests.gpu.test_cuda" name="test_d"><skipped message="needs a CUDA GPU"/></testcase>
    </testsuite></testsuites>"""
    result = parse_junit(xml)
    assert (result["passed"], result["failed"], result["skipped"]) == (1, 2, 1)
    assert result["failed_names"] == {"tests.gpu.test_cuda::test_b": "boom", "tests.gpu.test_cuda::test_c": "setup"}
    assert result["skip_reasons"] == ["needs a CUDA GPU"]
    assert gpu_check.SECTIONS[0] == "pytest"


def test_the_gpu_sizes_are_valid_without_a_gpu():
    """What only the GPU run uses: its model configs, masks, batches and sampler settings build here."""
    for fields in (GPU.train_model, GPU.mfu_model, GPU.sample_model):
        with torch.device("meta"):
            Transformer(ModelConfig(**fields))
    for name, (mask, q_len, kv_len, _) in mask_cases(GPU.attn[0], GPU.attn[4], torch.device("cpu")).items():
        dense = dense_mask(mask_mod(mask, kv_len), GPU.attn[0], q_len, kv_len, torch.device("cpu"))
        assert bool(dense.any(-1).all()), f"{name}: a query row without keys"
    vocab = GPU.mfu_model["vocab_size"]
    for seq_len in GPU.mfu_seqs:
        batch = random_batch(max(GPU.mfu_tokens_per_step // seq_len, 1), seq_len, vocab, 0)
        inputs = make_objective("bd3lm", vocab).prepare(batch, gpu_check.NoiseKeys(0, batch.tokens_BL.shape[0]))
        assert inputs.tokens_BL.shape == (batch.tokens_BL.shape[0], 2 * seq_len)
    for attention, cache in (("bidirectional", "dual"), ("block", "block")):
        assert sampler_cfg(GPU, attention, cache).num_blocks == GPU.sample[3] // GPU.sample[4]


def test_the_delta_rule_section_is_recorded_not_run_without_cuda_or_fla(capfd):
    """Section delta_rule compares flash-linear-attention's kernel with the torch form on a GPU with the fla
    package (tests/gpu/test_fla.py's comparisons); here it says why it did not run, and fails nothing."""
    code = main(["--device", "cpu", "--tiny", "--no-compile", "--sections", "delta_rule"])
    report = json.loads(capfd.readouterr().out)
    assert code == 0 and report["ok"] is True and report["not_run"] == ["delta_rule: fla_vs_torch"]
    (case,) = report["sections"]["delta_rule"]["cases"]
    assert case["ok"] is None and case["status"] == "skipped: needs CUDA"
    from tests.gpu import test_fla  # what the section runs on a GPU: importable here, its tests skipped

    assert callable(test_fla.compare_rule) and callable(test_fla.compare_model) and "delta_rule" in gpu_check.SECTIONS
