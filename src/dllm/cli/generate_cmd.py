"""`dllm generate`: sample from a trained run, a checkpoint or a model folder; JSONL or text out."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import typer

from dllm.cli.common import MODEL_HELP, info, model_folder, out, warn
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
    ar: bool = typer.Option(
        False, "--ar", help="Decode a causal model (an ar run, an imported llama/qwen folder) with a KV cache."
    ),
    draft: str = typer.Option(
        None, "--draft", help="Speculative decoding of a causal target with this drafter (a folder or hub id)."
    ),
    draft_block_size: int = typer.Option(None, "--draft-block-size", help="The drafter's block size (checked)."),
) -> None:
    """Generate continuations of prompts with any sampler configuration."""
    import torch

    from dllm.sampling.generate import generate as sample

    if batch_size < 1:
        raise ConfigError("--batch-size must be >= 1")
    if draft_block_size is not None and draft is None:
        raise ConfigError("--draft-block-size applies to speculative decoding; give --draft DRAFTER_FOLDER too")
    if ar or draft is not None:
        diffusion = {"--block-length": block_length, "--steps": steps, "--policy": policy, "--cache": cache,
                     "--compile": compile_model or None}  # fmt: skip
        ignored = [k for k, v in diffusion.items() if v is not None]
        if ignored:
            warn(f"{', '.join(ignored)}: no effect on causal decoding (--ar / --draft)")
        flags = {"gen_length": gen_length, "temperature": temperature, "seed": seed, "stop_strings": stop or None}
        texts = _read_prompts(prompt, prompts_file)
        _check_output(output)
        s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags, causal=True)
        _decode_causal(s, texts, chat, batch_size, draft, draft_block_size, output, as_json)
        return
    flags = {"gen_length": gen_length, "block_length": block_length, "steps": steps, "policy": policy,
             "cache": cache, "temperature": temperature, "seed": seed, "stop_strings": stop or None,
             "compile": compile_model or None}  # fmt: skip
    texts = _read_prompts(prompt, prompts_file)
    _check_output(output)
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags)
    tok, cfg = s.loaded.tokenizer, s.cfg

    stop_fn = stop_function(tok, cfg.stop_strings)
    gen = torch.Generator(device=s.device).manual_seed(cfg.seed)
    records, total_nfe, total_tokens = [], 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        tb = time.perf_counter()
        prompt_ids = [_encode(tok, t, chat) for t in chunk]
        result = sample(s.loaded.model, prompt_ids, cfg, s.special, generator=gen, stop=stop_fn)
        wall = time.perf_counter() - tb
        counters = result.counters.as_dict()
        total_nfe += result.nfe
        total_tokens += result.tokens_committed
        for text, ids in zip(chunk, result.sequences, strict=True):
            completion = cut_at_stop(tok.decode(ids), cfg.stop_strings)
            records.append({"prompt": text, "completion": completion, "batch_wall_s": round(wall, 4), **counters})
    elapsed = time.perf_counter() - t0
    _write_records(records, output, as_json)
    how = "edit_flow/tau_leaping" if cfg.generation == "edit_flow" else f"{cfg.policy}/{cfg.cache}/{cfg.attention}"
    info(
        f"{s.loaded.source}: {len(texts)} prompt(s), {how}, NFE {total_nfe}, "
        f"{total_tokens / max(total_nfe, 1):.2f} tokens/forward, {elapsed:.2f}s"
    )


def _write_records(records: list[dict[str, Any]], output: Path | None, as_json: bool) -> None:
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


def _decode_causal(s, texts: list[str], chat: bool, batch_size: int, draft: str | None,
                   draft_block_size: int | None, output: Path | None, as_json: bool) -> None:  # fmt: skip
    """`--ar` / `--draft`: AR decoding with the KV cache, or speculative decoding with a drafter, of a
    causal target (its decode profile says attention causal, or it is an AR family folder never trained
    here); the sampler's gen_length, temperature, top_k, top_p, EOS, stop strings and seed apply."""
    import torch

    from dllm.sampling.ar import DecodeCounters, Decoding, ar_generate, is_causal_model
    from dllm.sampling.speculative import check_drafter, load_drafter, speculative_generate

    loaded, cfg, profile = s.loaded, s.cfg, s.loaded.profile
    flag = "--draft" if draft is not None else "--ar"
    if not is_causal_model(profile, loaded.model_cfg.family):
        trained = f"trained with {profile.objective}" if profile.objective else f"a {loaded.model_cfg.family} model"
        raise ConfigError(
            f"{flag}: {loaded.source} is not a causal model ({trained}, attention {profile.attention} in its "
            f"decode profile); causal decoding needs an ar run or an AR family folder; drop {flag} to sample it"
        )
    drafter = None
    if draft is not None:
        drafter = load_drafter(model_folder(draft, "--draft"), loaded.model, loaded)
        check_drafter(drafter, loaded.model, draft_block_size)
    tok = loaded.tokenizer
    decoding = Decoding(max_new_tokens=cfg.gen_length, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        eos_id=profile.eos_id if cfg.stop_at_eos else None)  # fmt: skip
    stop_fn = stop_function(tok, cfg.stop_strings)
    gen = torch.Generator(device=s.device).manual_seed(cfg.seed)
    total, records = DecodeCounters(), []
    t0 = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        ids = [_encode(tok, t, chat) for t in chunk]
        tb = time.perf_counter()
        kw: dict[str, Any] = {"mask_id": profile.mask_id, "generator": gen, "stop": stop_fn}
        if drafter is None:
            result = ar_generate(loaded.model, ids, decoding, **kw)
        else:
            result = speculative_generate(loaded.model, drafter, ids, decoding, **kw)
        wall = time.perf_counter() - tb
        counters = result.counters.as_dict()
        for k in ("target_forwards", "tokens", "rounds", "drafted", "accepted"):
            setattr(total, k, getattr(total, k) + getattr(result.counters, k))
        for text, seq in zip(chunk, result.sequences, strict=True):
            completion = cut_at_stop(tok.decode(seq), cfg.stop_strings)
            records.append({"prompt": text, "completion": completion, "batch_wall_s": round(wall, 4), **counters})
    elapsed = time.perf_counter() - t0
    _write_records(records, output, as_json)
    c = total.as_dict()
    mode = "ar (KV cache)" if drafter is None else f"speculative (block {drafter.block_size})"
    info(
        f"{loaded.source}: {len(texts)} prompt(s), {mode}, {c['target_forwards']} target forwards, "
        f"{c['forwards_per_token']:.3f} target forwards/token, tau {c['tau']:.2f}, "
        f"acceptance {c['acceptance_rate']:.2f}, {elapsed:.2f}s"
    )


def _encode(tok: Any, text: str, chat: bool) -> list[int]:
    if not chat:
        return tok.encode(text)
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).ids
