"""`dllm config validate | schema`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dllm.cli.common import SetOption, out, warn
from dllm.config.loading import dump_config, load_config
from dllm.config.prepare import PrepareSpec
from dllm.config.spec import RunSpec
from dllm.errors import ConfigError

app = typer.Typer(help="Check configs and print their schema.", no_args_is_help=True)


@app.command()
def validate(
    config: Path = typer.Option(..., "--config", "-c", help="train.yaml"),
    set_: list[str] = SetOption,
    nproc_per_node: int = typer.Option(None, "--nproc-per-node", min=1, help="Check for this many processes."),
    no_data: bool = typer.Option(False, "--no-data", help="Skip the checks against the prepared artifact."),
) -> None:
    """Validate a training config with every cross-field rule and print the resolved spec."""
    from dllm.training.preflight import resolve_run_spec

    overrides = list(set_ or [])
    if nproc_per_node is not None:
        overrides.append(f"topology.nproc_per_node={nproc_per_node}")
    spec = load_config(RunSpec, config, overrides)
    spec, warnings = resolve_run_spec(spec, check_data=not no_data)
    for w in warnings:
        warn(w)
    out(dump_config(spec).rstrip())


@app.command()
def schema(
    prepare: bool = typer.Option(False, "--prepare", help="The schema of prepare.yaml instead of train.yaml."),
    sampler: bool = typer.Option(False, "--sampler", help="The schema of a --sampler-config file."),
) -> None:
    """Print the JSON schema (point your editor's YAML plugin at it)."""
    from dllm.config.sampler import SamplerConfig

    if prepare and sampler:
        raise ConfigError("give at most one of --prepare and --sampler")
    cls = PrepareSpec if prepare else SamplerConfig if sampler else RunSpec
    out(json.dumps(cls.model_json_schema(), indent=2))
