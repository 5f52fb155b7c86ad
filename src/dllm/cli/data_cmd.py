"""`dllm data prepare | validate`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from dllm.cli.common import check_output_file, info, out, warn, write_file
from dllm.cli.outputs import ARTIFACT, check_output_place
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError, DataError

app = typer.Typer(help="Prepare, validate and look at training data.", no_args_is_help=True)


class _Rate:
    """Records, tokens and their rates: a live rich line on a terminal, a line every 5 s otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = self.last = time.perf_counter()
        self.tokens = self.records = 0
        self._live = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(stderr=True), refresh_per_second=4, transient=True)
            self._live.start()

    def _line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        rates = f"{self.records / dt:,.0f} rec/s  {self.tokens / dt:,.0f} tok/s"
        return f"{self.records:,} records  {self.tokens:,} tokens  {rates}"

    def __call__(self, records: int, tokens: int) -> None:
        self.records = records
        self.tokens += tokens
        now = time.perf_counter()
        if self._live is not None and now - self.last > 0.25:
            self._live.update(self._line())
            self.last = now
        elif self.enabled and self._live is None and now - self.last > 5:
            info(self._line())
            self.last = now

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def _at_most_cores(workers: int) -> int:
    """--workers, checked before a process starts or a folder is made: more tokenizer processes than the cores
    this process may run on only wait for each other (and thousands would exhaust the machine)."""
    from dllm.parallel.threads import usable_cores

    cores = usable_cores()
    if workers > cores:
        raise typer.BadParameter(f"{workers} tokenizer processes, more than the {cores} CPU core(s) here; "
                                 f"give at most {cores}")  # fmt: skip
    return workers


@app.command()
def prepare(
    config: Path = typer.Option(..., "--config", "-c", help="prepare.yaml"),
    output: Path = typer.Option(None, "--output", help="Artifact folder (default: `output` in the config)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing artifact."),
    workers: int = typer.Option(
        1,
        "--workers",
        min=1,
        callback=_at_most_cores,
        help="Tokenizer processes, at most the CPU cores here (same bytes for any number).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Tokenize and lay out a corpus into a memory-mapped artifact (deterministic bytes)."""
    from dllm.data.prepare import prepare as run_prepare

    spec = load_config(PrepareSpec, config)
    target = output if output is not None else spec.output
    check_output_place(target, "--output" if output is not None else f"{config}: output", folder=True, own=ARTIFACT)
    t0 = time.perf_counter()
    rate = _Rate(not quiet and not as_json)
    try:
        manifest = run_prepare(spec, config.parent, output=output, overwrite=overwrite, workers=workers, progress=rate)
    finally:
        rate.close()
    _warn_empty(manifest["stats"])
    if as_json:
        out(json.dumps(manifest, indent=2, sort_keys=True))
        return
    st = manifest["stats"]
    dropped = (
        f", {st['records_skipped']:,} skipped, {st['rejected']:,} rejected"
        if st["records_skipped"] or st["rejected"]
        else ""
    )
    slots = manifest["num_sequences"] * manifest["seq_len"]
    out(
        f"wrote {target} ({_layout(manifest)}): {manifest['num_sequences']:,} rows x {manifest['seq_len']} from "
        f"{st['records_read']:,} records{dropped} ({st['tokens']:,} tokens, {st['supervised_tokens']:,} supervised, "
        f"{st['padding_tokens']:,} padding = {100 * st['padding_tokens'] / max(slots, 1):.1f}% of rows; "
        f"{_split_note(st)}) in {time.perf_counter() - t0:.1f}s; fingerprint {manifest['fingerprint'][:16]}"
    )


def _warn_empty(stats: dict) -> None:
    """Empty records became EOS-only documents (when every record was, prepare refused): where, and how many."""
    empty = stats.get("records_empty", 0)
    if empty:
        warn(f"{stats['empty_examples'][0]}: {empty:,} of {stats['records_read']:,} records are empty (no text or "
             "token ids) and became EOS-only documents; drop them or check the sources' fields")  # fmt: skip


def _layout(manifest: dict) -> str:
    """The layout, and for packed rows the packing (a manifest from before packing modes has none)."""
    packing = manifest.get("packing")
    return (
        f"{manifest['layout']}, packing {packing}" if manifest["layout"] == "packed" and packing else manifest["layout"]
    )


def _split_note(stats: dict) -> str:
    """How many records a row boundary cut, and the supervised tokens that lost their row's context."""
    cut = stats.get("split_across_rows")
    if cut is None:
        return "records split across rows: not recorded"
    note = f"{cut:,} records split across rows"
    lost = stats.get("split_supervised_tokens", 0)
    return note + (f", {lost:,} supervised tokens trained apart from their record's start" if lost else "")


@app.command()
def validate(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    config: Path = typer.Option(None, "--config", "-c", help="A train.yaml to check compatibility with."),
    set_: list[str] = typer.Option(None, "--set", help="Override a field of --config (repeatable)."),
    no_checksums: bool = typer.Option(False, "--no-checksums", help="Skip SHA-256 checks (faster)."),
) -> None:
    """Check an artifact's files, hashes and values, and its fit with a training config."""
    from dllm.data.artifact import validate_artifact
    from dllm.training.preflight import resolve_run_spec

    art = validate_artifact(artifact, checksums=not no_checksums)
    if config is not None:
        spec = load_config(RunSpec, config, set_ or [])
        if Path(spec.data.path).resolve() != Path(artifact).resolve():
            raise DataError(f"{config}: data.path is {spec.data.path}, not {artifact}")
        resolve_run_spec(spec)
    out(
        f"ok: {artifact}: {art.num_sequences:,} sequences x {art.seq_len}, tokenizer {art.tokenizer['kind']} "
        f"(vocab {art.tokenizer['vocab_size']}), fingerprint {art.fingerprint[:16]}"
        + (f"; compatible with {config}" if config is not None else "")
    )


def _artifact_tokenizer(art, tokenizer: Path | None):
    """The tokenizer that prepared an artifact: byte, or the HF folder recorded in (or given for) it."""
    from dllm.config.data import TokenizerConfig
    from dllm.tokenization import build_tokenizer

    kind = art.tokenizer["kind"]
    if kind == "byte":
        if tokenizer is not None:
            warn(f"--tokenizer {tokenizer}: no effect; {art.path} was made with the byte tokenizer, which has no files")
        return build_tokenizer(TokenizerConfig())
    path = tokenizer or (art.path / art.manifest["tokenizer_path"] if "tokenizer_path" in art.manifest else None)
    if path is None:
        raise DataError(f"{art.path}: the artifact records no tokenizer folder; pass --tokenizer DIR")
    try:
        tok = build_tokenizer(TokenizerConfig(kind="hf", path=Path(path).resolve()))
    except ConfigError as e:  # named by its config field; here the folder came from the flag or the manifest
        flag = "--tokenizer" if tokenizer is not None else f"{art.path}: manifest tokenizer_path"
        raise DataError(f"{flag}: {str(e).removeprefix('tokenizer.path: ')}") from None
    if tok.identity()["vocab_hash"] != art.tokenizer["vocab_hash"]:
        raise DataError(f"--tokenizer: {path} is not the tokenizer that prepared {art.path}")
    return tok


@app.command()
def inspect(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    index: list[int] = typer.Option(None, "--index", "-i", help="Row / sample to show (repeatable; default 0)."),
    tokenizer: Path = typer.Option(None, "--tokenizer", help="Tokenizer folder, if the artifact's has moved."),
) -> None:
    """Decode samples, with the supervised (trained and noised) tokens highlighted."""
    from rich.console import Console

    from dllm.data.artifact import open_artifact
    from dllm.data.report import num_samples, render_sample, sample_tokens

    art = open_artifact(artifact)
    tok = _artifact_tokenizer(art, tokenizer)
    console = Console(highlight=False)
    total = num_samples(art)
    console.print(f"{artifact}: {_layout(art.manifest)}; {_split_note(art.manifest.get('stats', {}))}")
    for i in index or [0]:
        tokens, mask = sample_tokens(art, i)
        console.rule(f"{art.manifest['layout']} sample {i} of {total}: {int(mask.sum())}/{len(mask)} supervised")
        console.print(render_sample(tokens, mask, tok))


@app.command()
def stats(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    plot: Path = typer.Option(None, "--plot", help="Write a document-length histogram to this PNG."),
    as_json: bool = typer.Option(False, "--json", help="Print the recorded stats as JSON."),
) -> None:
    """Show what preparation recorded: records, tokens, supervision, padding, lengths."""
    from rich.console import Console

    from dllm.data.artifact import read_manifest
    from dllm.data.report import plot_lengths, stats_table

    check_output_file(plot, "--plot", reads=[("the artifact", artifact)], parents=True)
    manifest = read_manifest(artifact)
    if as_json:
        out(json.dumps(manifest["stats"], indent=2, sort_keys=True))
    else:
        Console().print(stats_table(manifest))
    if plot is not None:
        write_file(plot, lambda tmp: plot_lengths(manifest, tmp), "--plot")
        info(f"wrote {plot}")
