"""The `dllm` command. User errors print one line `dllm: error: ...` and exit 2; no tracebacks."""

from __future__ import annotations

import gc
import re
import sys

import typer

from dllm.cli import config_cmd, data_cmd, eval_cmd, recipe_cmd
from dllm.cli.chat_cmd import chat
from dllm.cli.convert_cmd import convert
from dllm.cli.doctor_cmd import doctor
from dllm.cli.generate_cmd import generate
from dllm.cli.init_cmd import init
from dllm.cli.launch_cmd import launch
from dllm.cli.plot_cmd import plot
from dllm.cli.runs_cmd import runs
from dllm.cli.sampling_common import COUNTERS_EPILOG
from dllm.cli.serve_cmd import serve
from dllm.errors import UserError

app = typer.Typer(
    name="dllm",
    help="Train, sample and evaluate diffusion language models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(init)
app.add_typer(data_cmd.app, name="data")
app.add_typer(config_cmd.app, name="config")
app.add_typer(recipe_cmd.app, name="recipe")
app.add_typer(eval_cmd.app, name="eval")
app.command()(launch)
app.command(epilog=COUNTERS_EPILOG)(generate)
app.command(epilog=COUNTERS_EPILOG)(chat)
app.command()(convert)
app.command()(doctor)
app.command()(plot)
app.command()(runs)
app.command()(serve)


def _one_line(text: str) -> str:
    return " ".join(text.split())


_MARKUP_TAG = re.compile(r"\[(?=[a-z#/@][^\[]*?\])")
"""An opening bracket that rich would read as a markup tag (and drop with its text: 'dllm[plot]' -> 'dllm')."""


def _literal_help(command) -> None:
    """Help texts are plain text: escape every bracket rich's help would take for markup (pip install
    'dllm[plot]', org/name[@revision]) in `command`, its subcommands and their options."""
    if not typer.core.HAS_RICH:
        return
    for attr in ("help", "epilog", "short_help"):
        if getattr(command, attr, None):
            setattr(command, attr, _MARKUP_TAG.sub(r"\\[", getattr(command, attr)))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = _MARKUP_TAG.sub(r"\\[", param.help)
    for sub in getattr(command, "commands", {}).values():
        _literal_help(sub)


def _click_classes() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(usage errors, exits, aborts) of the click that typer runs on: recent typer versions vendor
    their own copy of click, older ones use the click package."""
    errors: list[type] = [getattr(typer, "TyperException", UserError)]
    exits: list[type] = [typer.Exit]
    aborts: list[type] = [typer.Abort]
    try:
        import click

        errors.append(click.ClickException)
        exits.append(click.exceptions.Exit)
        aborts.append(click.exceptions.Abort)
    except ImportError:
        pass
    return tuple(errors), tuple(exits), tuple(aborts)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script exits with it)."""
    command = typer.main.get_command(app)
    _literal_help(command)
    args = sys.argv[1:] if argv is None else argv
    usage_errors, exits, aborts = _click_classes()
    try:
        result = command.main(args=args, prog_name="dllm", standalone_mode=False)
    except UserError as e:
        print(f"dllm: error: {_one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except exits as e:
        return int(getattr(e, "exit_code", 0) or 0)
    except aborts:
        print("dllm: aborted", file=sys.stderr)
        return 130
    except usage_errors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `dllm` or `dllm data` alone: show the help
            print(e.format_message(), file=sys.stderr)
            return 0
        print(f"dllm: error: {_one_line(e.format_message())} (see dllm --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dllm: interrupted", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0


def entry() -> None:
    code = main()
    # The command is done and the process ends next: at its exit Python would collect every object torch
    # made, one by one (1-2 s on two idle cores, far more on a busy machine), e.g. while a stopped
    # `dllm launch` keeps the prompt after its workers have ended. Frozen objects are skipped; every file
    # and lock was closed by the command.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
