"""`dllm chat`: an interactive conversation through the tokenizer's chat template, optionally showing
the canvas being unmasked live."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from dllm.cli.common import MODEL_HELP, THREADS_OPTION, apply_threads, finite, info, out
from dllm.cli.sampling_common import (
    AR_OPTION,
    DTYPE_OPTION,
    SAMPLER_CONFIG_OPTION,
    SET_OPTION,
    check_prompt_lengths,
    counters_summary,
    denoise_summary,
    setup_sampling,
)
from dllm.sampling.stops import cut_at_stop, stop_function
from dllm.text import valid_text

if TYPE_CHECKING:
    from dllm.inference.assembly import SamplingSetup

MASK_GLYPH = "_"


def render_canvas(tokenizer, ids: list[int], mask_id: int) -> str:
    """Decoded text of a partly unmasked canvas, one MASK_GLYPH per masked position."""
    parts, run = [], []
    for i in ids:
        if i == mask_id:
            if run:
                parts.append(tokenizer.decode(run))
                run = []
            parts.append(MASK_GLYPH)
        else:
            run.append(i)
    if run:
        parts.append(tokenizer.decode(run))
    return "".join(parts)


def chat(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder."),
    model: str = typer.Option(None, "--model", help=MODEL_HELP),
    sampler_config: Path = SAMPLER_CONFIG_OPTION,
    overrides: list[str] = SET_OPTION,
    gen_length: int = typer.Option(None, "--gen-length", "--max-new-tokens", help="Tokens per reply."),
    block_length: int = typer.Option(None, "--block-length", help="Semi-autoregressive block length."),
    steps: int = typer.Option(None, "--steps", help="Step budget over all blocks."),
    policy: str = typer.Option(None, "--policy", help="Sampling policy."),
    cache: str = typer.Option(None, "--cache", help="KV cache: none, prefix, dual or block."),
    temperature: float = typer.Option(None, "--temperature", callback=finite, help="0 = greedy."),
    system: str = typer.Option(None, "--system", help="A system message opening the conversation."),
    live: bool = typer.Option(False, "--live", help="Show the reply being unmasked, step by step."),
    ar: bool = AR_OPTION,
    draft: str = typer.Option(None, "--draft", help="Speculative decoding of a causal model with this drafter."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    dtype: str = DTYPE_OPTION,
    threads: str = THREADS_OPTION,
) -> None:
    """Chat with a model: type a message, get a reply; /reset clears the history, /exit (or EOF) quits."""
    import torch

    flags = {"gen_length": gen_length, "block_length": block_length, "steps": steps, "policy": policy,
             "cache": cache, "temperature": temperature}  # fmt: skip
    if ar or draft is not None:
        flags["generation"] = "causal"
    apply_threads(threads)
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags, draft=draft,
                       causal_option="--draft" if draft is not None else "--ar", dtype=dtype)  # fmt: skip
    cfg = s.sampler
    gen = torch.Generator(device=s.device).manual_seed(cfg.seed)
    history: list[dict[str, str]] = [{"role": "system", "content": valid_text(system)}] if system else []
    interactive = sys.stdin.isatty()
    how = {"edit_flow": "edit_flow, tau_leaping", "causal": "causal" + (", speculative" if s.drafter else ""),
           "canvas_denoise": denoise_summary(cfg)}  # fmt: skip
    info(f"{s.loaded.source}: chatting ({how.get(cfg.generation, f'{cfg.policy}, cache {cfg.cache}')}); /reset, /exit")
    while (text := _read_turn(interactive)) is not None:
        if text.strip() == "/exit":
            break
        if text.strip() == "/reset":
            history = history[:1] if system else []
            info("(history cleared)")
        elif text.strip():
            history.append({"role": "user", "content": text})
            history.append({"role": "assistant", "content": _reply(s, history, gen, live)})


def _read_turn(interactive: bool) -> str | None:
    """The user's next line (None at EOF), as bytes where stdin has them: what is not UTF-8 becomes U+FFFD."""
    if interactive:
        sys.stderr.write("you> ")
        sys.stderr.flush()
    line = getattr(sys.stdin, "buffer", sys.stdin).readline()
    return valid_text(line).removesuffix("\n").removesuffix("\r") if line else None


def _reply(s: SamplingSetup, history: list[dict[str, str]], gen, live: bool) -> str:
    """Decode the assistant's reply to `history`, print it (and, `live`, the canvas after every step)."""
    from dllm.inference.engine import generate as sample

    tok, cfg = s.loaded.tokenizer, s.sampler
    ids = tok.apply_chat_template(history, add_generation_prompt=True).ids
    check_prompt_lengths([ids], cfg, s.loaded.profile, "the conversation", "start over with /reset")

    def show(event) -> None:
        view = event.canvas_BT if event.draft_BT is None else event.draft_BT  # canvas_denoise: the proposals
        row, g = view[0].tolist(), event.gen_start_B[0]
        sys.stderr.write("\r\033[K" + render_canvas(tok, row[g : g + cfg.gen_length], event.mask_id)[-200:])
        sys.stderr.flush()

    t0 = time.perf_counter()
    result = sample(s.loaded.model, [ids], cfg, s.special, generator=gen, callback=show if live else None,
                    stop=stop_function(tok, cfg.stop_strings), drafter=s.drafter)  # fmt: skip
    if live:
        sys.stderr.write("\r\033[K")
    reply = cut_at_stop(tok.decode(result.sequences[0]), cfg.stop_strings).strip()
    out(reply)
    info(f"[{counters_summary(cfg, result.counters, s.drafter is not None)}, {time.perf_counter() - t0:.2f}s]")
    return reply
