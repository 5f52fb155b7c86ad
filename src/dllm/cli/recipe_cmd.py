"""`dllm recipe list | show | copy`: the packaged recipes."""

from __future__ import annotations

from pathlib import Path

import typer

from dllm.cli.common import check_output_folder, info, out
from dllm.recipes import copy_recipe, get_recipe, list_recipes, recipe_files

app = typer.Typer(help="Ready-made configs: smoke tests that run on a CPU and GPU templates.", no_args_is_help=True)

COLUMNS = ("name", "objective", "kind", "description")


@app.command("list")
def list_() -> None:
    """List the recipes: name, objective, kind (smoke or template) and what each does."""
    rows = [COLUMNS] + [(r.name, r.objective, r.kind, r.description) for r in list_recipes()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    for row in rows:
        out("  ".join([cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)] + [row[-1]]))


@app.command()
def show(name: str = typer.Argument(..., help="Recipe name (see `dllm recipe list`).")) -> None:
    """Print a recipe's prepare.yaml and train.yaml."""
    for fname, text in recipe_files(name).items():
        out(f"# ==> {name}/{fname} <==")
        out(text.rstrip("\n"))
        out()


@app.command()
def copy(
    name: str = typer.Argument(..., help="Recipe name (see `dllm recipe list`)."),
    dest: Path = typer.Argument(..., help="Folder to create (must be empty or absent)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty folder, replacing the recipe's files."),
) -> None:
    """Copy a recipe's configs into DEST, with its generated data (smoke recipes), and print the next steps."""
    recipe = get_recipe(name)
    check_output_folder(dest, "DEST")
    written = copy_recipe(name, dest, force=force)
    info(f"wrote {', '.join(str(p) for p in written)}")
    if recipe.kind == "template":
        info("this is a template: point its model, tokenizer and data paths at your folders first")
    if recipe.kind == "real":
        info(f"every step, with its time on 2 CPU cores, is in the header of {dest / 'train.yaml'}")
        return
    if recipe.after is not None:
        info(f"first train the recipe {recipe.after} in {dest.parent / recipe.after} (this one reads its run)")
    info("next:")
    info(f"  dllm data prepare --config {dest / 'prepare.yaml'}")
    info(f"  dllm launch --config {dest / 'train.yaml'}")
