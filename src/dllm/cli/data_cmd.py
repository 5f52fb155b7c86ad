"""`dllm data prepare | validate`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from dllm.cli.common import info, out
from dllm.config.loading import load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.errors import DataError

app = typer.Typer(help="Prepare, validate and look at training data.", no_args_is_help=True)


class _Rate:
    """Records/s and tokens/s on stderr, at most twice a second."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.t0 = self.last = time.perf_counter()
        self.tokens = 0

    def __call__(self, records: int, tokens: int) -> None:
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and now - self.last > 0.5:
            dt = now - self.t0
            info(f"  {records:,} records  {records / dt:,.0f} rec/s  {self.tokens / dt:,.0f} tok/s")
            self.last = now


@app.command()
def prepare(
    config: Path = typer.Option(..., "--config", "-c", help="prepare.yaml"),
    output: Path = typer.Option(None, "--output", help="Artifact folder (default: `output` in the config)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing artifact."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
) -> None:
    """Tokenize and pack a corpus into a memory-mapped artifact (deterministic bytes)."""
    from dllm.data.prepare import prepare as run_prepare

    spec = load_config(PrepareSpec, config)
    target = output if output is not None else spec.output
    t0 = time.perf_counter()
    manifest = run_prepare(spec, config.parent, output=output, overwrite=overwrite, progress=_Rate(not quiet))
    if as_json:
        out(json.dumps(manifest, indent=2, sort_keys=True))
        return
    st = manifest["stats"]
    out(
        f"wrote {target}: {manifest['num_sequences']:,} sequences x {manifest['seq_len']} tokens from "
        f"{st['records_read']:,} records ({st['tokens']:,} tokens, {st['padding_tokens']:,} padding) "
        f"in {time.perf_counter() - t0:.1f}s; fingerprint {manifest['fingerprint'][:16]}"
    )


@app.command()
def validate(
    artifact: Path = typer.Argument(..., help="Artifact folder."),
    config: Path = typer.Option(None, "--config", "-c", help="A train.yaml to check compatibility with."),
    set_: list[str] = typer.Option(None, "--set", help="Override a field of --config (repeatable)."),
    no_checksums: bool = typer.Option(False, "--no-checksums", help="Skip SHA-256 checks (faster)."),
) -> None:
    """Check an artifact's files, hashes and values, and its fit with a training config."""
    from dllm.config.rules import resolve_run_spec
    from dllm.data.artifact import validate_artifact

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
