"""`dllm generate`: sample from a trained run, a checkpoint or a model folder; JSONL or text out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from dllm.cli.common import (
    MODEL_HELP,
    QUIET_OPTION,
    THREADS_OPTION,
    apply_threads,
    check_output_file,
    finite,
    info,
    out,
    seed_option,
    warn,
    write_lines,
)
from dllm.cli.sampling_common import (
    AR_OPTION,
    DRAFT_BLOCK_SIZE_OPTION,
    DTYPE_OPTION,
    SAMPLER_CONFIG_OPTION,
    SET_OPTION,
    counters_summary,
    decode_batches,
    denoise_summary,
    setup_sampling,
)
from dllm.errors import ConfigError, DataError
from dllm.text import valid_text

COMPLETION_MARKER = ">> "
"""Text output: each prompt, then its completion on the next line after this marker (--json keeps them apart)."""


def _read_prompts(prompt: list[str] | None, prompts_file: Path | None) -> list[str]:
    prompts = list(prompt or [])
    if prompts_file is not None:
        if not prompts_file.is_file():
            raise DataError(f"--prompts-file: {prompts_file} does not exist")
        from dllm.data.prepare.sources import jsonl_records

        for rec in jsonl_records(prompts_file):
            if not isinstance(rec.data.get("prompt"), str):
                raise DataError(f'{rec.where}: expected {{"prompt": "..."}}')
            prompts.append(rec.data["prompt"])
    if not prompts:
        raise ConfigError("give at least one --prompt TEXT or --prompts-file FILE.jsonl")
    return [valid_text(p) for p in prompts]  # bytes an argument held that are not UTF-8: U+FFFD


def generate(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder (step_XXXXXXXX)."),
    model: str = typer.Option(None, "--model", help=MODEL_HELP),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    prompts_file: Path = typer.Option(None, "--prompts-file", help='JSONL with {"prompt": ...} per line.'),
    chat: bool = typer.Option(False, "--chat", help="Wrap each prompt as a user turn in the chat template."),
    sampler_config: Path = SAMPLER_CONFIG_OPTION,
    overrides: list[str] = SET_OPTION,
    gen_length: int = typer.Option(None, "--gen-length", "--max-new-tokens", help="Tokens to generate."),
    block_length: int = typer.Option(None, "--block-length", help="Semi-autoregressive block length."),
    steps: int = typer.Option(None, "--steps", help="Step budget over all blocks."),
    policy: str = typer.Option(None, "--policy", help="low_confidence, random, margin, entropy, threshold, ..."),
    cache: str = typer.Option(None, "--cache", help="none, prefix, dual (bidirectional) or block (block models)."),
    temperature: float = typer.Option(None, "--temperature", callback=finite, help="0 = greedy."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts decoded together."),
    seed: int = seed_option(None, "Sampling seed."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = DTYPE_OPTION,
    compile_model: bool = typer.Option(
        False, "--compile", help="Compile the model's blocks with torch.compile (pays off for many prompts, GPUs)."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Write JSONL here instead of stdout."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per prompt on stdout."),
    ar: bool = AR_OPTION,
    draft: str = typer.Option(
        None, "--draft", help="Speculative decoding of a causal target with this drafter (a folder or hub id)."
    ),
    draft_block_size: int = DRAFT_BLOCK_SIZE_OPTION,
    threads: str = THREADS_OPTION,
    quiet: bool = QUIET_OPTION,
) -> None:
    """Generate continuations of prompts with any sampler configuration."""
    import torch

    from dllm.training.progress import CountBar

    if batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    flags = {"gen_length": gen_length, "block_length": block_length, "steps": steps, "policy": policy,
             "cache": cache, "temperature": temperature, "seed": seed,
             "stop_strings": [valid_text(s) for s in stop] if stop else None,
             "compile": compile_model or None}  # fmt: skip
    if ar or draft is not None:
        diffusion = ("block_length", "steps", "policy", "cache", "compile")
        ignored = [f"--{k.replace('_', '-')}" for k in diffusion if flags.pop(k) is not None]
        if ignored:
            warn(f"{', '.join(ignored)}: no effect on causal decoding (--ar / --draft)")
        flags["generation"] = "causal"
    texts = _read_prompts(prompt, prompts_file)
    reads = [("--prompts-file", prompts_file), ("--sampler-config", sampler_config), ("--run", run),
             ("--checkpoint", checkpoint), ("--model", model), ("--draft", draft)]  # fmt: skip
    check_output_file(output, reads=reads)
    option = "--draft" if draft is not None else "--ar"
    apply_threads(threads)
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags, draft=draft,
                       draft_block_size=draft_block_size, causal_option=option, dtype=dtype)  # fmt: skip
    tok, cfg = s.loaded.tokenizer, s.sampler
    gen = torch.Generator(device=s.device).manual_seed(cfg.seed)
    with CountBar("prompts", len(texts), enabled=not quiet and len(texts) > batch_size) as bar:
        done = decode_batches(s, texts, lambda text: _encode(tok, text, chat), batch_size, gen, bar.advance)
    if chat:  # the exchange as chat turns: `data prepare` (prompt_completion, chat.prompt / chat.completion) reads it
        for r in done.records:
            r["chat"] = {"prompt": [{"role": "user", "content": r["prompt"]}],
                         "completion": [{"role": "assistant", "content": r["completion"]}]}  # fmt: skip
    _write_records(done.records, output, as_json)
    info(f"{s.loaded.source}: {len(texts)} prompt(s), {_how(s)}, "
         f"{counters_summary(cfg, done.total, s.drafter is not None)}, {done.elapsed_s:.2f}s")  # fmt: skip


def _how(s) -> str:
    """How the prompts were decoded, for the summary line."""
    cfg = s.sampler
    if cfg.generation == "causal":
        return "ar (KV cache)" if s.drafter is None else f"speculative (block {s.drafter.block_size})"
    return {"edit_flow": "edit_flow/tau_leaping", "canvas_denoise": denoise_summary(cfg)}.get(
        cfg.generation, f"{cfg.policy}/{cfg.cache}/{cfg.attention}"
    )


def _write_records(records: list[dict[str, Any]], output: Path | None, as_json: bool) -> None:
    lines = [json.dumps(r) for r in records]
    if output is not None:
        write_lines(output, lines)
    elif as_json:
        for line in lines:
            out(line)
    else:
        for i, r in enumerate(records):
            if i:
                out()  # a blank line between two exchanges
            out(r["prompt"])
            out(COMPLETION_MARKER + r["completion"].lstrip())


def _encode(tok: Any, text: str, chat: bool) -> list[int]:
    if not chat:
        return tok.encode(text)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).ids
