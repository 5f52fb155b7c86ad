"""`dllm generate`: sample from a trained run, a checkpoint or a model folder; JSONL or text out."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer

from dllm.cli.common import info, out
from dllm.cli.sampling_common import SAMPLER_CONFIG_OPTION, SET_OPTION, setup_sampling
from dllm.errors import ConfigError, DataError
from dllm.sampling.stops import cut_at_stop, stop_function


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
    return prompts


def _check_output(output: Path | None) -> None:
    """A file that can be written, checked before a model is loaded or a token sampled."""
    if output is None:
        return
    if output.is_dir():
        raise ConfigError(f"--output: {output} is a folder; give a file, e.g. {output / 'samples.jsonl'}")
    parent = output.absolute().parent
    if not parent.exists():
        raise ConfigError(f"--output: the folder {parent} does not exist; create it first")
    if not parent.is_dir():
        raise ConfigError(f"--output: {parent} is not a folder; choose another output file")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--output: cannot write in {parent} (permission denied); choose another output file")


def generate(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder (step_XXXXXXXX)."),
    model: Path = typer.Option(None, "--model", help="A Hugging Face or `dllm convert` model folder."),
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
    temperature: float = typer.Option(None, "--temperature", help="0 = greedy."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts decoded together."),
    seed: int = typer.Option(None, "--seed", help="Sampling seed."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    compile_model: bool = typer.Option(
        False, "--compile", help="Compile the model's blocks with torch.compile (pays off for many prompts, GPUs)."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Write JSONL here instead of stdout."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per prompt on stdout."),
) -> None:
    """Generate continuations of prompts with any sampler configuration."""
    import torch

    from dllm.sampling.generate import generate as sample

    if batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    flags = {"gen_length": gen_length, "block_length": block_length, "steps": steps, "policy": policy,
             "cache": cache, "temperature": temperature, "seed": seed, "stop_strings": stop or None,
             "compile": compile_model or None}  # fmt: skip
    texts = _read_prompts(prompt, prompts_file)
    _check_output(output)
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags)
    tok, cfg = s.loaded.tokenizer, s.cfg

    def encode(text: str) -> list[int]:
        if not chat:
            return tok.encode(text)
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).ids

    stop_fn = stop_function(tok, cfg.stop_strings)
    gen = torch.Generator(device=s.device).manual_seed(cfg.seed)
    records, total_nfe, total_tokens = [], 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        tb = time.perf_counter()
        result = sample(s.loaded.model, [encode(t) for t in chunk], cfg, s.special, generator=gen, stop=stop_fn)
        wall = time.perf_counter() - tb
        counters = result.counters.as_dict()
        total_nfe += result.nfe
        total_tokens += result.tokens_committed
        for text, ids in zip(chunk, result.sequences, strict=True):
            completion = cut_at_stop(tok.decode(ids), cfg.stop_strings)
            records.append({"prompt": text, "completion": completion, "batch_wall_s": round(wall, 4), **counters})
    elapsed = time.perf_counter() - t0
    lines = [json.dumps(r) for r in records]
    if output is not None:
        tmp = output.with_name(output.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        tmp.replace(output)  # never a half-written file
    elif as_json:
        for line in lines:
            out(line)
    else:
        for r in records:
            out(f"{r['prompt']}{r['completion']}")
    info(
        f"{s.loaded.source}: {len(texts)} prompt(s), {cfg.policy}/{cfg.cache}/{cfg.attention}, NFE {total_nfe}, "
        f"{total_tokens / max(total_nfe, 1):.2f} tokens/forward, {elapsed:.2f}s"
    )
