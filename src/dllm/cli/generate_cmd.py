"""`dllm generate`: sample from a trained run or checkpoint."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from dllm.cli.common import info, out
from dllm.errors import ConfigError, DataError


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


def generate(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder (step_XXXXXXXX)."),
    model: Path = typer.Option(None, "--model", help="A Hugging Face or `dllm convert` model folder."),
    prompt: list[str] = typer.Option(None, "--prompt", "-p", help="Prompt text (repeatable)."),
    prompts_file: Path = typer.Option(None, "--prompts-file", help='JSONL with {"prompt": ...} per line.'),
    gen_length: int = typer.Option(32, "--gen-length", help="Tokens to generate."),
    block_length: int = typer.Option(32, "--block-length", help="Semi-autoregressive block length."),
    steps: int = typer.Option(32, "--steps", help="Model calls over all blocks."),
    policy: str = typer.Option("low_confidence", "--policy", help="low_confidence or random."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per prompt."),
) -> None:
    """Generate continuations of prompts with the masked-diffusion sampler."""
    import torch

    from dllm.checkpoint.inference import load_for_inference
    from dllm.config.loading import validate_config
    from dllm.config.spec import SamplerConfig
    from dllm.sampling.generate import SpecialIds
    from dllm.sampling.generate import generate as sample

    values = {
        "gen_length": gen_length,
        "block_length": block_length,
        "steps": steps,
        "policy": policy,
        "temperature": temperature,
        "seed": seed,
    }
    cfg = validate_config(SamplerConfig, values, source="generate options", base_dir=None)
    texts = _read_prompts(prompt, prompts_file)
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: {device!r} is not available here; use cpu")
    loaded = load_for_inference(run, checkpoint, torch.device(device), model_dir=model)
    tok = loaded.tokenizer
    special = SpecialIds(mask_id=tok.mask_id, pad_id=tok.pad_id, eos_id=tok.eos_id)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    t0 = time.perf_counter()
    result = sample(loaded.model, [tok.encode(t) for t in texts], cfg, special, generator=gen)
    elapsed = time.perf_counter() - t0
    for text, ids in zip(texts, result.sequences, strict=True):
        completion = tok.decode(ids)
        if as_json:
            out(json.dumps({"prompt": text, "completion": completion, "nfe": result.nfe}))
        else:
            out(f"{text}{completion}")
    info(
        f"{loaded.source}: {len(texts)} prompt(s), NFE {result.nfe}, "
        f"{result.tokens_per_forward:.2f} tokens/forward, {elapsed:.2f}s"
    )
