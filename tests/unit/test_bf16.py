"""bfloat16 on CPUs that have it: `dllm doctor`'s reading of /proc/cpuinfo (cpuinfo.py), and decoding in bf16
(`--dtype bfloat16`: weights, compute and KV caches in bf16, logits in float32) of a causal model and of a block
diffusion model with its block cache, against the same model in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dllm.cpuinfo as cpuinfo
import dllm.models.output as output
from dllm.cli.main import main
from dllm.config.model import ModelConfig
from dllm.config.sampler import SamplerConfig
from dllm.inference.engine import generate
from dllm.models.factory import cast_weights
from dllm.models.transformer import Transformer
from dllm.recipes import write_ar_model
from dllm.sampling.canvas import SpecialIds

V = 64
SPECIAL = SpecialIds(mask_id=63, pad_id=62, eos_id=61, num_tokens=V)

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_vnni avx512_bf16 vaes
bogomips\t: 4792.80

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_vnni avx512_bf16 vaes
"""
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
OLD_XEON = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize(
    ("text", "native", "flags"),
    [
        (EPYC, True, ("avx512_bf16",)),
        (SAPPHIRE_RAPIDS, True, ("avx512_bf16", "amx_bf16", "amx_tile")),
        (OLD_XEON, False, ()),
        (GRAVITON3, True, ("bf16",)),
        (EPYC.replace("avx512_bf16 vaes\n", "vaes\n", 1), False, ()),  # one core without it: as weak as that
        ("", None, ()),  # no flags line: unknown
        (None, None, ()),  # not Linux
    ],
)
def test_bf16_support_from_cpuinfo(text, native, flags):
    support = cpuinfo.bf16_support(text)
    assert (support.native, support.flags) == (native, flags)
    assert support.summary() and support.meaning()
    assert ("unknown" in support.summary()) == (native is None)


def test_doctor_says_whether_the_cpu_has_native_bf16(monkeypatch: pytest.MonkeyPatch, capsys):
    for text, expect, meaning in ((EPYC, "native (avx512_bf16)", "in hardware"), (OLD_XEON, "none", "emulated"),
                                  (None, "unknown", "measure")):  # fmt: skip
        monkeypatch.setattr(cpuinfo, "read_cpuinfo", lambda text=text: text)
        assert main(["doctor", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["cpu bf16"].startswith(expect) and meaning in report["bf16 here"]
    monkeypatch.setattr(cpuinfo, "read_cpuinfo", lambda: EPYC)
    assert main(["doctor"]) == 0
    assert "cpu bf16" in capsys.readouterr().out


def tiny(block: bool = False) -> Transformer:
    """A random tiny model in float32 (init std 0.2: logits far from ties for most positions, not all)."""
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, init_std=0.2, num_layers=2))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


PROMPTS = [[5, 9, 2, 40, 17], [3], [8, 8, 1, 22, 30, 31, 2, 7, 11], [50, 4], [12, 13, 14], [33, 1, 6, 0]]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_cast_weights_keeps_computed_tables_in_float32():
    model = cast_weights(tiny(), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.inv_freq.dtype == torch.float32  # RoPE's frequencies, not rounded to bf16
    assert torch.equal(model.inv_freq, tiny().inv_freq)


def test_causal_decoding_in_bf16_has_float32_logits_and_mostly_agrees():
    """A bf16 KV cache: the ragged cache takes the weights' dtype (a float32 one would fail SDPA's dtype check)."""
    cfg = SamplerConfig(generation="causal", gen_length=12, temperature=0.0, stop_at_eos=False)
    ref = generate(tiny(), PROMPTS, cfg, SPECIAL, return_logits=True)
    bf16 = generate(cast_weights(tiny(), torch.bfloat16), PROMPTS, cfg, SPECIAL, return_logits=True)
    assert bf16.logits_BNV is not None and ref.logits_BNV is not None
    assert bf16.logits_BNV.dtype == torch.float32
    first = [row[0] for row in bf16.sequences]
    assert first == [row[0] for row in ref.sequences]
    finite = ref.logits_BNV[:, 0].isfinite()  # the mask id is -inf in both
    assert float((bf16.logits_BNV[:, 0] - ref.logits_BNV[:, 0])[finite].abs().max()) < 0.1
    assert agreement(bf16.sequences, ref.sequences) >= 0.75


@pytest.mark.parametrize("cache", ["none", "block"])
def test_block_diffusion_in_bf16_has_float32_logits_and_mostly_agrees(cache, monkeypatch: pytest.MonkeyPatch):
    seen: set[torch.dtype] = set()
    plain = output.token_logits

    def spy(*args, **kwargs):
        logits = plain(*args, **kwargs)
        seen.add(logits.dtype)
        return logits

    monkeypatch.setattr(output, "token_logits", spy)
    cfg = SamplerConfig(gen_length=16, block_length=4, steps=16, stop_at_eos=False, shift="off", attention="block",
                        policy="low_confidence", cache=cache)  # fmt: skip
    ref = generate(tiny(), PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(0))
    bf16 = generate(
        cast_weights(tiny(), torch.bfloat16), PROMPTS, cfg, SPECIAL, generator=torch.Generator().manual_seed(0)
    )
    assert seen == {torch.float32}
    assert agreement(bf16.sequences, ref.sequences) >= 0.75
    if cache == "block":
        assert bf16.counters.cached_tokens > 0


@pytest.fixture(scope="module")
def ar_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ar_model(tmp_path_factory.mktemp("bf16") / "ar")


def test_generate_and_chat_decode_in_bf16(ar_folder: Path, capsys):
    for dtype in ("float32", "bfloat16"):
        args = ["generate", "--model", str(ar_folder), "--ar", "-p", "1 + 2 =", "--max-new-tokens", "6"]
        assert main([*args, "--json", "--dtype", dtype]) == 0
        record = json.loads(capsys.readouterr().out.splitlines()[0])
        assert record["prompt"] == "1 + 2 =" and record["tokens_committed"] == 6


def test_eval_tasks_and_likelihood_in_bf16(ar_folder: Path, tmp_path: Path, capsys):
    """eval decodes and scores in the dtype asked for, and its JSON says which."""
    task = tmp_path / "sums.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{a} + {a} =", "answer": str(2 * a)}) + "\n" for a in range(4)))
    records = {}
    for dtype in ("float32", "bfloat16"):
        args = ["eval", "tasks", "--model", str(ar_folder), "--ar", "--tasks", str(task), "--gen-length", "4"]
        assert main([*args, "--json", "-q", "--dtype", dtype]) == 0
        records[dtype] = json.loads(capsys.readouterr().out.splitlines()[0])
    assert records["bfloat16"]["dtype"] == "bfloat16" and records["float32"]["dtype"] == "float32"
    assert records["bfloat16"]["examples"] == records["float32"]["examples"] == 4


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "eval tasks", "eval likelihood"])
def test_a_bad_dtype_is_one_line(command: str, ar_folder: Path, tmp_path: Path, capsys):
    args = [*command.split(), "--model", str(ar_folder), "--dtype", "float16"]
    args += [] if command == "eval likelihood" else ["--ar"]
    args += {"generate": ["-p", "hi"], "serve": ["--port", "1"], "eval tasks": ["--tasks", "addition"],
             "eval likelihood": ["--data", str(tmp_path)]}.get(command, [])  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dllm: error: --dtype: 'float16' is not a decoding dtype; use float32 or bfloat16"]


@pytest.mark.parametrize("kind", ["plain", "ragged"])
def test_one_query_with_grouped_heads_in_bf16_matches_the_reference(kind: str):
    """A bf16 decoding step on CPU runs the query heads of each key/value head as its rows (sdpa.py): the
    same attention as enable_gqa over every head, within bf16's rounding; float32 keeps the plain call."""
    from dllm.attention.backends.sdpa import sdpa_attention, sdpa_mask
    from dllm.attention.masks import AttentionMask

    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, K, D = 3, 9, 3, 20, 16
    q, k, v = (torch.randn(B, h, n, D, generator=gen, dtype=torch.float64) for h, n in ((H, 1), (Hkv, K), (Hkv, K)))
    mask = AttentionMask("bidirectional")
    if kind == "ragged":  # rows holding 19, 7 and 12 cached keys, the query after them
        mask = AttentionMask("causal", query_offset_B=torch.tensor([19, 7, 12]))
    dense = None if mask.is_plain else sdpa_mask(mask, B, 1, K, q.device)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    low = sdpa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask)
    assert low.dtype == torch.bfloat16 and low.shape == ref.shape
    assert float((low.double() - ref).abs().max()) < 3e-2
    q32, k32, v32 = q.float(), k.float(), v.float()
    plain = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=dense, enable_gqa=True)
    assert torch.equal(sdpa_attention(q32, k32, v32, mask), plain)
