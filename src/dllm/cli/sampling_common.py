"""What `dllm generate`, `chat`, `eval` and `serve` share: the sampler config from a file, flags and
overrides, the model loaded and checked for it (`inference.assembly.setup_sampling`), and the batch
loop over prompts. The stop-string helpers live in `dllm.sampling.stops`."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from dllm.cli.common import model_folder, warn
from dllm.errors import ConfigError

if TYPE_CHECKING:  # torch and the model stack load with the command, not with the CLI
    from dllm.config.profile import DecodeProfile
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.assembly import SamplingSetup
    from dllm.sampling.results import Counters

SAMPLER_CONFIG_OPTION = typer.Option(None, "--sampler-config", help="YAML file of sampler settings (SamplerConfig).")
SET_OPTION = typer.Option(
    None,
    "--set",
    help="Override a sampler field: --set cache=dual, --set denoise_entropy_bound=0.2 (DiffusionGemma) (repeatable).",
)
DRAFT_BLOCK_SIZE_OPTION = typer.Option(
    None, "--draft-block-size", help="Verify blocks of this size: 2 to the drafter's own (default its own)."
)


AR_OPTION = typer.Option(
    False,
    "--ar",
    help="Decode causally with a KV cache (explicit: a causal model, an ar run or an imported llama/qwen folder, "
    "decodes so without it).",
)
"""`--ar` of generate, chat, eval tasks and serve."""

DTYPE_OPTION = typer.Option(
    "float32",
    "--dtype",
    help="Weights, compute and KV caches of decoding: float32 or bfloat16 (logits are compared and sampled in "
    "float32 either way; bf16 pays off on CPUs with native bf16, see dllm doctor).",
)
DECODE_DTYPES = ("float32", "bfloat16")


def decode_dtype(name: str, device: str) -> Any:
    """The torch dtype of `--dtype NAME` (float32 or bfloat16); on a CPU that computes bf16 without native
    instructions (cpuinfo.py) bfloat16 is allowed with a warning: it is usually slower than float32 there."""
    import torch

    if name not in DECODE_DTYPES:
        raise ConfigError(f"--dtype: {name!r} is not a decoding dtype; use {' or '.join(DECODE_DTYPES)}")
    if name == "bfloat16" and device == "cpu":
        from dllm.cpuinfo import bf16_support, read_cpuinfo

        if bf16_support(read_cpuinfo()).native is False:
            warn("--dtype bfloat16: this CPU has no native bf16 (dllm doctor); bf16 is emulated here and usually "
                 "slower than float32")  # fmt: skip
    return getattr(torch, name)


def sampler_values(flags: dict[str, Any]) -> dict[str, Any]:
    """The flags the user gave (None means not given)."""
    return {k: v for k, v in flags.items() if v is not None}


def setup_sampling(
    run: Path | None,
    checkpoint: Path | None,
    model: str | None,
    device: str,
    sampler_config: Path | None,
    overrides: list[str] | None,
    flags: dict[str, Any],
    *,
    draft: str | None = None,
    draft_block_size: int | None = None,
    causal_option: str = "--ar",
    dtype: str = "float32",
) -> SamplingSetup:
    """Build the sampler (file < flags < --set), load the model in `dtype` (--dtype) and resolve the sampler
    against it. `model` and `draft` are folders or hub ids (cli.common.model_folder)."""
    if draft_block_size is not None and draft is None:
        raise ConfigError("--draft-block-size applies to speculative decoding; give --draft DRAFTER_FOLDER too")
    import torch

    from dllm.config.loading import apply_overrides, read_yaml, validate_config
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.assembly import setup_sampling as load_and_resolve

    data: dict[str, Any] = {}
    source, node = "sampler options", None
    if sampler_config is not None:
        if not Path(sampler_config).is_file():
            raise ConfigError(f"--sampler-config: {sampler_config} does not exist")
        data, node = read_yaml(Path(sampler_config))
        source = str(sampler_config)
        if not isinstance(data, dict):
            raise ConfigError(f"{sampler_config}: expected a mapping of sampler fields")
    data = {**data, **sampler_values(flags)}
    data = apply_overrides(data, list(overrides or []))
    cfg = validate_config(SamplerConfig, data, source=source, base_dir=None, node=node, overrides=list(overrides or []))
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: {device!r} is not available here; use cpu")
    torch_dtype = decode_dtype(dtype, device)
    drafter_dir = model_folder(draft, "--draft") if draft is not None else None
    return load_and_resolve(cfg, torch.device(device), run=run, checkpoint=checkpoint, model_dir=model_folder(model),
                            drafter_dir=drafter_dir, draft_block_size=draft_block_size,
                            causal_option=causal_option, dtype=torch_dtype)  # fmt: skip


def denoise_summary(cfg: SamplerConfig) -> str:
    """How a DiffusionGemma model decodes (generation canvas_denoise), for the commands' summary lines."""
    steps = cfg.total_steps // cfg.num_blocks
    return (f"canvas_denoise/canvas {cfg.block}/{steps} steps a canvas/entropy bound {cfg.denoise_entropy_bound}/"
            f"cache {'clean rows' if cfg.denoise_cache else 'none'}")  # fmt: skip


COUNTERS_EPILOG = (
    "Counters on stderr: NFE, the model's forward passes; tokens/forward, tokens decided per forward (diffusion "
    "decides several at once); AR decoding (--ar, an ar run) counts one forward per token; with a drafter (--draft), "
    "tau is the tokens a verify forward keeps (accepted drafts + 1) and acceptance the share of drafted tokens the "
    "model accepted."
)
"""The glossary of `counters_summary`'s words (the epilog of `dllm generate --help` and `dllm chat --help`)."""


def counters_summary(sampler: SamplerConfig, counters: Counters, speculative: bool) -> str:
    """What a decoding cost, in the counters that mean something for its loop (COUNTERS_EPILOG): AR decoding
    its forwards (one per token), speculative decoding its rates, a diffusion sampler NFE and tokens/forward."""
    c = counters.as_dict()
    if sampler.generation == "causal" and not speculative:
        return f"{c['nfe']} forwards for {c['tokens_committed']} tokens"
    if sampler.generation == "causal":
        return (f"{c['nfe']} target forwards, {c['forwards_per_token']:.3f} target forwards/token, tau {c['tau']:.2f}, "
                f"acceptance {c['acceptance_rate']:.2f}")  # fmt: skip
    return f"NFE {c['nfe']}, {c['tokens_per_forward']:.2f} tokens/forward"


def check_prompt_lengths(prompts_ids: list[list[int]], cfg: SamplerConfig, profile: DecodeProfile,
                         what: str = "prompt {n}", fix: str = "shorten the prompt") -> None:  # fmt: skip
    """Refuse, before anything is decoded, a prompt whose tokens plus `gen_length` exceed the positions the model
    covers (its decode profile's max_length): past them decoding runs on positions it never saw (RoPE) or has no
    row for (a learned table), as slow as it is meaningless. The server refuses the same request. `what` names
    prompt number `{n}`."""
    for i, ids in enumerate(prompts_ids):
        if len(ids) + cfg.gen_length > profile.max_length:
            raise ConfigError(
                f"{what.format(n=i + 1)}: {len(ids)} tokens plus gen_length {cfg.gen_length} exceed the "
                f"{profile.max_length} positions the model covers; {fix} or lower --gen-length"
            )


@dataclass
class Decoded:
    """The outputs of `decode_batches`: a record per prompt, the counters summed over the batches, the wall time."""

    total: Counters
    records: list[dict[str, Any]] = field(default_factory=list)
    elapsed_s: float = 0.0


def decode_batches(s: SamplingSetup, prompts: list[str], encode: Callable[[str], list[int]], batch_size: int,
                   generator: Any, progress: Callable[[int, str], None] | None = None) -> Decoded:  # fmt: skip
    """Decode `prompts` `batch_size` at a time with the setup's sampler (and drafter): per prompt a record
    {prompt, completion (cut at the stop strings), batch_wall_s, the batch's counters}. `progress` gets the
    prompts of each batch done and a note (tokens so far, tokens/s), e.g. a CountBar's `advance`."""
    from dllm.inference.engine import generate
    from dllm.sampling.results import Counters
    from dllm.sampling.stops import cut_at_stop, stop_function

    tok, cfg = s.loaded.tokenizer, s.sampler
    stop_fn = stop_function(tok, cfg.stop_strings)
    out = Decoded(Counters())
    t0 = time.perf_counter()
    prompts_ids = [encode(t) for t in prompts]
    check_prompt_lengths(prompts_ids, cfg, s.loaded.profile)
    for i in range(0, len(prompts), batch_size):
        chunk, ids = prompts[i : i + batch_size], prompts_ids[i : i + batch_size]
        tb = time.perf_counter()
        result = generate(s.loaded.model, ids, cfg, s.special, generator=generator, stop=stop_fn, drafter=s.drafter)
        wall = time.perf_counter() - tb
        counters = result.counters.as_dict()
        out.total.add(result.counters)
        for text, seq in zip(chunk, result.sequences, strict=True):
            completion = cut_at_stop(tok.decode(seq), cfg.stop_strings)
            out.records.append({"prompt": text, "completion": completion, "batch_wall_s": round(wall, 4), **counters})
        if progress is not None:
            elapsed = time.perf_counter() - t0
            progress(len(chunk), f"{out.total.tokens_committed} tokens, {elapsed:.0f}s "
                     f"({out.total.tokens_committed / elapsed:.1f} tokens/s)")  # fmt: skip
    out.elapsed_s = time.perf_counter() - t0
    return out
