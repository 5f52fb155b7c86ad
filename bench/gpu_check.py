"""`make gpu-check`: the first command of a session that has a GPU. Runs every CUDA path of the project
once, within ~6 minutes of work on one GPU (a watchdog ends it, JSON line printed, before 8), and prints
ONE JSON line to stdout (progress goes to stderr). Exit 1 if any check failed, 0 if all passed.

Sections (each has its own time budget; a case that would not fit is recorded as "skipped: time budget"):

1. `pytest` - `pytest tests/gpu` in a subprocess, started first and run beside sections 2 and 3 (they
   only check numbers; the timed sections 4 and 5 wait for it): passed / failed / skipped counts and the
   names of the failures.
2. `flex_vs_sdpa` - compiled FlexAttention (`torch.compile(flex_attention)`, the project's
   `compiled_flex()` with the BlockMask of `flex_block_mask`) against SDPA with the dense bool mask of
   the same mask function (`masks.dense_mask(masks.mask_mod(...))`), for every mask the project builds:
   the four base kinds, documents, key padding, sliding windows, BD3LM's x_t-only last layer and the
   query offsets of cached decoding. Forward and the gradients of q, k, v (inference-only masks:
   forward), bf16 and fp32, against a float64 reference on the same (rounded) inputs. A tensor passes
   if max|flex - ref| <= atol + rtol * max|ref| (TOLERANCE, per dtype).
3. `compile_vs_eager` - a few optimizer steps of mdlm and bd3lm on a small model, eager blocks (with the
   FlexAttention kernel compiled alone, as `model.flex_compile` does) vs compiled blocks
   (`parallel.apply.apply_parallelism(compile=True)`, as `training.compile` does), from the same
   weights and batches, under bf16 autocast as the trainer runs on GPU: the largest relative loss
   difference over the steps and the relative L2 difference of the first step's gradients.
4. `mfu` - tokens/s and MFU of a ~454M llama-like model (MFU_MODEL) for mdlm and bd3lm at seq 2048 and
   8192, bf16 autocast, compiled blocks, the `auto` attention backend (FlexAttention BlockMask for the
   block-diffusion mask, SDPA's kernels for plain masks); FLOPs from `training.mfu.FlopsMeter` (the
   trainer's own accounting), peak from `training.mfu.peak_of` (+ L4 here). A case that runs out of
   memory is retried with full activation checkpointing; both are recorded.
5. `sampling` - `sampling.generate` on a small random model with every cache (none, prefix, dual for
   bidirectional decoding; none and block for block decoding): tokens/s, NFE, speed-up vs no cache;
   the exact block cache must give the same greedy tokens as no cache, in float32 on the default
   backend and in float64 on SDPA (the ties-free reference).
6. `delta_rule` - flash-linear-attention's chunked gated delta rule (the optional kernel of the hybrid
   models' linear layers, `model.linear_attention_kernel: fla`, models/fla_rule.py) against the pure-torch
   chunked form on the same bf16 inputs, outputs and final states, with and without an initial state, and
   the logits of a bf16 qwen3_5 with either kernel (tests/gpu/test_fla.py's comparisons, here with their
   largest differences). Runs beside pytest with sections 2 and 3; recorded as not run where the fla package
   is not installed (this adapter has never run: written without a GPU or the package).

Reading the JSON: `ok` (no failure anywhere), `failures` ("section: case: why"), `not_run` (cases left
out for time), `device`, `torch`, `wall_s` per section, and `sections.<name>` with the per-case results:
`ok` true / false (null: not run), `why` or `error` (the exception) when false, `wall_s`, and `dynamo`
(graphs compiled, graph breaks, recompile-limit hits: past dynamo's limit of 8 recompiles a function
runs eagerly, silently) when the case compiled anything.

    make gpu-check                                  # on a GPU host
    python bench/gpu_check.py [--sections flex_vs_sdpa,mfu] [--budget-s 360]

Developer switch (not in --help): `--device cpu --tiny [--no-compile]` runs the same code on CPU with
tiny sizes (FlexAttention has no CPU backward: forward only), to check the script itself.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dllm.attention.backends.flex import compiled_flex, flex_block_mask
from dllm.attention.masks import AttentionMask, dense_mask, mask_mod
from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, MDLMConfig
from dllm.config.sampler import SamplerConfig
from dllm.config.training import OptimizerConfig, TopologyConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, MDLMObjective, TokenIds
from dllm.inference.engine import generate
from dllm.models.transformer import Transformer
from dllm.parallel.apply import apply_parallelism
from dllm.parallel.dims import ParallelDims
from dllm.parallel.grad_norm import clip_grad_norm
from dllm.sampling.canvas import SpecialIds
from dllm.training.mfu import FlopsMeter, peak_of
from dllm.training.optim import build_optimizer
from dllm.training.trainer import run_model

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("pytest", "flex_vs_sdpa", "compile_vs_eager", "mfu", "sampling", "delta_rule")
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-3, 1e-3)}
"""(atol, rtol) of compiled FlexAttention against the float64 dense reference, per input dtype."""
LOSS_RTOL, GRAD_RTOL = 1e-2, 5e-2
"""compile_vs_eager under bf16 autocast: max relative loss difference, relative L2 gradient difference."""
EXTRA_PEAKS = {"L4": 121e12}
"""Dense bf16 peaks of GPUs not in dllm.training.mfu.PEAK_BF16_FLOPS."""
WATCHDOG_GRACE_S = 90
"""The watchdog prints the JSON line and exits this long after the budget (370 + 90 s < 8 minutes)."""
MFU_MODEL = {"preset": "350m", "hidden_size": 1280, "num_heads": 20, "num_kv_heads": 4, "vocab_size": 32000,
             "max_seq_len": 8192}  # fmt: skip
"""~454M parameters, llama-like: 24 layers, hidden 1280, 20 query / 4 key-value heads of 64, SwiGLU 3456,
vocabulary 32000 (tied embeddings)."""


@dataclass(frozen=True)
class Sizes:
    """Every size the sections use: GPU (the real check) or tiny (the CPU self-test of the script)."""

    budget_s: dict[str, float]  # per section; pytest's runs beside flex_vs_sdpa and compile_vs_eager
    attn: tuple[int, int, int, int, int]  # flex_vs_sdpa: batch, query heads, kv heads, head dim, L
    flex_workers: int  # flex_vs_sdpa: processes compiling cases side by side (0: in this process)
    train_model: dict[str, Any]  # compile_vs_eager: ModelConfig fields
    train: tuple[int, int, int]  # compile_vs_eager: batch, L, optimizer steps
    mfu_model: dict[str, Any]
    mfu_seqs: tuple[int, ...]
    mfu_tokens_per_step: int
    mfu_steps: tuple[int, int]  # warm-up, timed
    sample_model: dict[str, Any]
    sample: tuple[int, int, int, int, int]  # batch, shortest prompt, longest prompt, gen length, block
    sample_repeats: int
    delta_rule: tuple[tuple[int, int, int, int, int], ...]  # delta_rule: (batch, heads, L, key width, value width)


GPU = Sizes(
    budget_s={"pytest": 200, "flex_vs_sdpa": 70, "compile_vs_eager": 80, "mfu": 150, "sampling": 50, "delta_rule": 30},
    attn=(2, 8, 2, 64, 256),
    flex_workers=6,
    train_model={"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 1024},
    train=(4, 256, 3),
    mfu_model=MFU_MODEL,
    mfu_seqs=(2048, 8192),
    mfu_tokens_per_step=16384,
    mfu_steps=(2, 4),
    sample_model={"preset": "small", "vocab_size": 1024},
    sample=(8, 24, 64, 128, 32),
    sample_repeats=2,
    delta_rule=((2, 4, 256, 64, 64), (1, 16, 2048, 128, 128)),
)
TINY = Sizes(
    budget_s={
        "pytest": 120,
        "flex_vs_sdpa": 120,
        "compile_vs_eager": 120,
        "mfu": 120,
        "sampling": 120,
        "delta_rule": 60,
    },  # fmt: skip
    attn=(2, 4, 2, 16, 32),
    flex_workers=0,
    train_model={"preset": "tiny", "vocab_size": 256},
    train=(2, 32, 2),
    mfu_model={"preset": "tiny", "vocab_size": 256},
    mfu_seqs=(64, 128),
    mfu_tokens_per_step=256,
    mfu_steps=(1, 2),
    sample_model={"preset": "tiny", "vocab_size": 256},
    sample=(2, 4, 8, 16, 8),
    sample_repeats=1,
    delta_rule=((1, 2, 40, 16, 16),),
)


def log(msg: str) -> None:
    print(f"gpu-check: {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dynamo_counts() -> dict[str, int]:
    """torch.compile's running totals: graphs compiled, graph breaks, recompile-limit hits."""
    from torch._dynamo.utils import counters

    limit_hits = sum(n for k, n in counters["unimplemented"].items() if "recompile limit" in k.lower())
    graph_breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    return {"graphs": graphs, "graph_breaks": graph_breaks, "recompile_limit_hits": limit_hits}


def error_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:400]}"


def measured(name: str, case: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`case()`'s record with its name, wall time and what torch.compile did; an exception is a failed case."""
    log(name)
    t0, dynamo0 = time.monotonic(), dynamo_counts()
    try:
        record = {"name": name, **case()}
    except Exception as err:  # one broken case must not hide the others
        traceback.print_exc(file=sys.stderr)
        record = {"name": name, "ok": False, "error": error_text(err)}
    record["wall_s"] = round(time.monotonic() - t0, 2)
    dynamo = {k: v - dynamo0[k] for k, v in dynamo_counts().items() if v != dynamo0[k]}
    if dynamo:  # graphs compiled, graph breaks, and "recompile limit hit" (the rest of that code ran eagerly)
        record["dynamo"] = dynamo
    return record


class Guard:
    """A section's time budget: a case runs only if its estimated time (1.5 x the previous case's, or a
    first guess) still fits before the section's end and the run's deadline; else it is skipped."""

    def __init__(self, section: str, budget_s: float, deadline: float, first_estimate_s: float) -> None:
        self.section, self.end = section, min(time.monotonic() + budget_s, deadline)
        self.estimates: dict[str, float] = {"": first_estimate_s}  # per kind of case ("": the last case)
        self.failures: list[str] = []
        self.not_run: list[str] = []

    def fits(self, kind: str = "") -> bool:
        return time.monotonic() + self.estimates.get(kind, self.estimates[""]) <= self.end

    def run(self, name: str, case: Callable[[], dict[str, Any]], kind: str = "") -> dict[str, Any]:
        """`case()` -> its record (with "ok"), or a skipped / error record; failures are collected. `kind`:
        cases of one kind are estimated from the last of that kind (else from the last case)."""
        if not self.fits(kind):
            return self.skip(name)
        return self.add(measured(f"{self.section}: {name}", case), name, kind)

    def add(self, record: dict[str, Any], name: str | None = None, kind: str = "") -> dict[str, Any]:
        """Book a finished case: its time is the next estimate; a failed one joins `failures`."""
        record["name"] = name or record["name"]
        self.estimates[""] = self.estimates[kind] = 1.5 * record["wall_s"]
        if record.get("ok") is False:
            self.failures.append(f"{record['name']}: {record.get('error') or record.get('why', 'check failed')}")
        return record

    def skip(self, name: str, status: str = "skipped: time budget") -> dict[str, Any]:
        self.not_run.append(name)
        return {"name": name, "ok": None, "status": status}

    def result(self, cases: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"cases": cases, "failures": self.failures, "not_run": self.not_run, **extra}


# --------------------------------------------------------------------------------------------------
# 1. pytest tests/gpu (a subprocess, beside sections 2 and 3)


def start_pytest(xml_path: Path, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml_path}"]
    with open(log_path, "wb") as out:  # the child keeps its own handle
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def finish_pytest(proc: subprocess.Popen, deadline: float, xml_path: Path, log_path: Path) -> dict[str, Any]:
    """Wait for pytest until `deadline` (then kill its process group) and read its JUnit report."""
    timed_out = False
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
    if xml_path.exists() and xml_path.stat().st_size:
        result = parse_junit(xml_path.read_text())
    else:
        result = {"passed": 0, "failed": 0, "skipped": 0, "failed_names": {}}
    result.update(returncode=proc.returncode, log=str(log_path))
    failures = [f"{name}: {message}" for name, message in result["failed_names"].items()]
    if timed_out:
        failures.append("pytest: did not finish in its time budget (killed)")
    elif proc.returncode not in (0, 5) and not failures:  # 5: no tests collected
        failures.append(f"pytest exited {proc.returncode}: {tail[-300:]}")
    if failures:
        log(f"pytest output (tail):\n{tail}")
    return {**result, "failures": failures, "not_run": []}


def parse_junit(text: str) -> dict[str, Any]:
    """Counts, failed tests (name -> the first line of the failure) and skip reasons from --junitxml."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed: dict[str, str] = {}
    reasons: list[str] = []
    for case in ET.fromstring(text).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            counts["failed"] += 1
            failed[name] = (problem.get("message") or "failed").splitlines()[0][:300]
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            reasons.append(skip.get("message", ""))
        else:
            counts["passed"] += 1
    return {**counts, "failed_names": failed, "skip_reasons": sorted(set(reasons))[:3]}


# --------------------------------------------------------------------------------------------------
# 2. compiled FlexAttention vs the dense SDPA reference


def mask_cases(batch: int, L: int, device: torch.device) -> dict[str, tuple[AttentionMask, int, int, bool]]:
    """name -> (mask, query length, key length, with backward), most important first. Every query row
    has at least one allowed key (SDPA returns NaN for a row without, FlexAttention 0)."""
    g = torch.Generator().manual_seed(0)
    docs = torch.cumsum(torch.rand(batch, L, generator=g) < 8 / L, dim=1).to(device)
    bs, q = 16 if L >= 64 else 8, L // 4
    valid = torch.ones(batch, L, dtype=torch.bool)
    valid[0, : bs // 2] = False  # left padding (batched prompts), half a block: each noisy block keeps keys
    valid = valid.to(device)
    offsets = torch.tensor([L // 2, L - q][:batch] + [0] * max(batch - 2, 0), dtype=torch.int64, device=device)
    A = AttentionMask
    return {
        "block_diffusion": (A("block_diffusion", block_size=bs), 2 * L, 2 * L, True),
        "block_diffusion_xt_queries": (A("block_diffusion", block_size=bs, num_outputs=L), L, 2 * L, True),
        "block_diffusion_documents": (A("block_diffusion", block_size=bs, doc_ids_BL=docs), 2 * L, 2 * L, True),
        # Fast-dLLM v2's two views over one clean stream: [x_t^1 ; x_t^2 ; x_0]
        "block_diffusion_two_views": (
            A("block_diffusion", block_size=bs, views=2, doc_ids_BL=docs), 3 * L, 3 * L, True),
        "causal_documents": (A("causal", doc_ids_BL=docs), L, L, True),
        "bidirectional_documents": (A("bidirectional", doc_ids_BL=docs), L, L, True),
        "bidirectional_key_padding": (A("bidirectional", key_valid_BL=valid), L, L, True),
        "block_causal": (A("block_causal", block_size=bs), L, L, True),
        "block_causal_documents": (A("block_causal", block_size=bs, doc_ids_BL=docs), L, L, True),
        "bidirectional_sliding_window": (A("bidirectional", window=L // 4 + 1), L, L, True),
        "causal_sliding_window": (A("causal", window=L // 4 + 1), L, L, True),
        "block_diffusion_key_padding": (A("block_diffusion", block_size=bs, key_valid_BL=valid), 2 * L, 2 * L, True),
        "causal": (A("causal"), L, L, True),
        "bidirectional": (A("bidirectional"), L, L, True),
        # cached decoding (sampling only: no backward): a slice of queries against the keys from the start
        "causal_query_offset": (A("causal", query_offset=L - q), q, L, False),
        "block_causal_query_offset_documents": (
            A("block_causal", block_size=bs, doc_ids_BL=docs, query_offset=L - q), q, L, False),
        "bidirectional_key_padding_query_offset": (
            A("bidirectional", key_valid_BL=valid, query_offset=L - q), q, L, False),
        "causal_ragged_query_offsets": (A("causal", query_offset_B=offsets), q, L, False),
    }  # fmt: skip


def compare_flex(
    mask: AttentionMask, q_len: int, kv_len: int, dtype: torch.dtype, attn: tuple, backward: bool, compiled: bool,
    device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """One case: compiled (or eager) FlexAttention in `dtype` vs float64 SDPA with the dense mask (float64:
    SDPA's math kernel, exact enough that the error measured is FlexAttention's alone)."""
    B, H, K, D, _ = attn
    g = torch.Generator().manual_seed(1)
    shapes = [(B, H, q_len, D), (B, K, kv_len, D), (B, K, kv_len, D)]
    base = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]
    grad_out = torch.randn(shapes[0], generator=g).to(device=device, dtype=torch.float64)
    dense = dense_mask(mask_mod(mask, kv_len), B, q_len, kv_len, device)
    assert bool(dense.any(-1).all()), "a query row without keys: SDPA and FlexAttention disagree by convention"
    ref_in = [t.double().requires_grad_(backward) for t in base]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=dense, enable_gqa=H != K)
    test_in = [t.clone().requires_grad_(backward) for t in base]
    kernel = compiled_flex() if compiled else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = kernel(*test_in, block_mask=flex_block_mask(mask, B, q_len, kv_len, device), enable_gqa=H != K)
    pairs = {"out": (out, ref)}
    if backward:
        ref_grads = torch.autograd.grad(ref, ref_in, grad_out)
        test_grads = torch.autograd.grad(out, test_in, grad_out.to(dtype))
        pairs.update({f"grad_{n}": (t, r) for n, t, r in zip("qkv", test_grads, ref_grads, strict=True)})
    atol, rtol = TOLERANCE[dtype]
    errors, bad = {}, []
    for name, (test, reference) in pairs.items():
        err, tol = float((test.double() - reference).abs().max()), atol + rtol * float(reference.abs().max())
        errors[name] = float(f"{err:.3g}")
        if not err <= tol:  # NaN fails too
            bad.append(f"{name} max abs err {err:.3g} > tol {tol:.3g}")
    return {"ok": not bad, "max_abs_err": errors, **({"why": "; ".join(bad)} if bad else {})}


def flex_task(name: str, dtype_name: str, attn: tuple, compile: bool, device_type: str) -> dict[str, Any]:
    """One case of section 2, here or in a worker process (the masks are rebuilt from their seed)."""
    device = torch.device(device_type)
    mask, q_len, kv_len, grad = mask_cases(attn[0], attn[4], device)[name]
    backward = grad and device.type == "cuda"  # no FlexAttention backward on CPU (torch 2.13)
    torch._dynamo.reset()  # a fresh compile per case: no recompile limit, no cached fallback to eager
    dtype = getattr(torch, dtype_name)
    run = functools.partial(compare_flex, mask, q_len, kv_len, dtype, attn, backward, compile, device)
    record = measured(f"flex_vs_sdpa: {name}/{dtype_name}", run)
    return {**record, "name": f"{name}/{dtype_name}", "backward": backward if grad else "n/a (inference-only mask)"}


def check_flex(
    sz: Sizes, device: torch.device, compile: bool, deadline: float, workers: int = 0,
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
) -> dict[str, Any]:  # fmt: skip
    """Section 2: every mask case in each dtype, most important first; with `workers` > 1 the cases run
    in that many processes (each case compiles two kernels, serially: CPU-bound, not GPU-bound)."""
    guard = Guard("flex_vs_sdpa", sz.budget_s["flex_vs_sdpa"], deadline, first_estimate_s=1.0)
    names = mask_cases(sz.attn[0], sz.attn[4], device)
    tasks = [(name, dtype, sz.attn, compile, device.type) for name in names for dtype in dtypes]
    if workers > 1:
        cases = flex_in_workers(guard, tasks, workers)
    else:
        cases = [guard.add(flex_task(*task)) if guard.fits() else guard.skip(f"{task[0]}/{task[1]}") for task in tasks]
    tol = {str(k).removeprefix("torch."): {"atol": a, "rtol": r} for k, (a, r) in TOLERANCE.items()}
    passed = sum(c["ok"] is True for c in cases)
    return guard.result(cases, compiled=compile, tolerance=tol, passed=passed, total=len(cases), workers=workers)


def flex_in_workers(guard: Guard, tasks: list[tuple], workers: int) -> list[dict[str, Any]]:
    """The tasks in a pool of spawned processes; what has not finished by the guard's end is not run."""
    pool = multiprocessing.get_context("spawn").Pool(workers, initializer=quiet_worker)
    try:
        pending = [pool.apply_async(flex_task, task) for task in tasks]
        cases = []
        for task, result in zip(tasks, pending, strict=True):
            try:
                cases.append(guard.add(result.get(timeout=max(guard.end - time.monotonic(), 0.01))))
            except multiprocessing.TimeoutError:
                cases.append(guard.skip(f"{task[0]}/{task[1]}", "not finished in the time budget (or its worker died)"))
        return cases
    finally:
        pool.terminate()


def quiet_worker() -> None:
    """A flex worker compiles in its own process: no pool of compile subprocesses per worker."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


# --------------------------------------------------------------------------------------------------
# shared by sections 3 and 4: a model, an objective, a batch, one training step as the trainer does it


def ids_for(vocab: int) -> TokenIds:
    return TokenIds(mask_id=vocab - 1, eos_id=vocab - 2, pad_id=vocab - 3, num_tokens=vocab)


def make_objective(name: str, vocab: int):
    if name == "mdlm":
        return MDLMObjective(MDLMConfig(), ids_for(vocab))
    return BD3LMObjective(BD3LMConfig(block_size=16), ids_for(vocab))


def random_batch(batch: int, seq_len: int, vocab: int, step: int) -> Batch:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab - 3, (batch, seq_len), generator=g)
    sample_ids = torch.arange(step * batch, (step + 1) * batch)
    return Batch(tokens, torch.ones_like(tokens, dtype=torch.bool), sample_ids, None)


def build_model(fields: dict[str, Any], device: torch.device, compile: bool, checkpointing: str = "none", init=True):
    """A Transformer on `device` (seeded weights if `init`), with activation checkpointing and compiled
    blocks applied by the project's own `apply_parallelism` (one device: no mesh)."""
    cfg = ModelConfig(**fields)
    with torch.device(device):
        model = Transformer(cfg)
    if init:
        model.init_weights(torch.Generator().manual_seed(0))
    topology = TopologyConfig()
    dims = ParallelDims.from_topology(topology, 1)
    return apply_parallelism(model, dims, None, topology, compile, activation_checkpointing=checkpointing)


def forward_backward(model, objective, batch: Batch, noise: NoiseKeys, device: torch.device) -> tuple[float, int]:
    """The trainer's micro-step (training/trainer.py train_step): prepare, bf16 autocast around the
    model call and the loss, loss_sum / number of targets, backward. Returns (loss, head rows)."""
    inputs = objective.prepare(batch.to(device), noise)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = objective.loss(run_model(model, inputs), inputs)
    loss = out.loss_sum / max(objective.normalizer(batch), 1)
    loss.backward()
    return float(loss.detach()), int(out.metrics["num_masked"])


def optimizer_step(model, optimizer) -> None:
    clip_grad_norm(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --------------------------------------------------------------------------------------------------
# 3. compiled vs eager training


def compile_case(objective_name: str, sz: Sizes, device: torch.device, compile: bool) -> dict[str, Any]:
    """The same steps on an eager and a compiled copy of one model: losses and first gradients."""
    batch_size, seq_len, steps = sz.train
    vocab = sz.train_model["vocab_size"]
    objective = make_objective(objective_name, vocab)
    eager = build_model(sz.train_model, device, compile=False)
    compiled = build_model(sz.train_model, device, compile=compile, init=False)
    compiled.load_state_dict(eager.state_dict())
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    grads = {}
    for variant, model in (("eager", eager), ("compiled", compiled)):
        optimizer = build_optimizer(model, OptimizerConfig(lr=1e-3))
        noise = NoiseKeys(0, batch_size)
        for step in range(steps):
            loss, _ = forward_backward(model, objective, random_batch(batch_size, seq_len, vocab, step), noise, device)
            losses[variant].append(loss)
            if step == 0:
                grads[variant] = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            optimizer_step(model, optimizer)
    loss_rel = max(abs(c - e) / abs(e) for e, c in zip(losses["eager"], losses["compiled"], strict=True))
    grad_rel = float((grads["compiled"] - grads["eager"]).norm() / grads["eager"].norm())
    finite = all(math.isfinite(v) for v in losses["eager"] + losses["compiled"])
    ok = finite and loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL
    why = f"loss rel diff {loss_rel:.3g} (tol {LOSS_RTOL}), grad rel diff {grad_rel:.3g} (tol {GRAD_RTOL})"
    return {
        "ok": ok, "compiled": compile, "max_rel_loss_diff": float(f"{loss_rel:.3g}"),
        "grad_rel_l2_diff": float(f"{grad_rel:.3g}"),
        "losses": {k: [round(v, 5) for v in vs] for k, vs in losses.items()}, **({} if ok else {"why": why}),
    }  # fmt: skip


def check_compile(sz: Sizes, device: torch.device, compile: bool, deadline: float) -> dict[str, Any]:
    """Section 3: mdlm (plain bidirectional mask: SDPA) and bd3lm (block-diffusion mask: FlexAttention)."""
    guard = Guard("compile_vs_eager", sz.budget_s["compile_vs_eager"], deadline, first_estimate_s=5.0)
    cases = []
    for name in ("bd3lm", "mdlm"):  # bd3lm first: FlexAttention inside the compiled blocks
        torch._dynamo.reset()
        cases.append(guard.run(name, functools.partial(compile_case, name, sz, device, compile)))
    batch, seq_len, steps = sz.train
    setup = {"model": sz.train_model, "batch": batch, "seq_len": seq_len, "steps": steps, "autocast": "bfloat16"}
    return guard.result(cases, setup=setup, tolerance={"loss_rtol": LOSS_RTOL, "grad_rtol": GRAD_RTOL})


# --------------------------------------------------------------------------------------------------
# 4. MFU of a ~0.5B model


def peak_bf16(device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from or why there is none)."""
    if device.type != "cuda":
        return None, f"no bf16 peak for device type {device.type}: MFU is null"
    name = torch.cuda.get_device_name(device)
    peak = peak_of(name)
    if peak is not None:
        return peak, f"dllm.training.mfu table for {name!r}"
    extra = next((p for key, p in EXTRA_PEAKS.items() if key.lower() in name.lower()), None)
    if extra is not None:
        return extra, f"gpu_check's table for {name!r}"
    return None, f"{name!r} is in no peak table (A100, H100, H200, B200, L4): MFU is null"


def time_training(model, objective_name: str, seq_len: int, sz: Sizes, device: torch.device, peak) -> dict:
    """Warm-up steps (the first compiles), then timed optimizer steps; FLOPs from the trainer's FlopsMeter."""
    vocab = model.cfg.vocab_size
    batch_size = max(sz.mfu_tokens_per_step // seq_len, 1)
    objective = make_objective(objective_name, vocab)
    optimizer = build_optimizer(model, OptimizerConfig())
    noise = NoiseKeys(0, batch_size)
    meter = FlopsMeter(model.cfg, peak, num_devices=1)
    meter.observe(objective, random_batch(batch_size, seq_len, vocab, 0).to(device), noise)
    warmup, timed = sz.mfu_steps
    t0, warmup_s = time.perf_counter(), 0.0
    step_s, records, losses = [], [], []
    for step in range(warmup + timed):
        batch = random_batch(batch_size, seq_len, vocab, step)
        sync(device)
        start = time.perf_counter()
        loss, head_rows = forward_backward(model, objective, batch, noise, device)
        optimizer_step(model, optimizer)
        sync(device)
        if step == warmup - 1:
            warmup_s = time.perf_counter() - t0
            log(f"mfu: warm-up (compile) {warmup_s:.1f} s")
        if step >= warmup:
            step_s.append(time.perf_counter() - start)
            records.append(meter.measure(batch_size, head_rows, step_s[-1]))
            losses.append(loss)
    median_s = statistics.median(step_s)
    mid = records[min(range(len(step_s)), key=lambda i: abs(step_s[i] - median_s))]  # the median step's record
    return {
        "batch": batch_size, "step_s": round(median_s, 4), "tokens_per_s": round(batch_size * seq_len / median_s, 1),
        "flops_per_token": mid["flops_per_token"], "tflops_per_s": round(mid["flops_per_s"] / 1e12, 2),
        "mfu": mid.get("mfu"), "warmup_s": round(warmup_s, 1), "loss_finite": all(math.isfinite(v) for v in losses),
    }  # fmt: skip


def mfu_case(objective_name: str, seq_len: int, sz: Sizes, device: torch.device, compile: bool, peak) -> dict:
    """One (objective, seq) case; out of memory -> recorded, and retried with full activation checkpointing."""
    oom: list[str] = []
    for checkpointing in ("none", "full"):
        torch._dynamo.reset()  # a static-shape compile per case, as a run of one sequence length gets
        model = None
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            model = build_model(sz.mfu_model, device, compile, checkpointing, init=device.type != "cuda")
            result = time_training(model, objective_name, seq_len, sz, device, peak)
            peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            ok = result["loss_finite"]
            return {"ok": ok, "activation_checkpointing": checkpointing, **result,
                    "max_memory_gib": None if peak_mem is None else round(peak_mem, 1), "oom": oom,
                    **({} if ok else {"why": "loss is not finite"})}  # fmt: skip
        except Exception as err:  # out of memory, also when raised inside a compiled region (wrapped)
            if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err).lower():
                raise
            oom.append(f"activation_checkpointing {checkpointing}: {error_text(err)[:160]}")
            log(f"mfu: out of memory with activation_checkpointing {checkpointing}")
        finally:
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"ok": False, "oom": oom, "why": "out of memory even with full activation checkpointing"}


def check_mfu(sz: Sizes, device: torch.device, compile: bool, deadline: float) -> dict[str, Any]:
    """Section 4: mdlm and bd3lm at each sequence length (shortest first), bf16 autocast."""
    guard = Guard("mfu", sz.budget_s["mfu"], deadline, first_estimate_s=10.0)
    peak, peak_source = peak_bf16(device)
    with torch.device("meta"):
        num_params = Transformer(ModelConfig(**sz.mfu_model)).num_params()
    cases = []
    for seq_len in sz.mfu_seqs:
        for name in ("bd3lm", "mdlm"):
            run = functools.partial(mfu_case, name, seq_len, sz, device, compile, peak)
            cases.append(guard.run(f"{name}/seq{seq_len}", run, kind=name))  # mostly compile time: per objective
    setup = {"model": sz.mfu_model, "num_params": num_params, "tokens_per_step": sz.mfu_tokens_per_step,
             "warmup_steps": sz.mfu_steps[0], "timed_steps": sz.mfu_steps[1], "compiled_blocks": compile,
             "autocast": "bfloat16", "attention_backend": "auto"}  # fmt: skip
    return guard.result(cases, peak_tflops=None if peak is None else peak / 1e12, peak_source=peak_source, setup=setup)


# --------------------------------------------------------------------------------------------------
# 5. sampling with each cache


def sample_prompts(sz: Sizes, vocab: int) -> list[list[int]]:
    batch, shortest, longest, _, _ = sz.sample
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(shortest, longest + 1, (batch,), generator=g).tolist()
    return [torch.randint(0, vocab - 3, (n,), generator=g).tolist() for n in lengths]


def time_sampler(model, prompts, cfg: SamplerConfig, special: SpecialIds, repeats: int, device) -> dict[str, Any]:
    """A warm-up call (compiles FlexAttention for every shape of the schedule), then the fastest of `repeats`."""
    result = generate(model, prompts, cfg, special, generator=torch.Generator().manual_seed(0))
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = generate(model, prompts, cfg, special, generator=torch.Generator().manual_seed(0))
        sync(device)
        best = min(best, time.perf_counter() - start)
    tokens = len(prompts) * cfg.gen_length
    return {"sequences": result.sequences, "s": best, "tokens_per_s": round(tokens / best, 1), "nfe": result.nfe}


def sampler_cfg(sz: Sizes, attention: str, cache: str) -> SamplerConfig:
    _, _, _, gen_length, block = sz.sample
    return SamplerConfig(gen_length=gen_length, block_length=block, steps=gen_length // 2, cache=cache,
                         attention=attention, shift="off", stop_at_eos=False)  # fmt: skip


def exact_block_cache(sz: Sizes, device: torch.device, dtype: torch.dtype, backend: str) -> bool:
    """Whether the block cache decodes the same greedy tokens as no cache on a peaked random model."""
    fields = {**sz.sample_model, "init_std": 0.2, "attention_backend": backend}
    model = build_model(fields, device, compile=False).to(dtype).eval()
    vocab = fields["vocab_size"]
    prompts, special = sample_prompts(sz, vocab), special_ids(vocab)
    runs = [generate(model, prompts, sampler_cfg(sz, "block", c), special).sequences for c in ("none", "block")]
    return runs[0] == runs[1]


def special_ids(vocab: int) -> SpecialIds:
    ids = ids_for(vocab)
    return SpecialIds(mask_id=ids.mask_id, pad_id=ids.pad_id, eos_id=ids.eos_id, num_tokens=vocab)


def check_sampling(sz: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """Section 5: each cache's tokens/s and NFE against no cache; the exact block cache's tokens."""
    guard = Guard("sampling", sz.budget_s["sampling"], deadline, first_estimate_s=5.0)
    torch._dynamo.reset()  # compiled FlexAttention starts afresh: its recompile count here is sampling's own
    vocab = sz.sample_model["vocab_size"]
    model = build_model(sz.sample_model, device, compile=False).eval()
    prompts, special = sample_prompts(sz, vocab), special_ids(vocab)
    cases, runs = [], {}
    for attention, caches in (("bidirectional", ("none", "prefix", "dual")), ("block", ("none", "block"))):
        for cache in caches:
            cfg = sampler_cfg(sz, attention, cache)
            run = functools.partial(cache_case, model, prompts, cfg, special, sz.sample_repeats, device, runs)
            cases.append(guard.run(f"{attention}/{cache}", run))
    for dtype, backend in ((torch.float32, "auto"), (torch.float64, "sdpa")):
        name = f"block/exact_{str(dtype).removeprefix('torch.')}_{backend}"
        cases.append(guard.run(name, functools.partial(exact_case, sz, device, dtype, backend)))
    _, _, _, gen_length, block = sz.sample
    setup = {"model": sz.sample_model, "batch": len(prompts), "prompt_lengths": [len(p) for p in prompts],
             "gen_length": gen_length, "block_length": block, "steps": gen_length // 2,
             "policy": "low_confidence"}  # fmt: skip
    return guard.result(cases, setup=setup)


def cache_case(model, prompts, cfg: SamplerConfig, special, repeats: int, device, runs: dict) -> dict[str, Any]:
    """One cache's timing; against the same attention's uncached run (timed first): speed-up and agreement."""
    run = runs[(cfg.attention, cfg.cache)] = time_sampler(model, prompts, cfg, special, repeats, device)
    none = runs.get((cfg.attention, "none"))
    speedup = None if none is None else round(run["tokens_per_s"] / none["tokens_per_s"], 3)
    agree = None if none is None else agreement(run["sequences"], none["sequences"])
    return {"ok": True, "tokens_per_s": run["tokens_per_s"], "nfe": run["nfe"], "speedup_vs_none": speedup,
            "agreement_vs_none": agree}  # fmt: skip


def exact_case(sz: Sizes, device: torch.device, dtype: torch.dtype, backend: str) -> dict[str, Any]:
    same = exact_block_cache(sz, device, dtype, backend)
    return {"ok": same, **({} if same else {"why": f"block cache tokens differ from no cache ({dtype}, {backend})"})}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return round(sum(x == y for x, y in pairs) / max(len(pairs), 1), 4)


# --------------------------------------------------------------------------------------------------
# 6. flash-linear-attention's gated delta rule vs the torch form


def check_delta_rule(sz: Sizes, device: torch.device, deadline: float) -> dict[str, Any]:
    """Section 6: tests/gpu/test_fla.py's comparisons, each case's largest differences recorded; not run without
    CUDA or the fla package."""
    from dllm.models.fla_rule import load_kernel

    guard = Guard("delta_rule", sz.budget_s["delta_rule"], deadline, first_estimate_s=5.0)
    if device.type != "cuda" or load_kernel() is None:
        why = "needs CUDA" if device.type != "cuda" else "the fla package is not installed"
        return guard.result([guard.skip("fla_vs_torch", f"skipped: {why}")])
    if str(ROOT) not in sys.path:  # tests.gpu from a checkout (the script's own folder is bench/)
        sys.path.insert(0, str(ROOT))
    from tests.gpu import test_fla

    cases = []
    for B, H, L, K, V in sz.delta_rule:
        for state in (False, True):
            run = functools.partial(test_fla.compare_rule, B, H, L, K, V, state)
            cases.append(guard.run(f"rule/B{B}_H{H}_L{L}_K{K}_V{V}{'_state' if state else ''}", run))
    cases.append(guard.run("qwen3_5_bf16_logits", test_fla.compare_model))
    return guard.result(cases, tolerance={"atol": test_fla.ATOL, "rtol": test_fla.RTOL})


# --------------------------------------------------------------------------------------------------
# the run


class Report:
    """The JSON line: filled section by section; the watchdog can print it at any moment."""

    def __init__(self, device: torch.device, mode: str, compile: bool) -> None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.head = {"bench": "gpu_check", "mode": mode, "device": name, "torch": torch.__version__,
                     "cuda": torch.version.cuda, "compile": compile}  # fmt: skip
        self.sections: dict[str, Any] = {}
        self.wall_s: dict[str, float] = {}
        self.started = time.monotonic()
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None  # pytest, while it runs

    def add(self, name: str, result: dict[str, Any], wall_s: float) -> None:
        with self.lock:
            self.sections[name], self.wall_s[name] = result, round(wall_s, 1)

    def line(self, aborted: str | None = None) -> str:
        with self.lock:
            failures = [f"{n}: {f}" for n, s in self.sections.items() for f in s.get("failures", [])]
            not_run = [f"{n}: {c}" for n, s in self.sections.items() for c in s.get("not_run", [])]
            if aborted:
                failures.append(aborted)
            wall = {**self.wall_s, "total": round(time.monotonic() - self.started, 1)}
            out = {**self.head, "ok": not failures, "failures": failures, "not_run": not_run, "wall_s": wall,
                   "sections": self.sections}  # fmt: skip
            return json.dumps(out, default=str)


def run_sections(args, sz: Sizes, device: torch.device, report: Report, deadline: float) -> None:
    """pytest starts first and runs beside the two numeric checks; the timed sections wait for it."""
    compile = not args.no_compile
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    proc, t_pytest = None, time.monotonic()
    if "pytest" in args.sections:
        log("pytest tests/gpu started in the background")
        proc = start_pytest(work / "junit.xml", work / "pytest.log")
        report.proc = proc  # the watchdog kills it
    workers = sz.flex_workers if args.flex_workers is None else args.flex_workers
    numeric = (("flex_vs_sdpa", lambda: check_flex(sz, device, compile, deadline, workers)),
               ("compile_vs_eager", lambda: check_compile(sz, device, compile, deadline)),
               ("delta_rule", lambda: check_delta_rule(sz, device, deadline)))  # fmt: skip
    timed = (("mfu", lambda: check_mfu(sz, device, compile, deadline)),
             ("sampling", lambda: check_sampling(sz, device, deadline)))  # fmt: skip
    for name, section in numeric:
        if name in args.sections:
            t0 = time.monotonic()
            report.add(name, section(), time.monotonic() - t0)
    if proc is not None:
        log("waiting for pytest")
        end = min(t_pytest + sz.budget_s["pytest"], deadline)
        result = finish_pytest(proc, end, work / "junit.xml", work / "pytest.log")
        report.add("pytest", result, time.monotonic() - t_pytest)
    for name, section in timed:
        if name in args.sections:
            t0 = time.monotonic()
            report.add(name, section(), time.monotonic() - t0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=370.0, help="seconds of work (a watchdog stops at +90 s)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--flex-workers", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def start_watchdog(report: Report, seconds: float, out_fd: int) -> threading.Timer:
    """Past `seconds`, print the JSON line with what has been measured, kill pytest, exit 1."""

    def fire() -> None:
        proc = report.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.write(out_fd, (report.line(aborted=f"watchdog: stopped after {seconds:.0f} s") + "\n").encode())
        os._exit(1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check")
        return 0
    device = torch.device(args.device)
    sz = TINY if args.tiny else GPU
    report = Report(device, "tiny" if args.tiny else "full", compile=not args.no_compile)
    out_fd = os.dup(1)
    os.dup2(2, 1)  # anything the libraries print goes to stderr: stdout holds the JSON line only
    try:
        watchdog = start_watchdog(report, args.budget_s + WATCHDOG_GRACE_S, out_fd)
        run_sections(args, sz, device, report, time.monotonic() + args.budget_s)
        watchdog.cancel()
        line = report.line()
        os.write(out_fd, (line + "\n").encode())
    finally:
        os.dup2(out_fd, 1)
        os.close(out_fd)
    return 0 if json.loads(line)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
