"""Layering: every import between the parts of src/dllm is an edge that src/dllm/ARCHITECTURE.toml allows,
every edge it allows is used, the modules of one part import each other without a cycle, and no source
file grows past MAX_LINES.

The checker reads the source with `ast` (nothing is imported): `import x` and `from x import y`, at
module level and inside functions, relative imports resolved, `if TYPE_CHECKING:` imports included
(a type-only dependency is still a dependency), and `importlib.import_module("dllm....")` with a
literal name. `from package import name` imports the module `package.name` when that is a file (or a
package) of its own, else the package's __init__.py; the parent packages Python also runs on the way
are not counted as imports of the file.
"""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (the `dev` extra installs tomli there)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "dllm"
RULES = SRC / "ARCHITECTURE.toml"
ROOT = "dllm"  # the part name of the package root, src/dllm/__init__.py
MAX_LINES = 500  # a longer file holds more than one thing: split it by meaning


@dataclass(frozen=True)
class Import:
    file: Path
    line: int
    statement: str  # the import as written (ast.unparse)
    module: str  # the importing module, dotted (a package is its __init__.py)
    target: str  # the imported module, dotted


@dataclass(frozen=True)
class Edge:
    file: Path
    line: int
    statement: str  # the import as written (ast.unparse)
    source: str  # the importing part
    target: str  # the imported part


def load_rules(path: Path = RULES) -> tuple[dict[str, set[str]], set[str]]:
    """({part: parts it may import}, planned parts) from ARCHITECTURE.toml."""
    data = tomllib.loads(path.read_text())
    return {part: set(targets) for part, targets in data["imports"].items()}, set(data.get("planned", []))


def parts_on_disk(root: Path) -> set[str]:
    """The root, every subpackage (a folder with .py files) and every top-level module of `root`."""
    parts = {ROOT}
    for child in root.iterdir():
        if child.is_dir() and any(child.rglob("*.py")):
            parts.add(child.name)
        elif child.suffix == ".py" and child.stem != "__init__":
            parts.add(child.stem)
    return parts


def _module_name(root: Path, file: Path) -> tuple[list[str], bool]:
    """(dotted name as parts, is a package __init__) of a source file under `root`."""
    rel = file.relative_to(root).with_suffix("").parts
    if rel[-1] == "__init__":
        return [ROOT, *rel[:-1]], True
    return [ROOT, *rel], False


def _part_of(root: Path, dotted: list[str]) -> str:
    """The part a dotted module name under the package belongs to (the root for `dllm` itself)."""
    return dotted[1] if len(dotted) > 1 else ROOT


def _imported_modules(node: ast.AST, module: list[str], is_package: bool, root: Path) -> list[list[str]]:
    """The dllm modules one AST node imports, as dotted parts (empty for anything else)."""
    if isinstance(node, ast.Import):
        return [a.name.split(".") for a in node.names if a.name.split(".")[0] == ROOT]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the current package, one level up per extra dot
            package = module if is_package else module[:-1]
            base = package[: len(package) - (node.level - 1)]
            dotted = base + (node.module.split(".") if node.module else [])
        else:
            dotted = node.module.split(".") if node.module else []
        if not dotted or dotted[0] != ROOT:
            return []
        # `from package import x`: x is a module of its own (`from dllm import diffusion`), or a name the
        # package defines (`from dllm import __version__`)
        return [[*dotted, a.name] if _is_module(root, [*dotted, a.name]) else dotted for a in node.names]
    if isinstance(node, ast.Call):  # importlib.import_module("dllm.x") / __import__("dllm.x")
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in ("import_module", "__import__") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.split(".")[0] == ROOT:
                return [arg.value.split(".")]
    return []


def _is_module(root: Path, dotted: list[str]) -> bool:
    """Whether a dotted name under the package is a module or a package of its own."""
    path = root.joinpath(*dotted[1:])
    return path.is_dir() or path.with_suffix(".py").is_file()


def read_imports(root: Path) -> list[Import]:
    """Every import of a dllm module by a file of the package under `root`, in file and line order."""
    imports = []
    for file in sorted(root.rglob("*.py")):
        module, is_package = _module_name(root, file)
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            targets = {".".join(dotted) for dotted in _imported_modules(node, module, is_package, root)}
            for target in sorted(targets):
                imports.append(Import(file, node.lineno, ast.unparse(node), ".".join(module), target))
    return sorted(imports, key=lambda i: (str(i.file), i.line))


def import_edges(root: Path) -> list[Edge]:
    """Every import from one part of the package under `root` into another part (one per statement and part)."""
    edges = {}
    for imp in read_imports(root):
        source, target = _part_of(root, imp.module.split(".")), _part_of(root, imp.target.split("."))
        if target != source:
            edges[imp.file, imp.line, target] = Edge(imp.file, imp.line, imp.statement, source, target)
    return list(edges.values())


def registry_edges(root: Path, registries: dict[str, str]) -> list[Edge]:
    """Every `NAME.resolve(...)` of a registry ({NAME: the part its targets live in}): resolving a name imports
    the target's module, so it is an edge from the resolving part to the registry's part."""
    edges = []
    for file in sorted(root.rglob("*.py")):
        source = _part_of(root, _module_name(root, file)[0])
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr == "resolve" and isinstance(func.value, ast.Name):
                target = registries.get(func.value.id)
                if target is not None and target != source:
                    edges.append(Edge(file, node.lineno, ast.unparse(node), source, target))
    return edges


def real_registries() -> dict[str, str]:
    from dllm.config.registries import ALL

    return {name: reg.part for name, reg in ALL.items()}


def find_cycle(allowed: dict[str, set[str]]) -> list[str] | None:
    """A cycle of allowed edges (as a path that returns to its start), or None for a DAG."""
    try:
        graphlib.TopologicalSorter(allowed).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def module_cycles(root: Path) -> list[list[str]]:
    """An import cycle between the modules of one part, for each part that has one: the modules in import
    order, returning to the first."""
    modules = {".".join(_module_name(root, file)[0]) for file in root.rglob("*.py")}
    by_part: dict[str, dict[str, set[str]]] = {}
    for imp in read_imports(root):
        part = _part_of(root, imp.module.split("."))
        if imp.target in modules and imp.target != imp.module and _part_of(root, imp.target.split(".")) == part:
            by_part.setdefault(part, {}).setdefault(imp.module, set()).add(imp.target)
    cycles = [find_cycle(graph) for _, graph in sorted(by_part.items())]
    return [cycle[::-1] for cycle in cycles if cycle]  # graphlib walks the edges backwards


def unused_edges(
    allowed: dict[str, set[str]], edges: list[Edge], planned: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """The allowed edges ("part -> part") no import or registry resolution uses (parts that are planned aside)."""
    used = {(e.source, e.target) for e in edges}
    return [
        f"{source} -> {target}"
        for source, targets in sorted(allowed.items())
        for target in sorted(targets)
        if (source, target) not in used and not {source, target} & planned
    ]


def violations(root: Path, allowed: dict[str, set[str]], registries: dict[str, str] | None = None) -> list[str]:
    """One message per import (or registry resolution) that `allowed` does not permit, naming the file, the
    line and the statement."""
    out = []
    for e in import_edges(root) + registry_edges(root, registries or {}):
        if e.target in allowed.get(e.source, set()):
            continue
        shown = e.file.relative_to(REPO if REPO in e.file.parents else root.parent)
        where = f"{shown}:{e.line}"
        may = ", ".join(sorted(allowed.get(e.source, set()))) or "nothing"
        out.append(
            f"{where}: `{e.statement}` makes {e.source} import {e.target}, which ARCHITECTURE.toml does not allow "
            f"({e.source} may import: {may}); move the code to the right layer, or allow the edge there with the reason"
        )
    return out


# --------------------------------------------------------------------------------------------------
# the real package


def test_every_import_follows_architecture_toml():
    allowed, _ = load_rules()
    found = violations(SRC, allowed, real_registries())
    if found:
        pytest.fail("imports that break the layering:\n" + "\n".join(found), pytrace=False)


def test_every_allowed_edge_is_used():
    allowed, planned = load_rules()
    unused = unused_edges(allowed, import_edges(SRC) + registry_edges(SRC, real_registries()), planned)
    if unused:
        found = "\n".join(unused)
        pytest.fail(f"ARCHITECTURE.toml allows edges that no file of the importing part uses (drop them):\n{found}",
                    pytrace=False)  # fmt: skip


def test_no_import_cycle_inside_a_part():
    cycles = module_cycles(SRC)
    if cycles:
        found = "\n".join(" -> ".join(cycle) for cycle in cycles)
        pytest.fail(f"modules of one part import each other in a cycle (move the shared piece below them):\n{found}",
                    pytrace=False)  # fmt: skip


def test_no_source_file_is_too_long():
    lengths = {file: len(file.read_text().splitlines()) for file in sorted(SRC.rglob("*.py"))}
    long = [f"{file.relative_to(REPO)}: {n} lines" for file, n in lengths.items() if n > MAX_LINES]
    assert not long, f"files over {MAX_LINES} lines (split each by meaning):\n" + "\n".join(long)


MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_PARTS = ("sampling", "inference", "serving")


def test_no_function_of_the_decoding_parts_is_too_long():
    """The decoding loops, the engine and the server keep their control flow readable: no function over
    MAX_FUNCTION_LINES lines (docstring included)."""
    long = []
    for part in SHORT_FUNCTION_PARTS:
        for file in sorted((SRC / part).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                    if n > MAX_FUNCTION_LINES:
                        long.append(f"{file.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


DESIGN_DOC = REPO / "docs" / "design.md"


def paths_named_in(text: str) -> list[str]:
    """Source and test paths a document names: `part/file.py`, `part/` and `tests/...` (in backticks or tables)."""
    found = re.findall(
        r"(?<![\w./-])((?:tests/|bench/|docs/)?[a-z_]+(?:/[a-z_]+)*(?:\.py|\.toml|/))(?=[`:\s,)|])", text
    )
    return sorted({p for p in found if "/" in p or p.endswith((".py", ".toml"))})


def test_the_design_doc_names_only_what_exists():
    """docs/design.md stays true to the code: every file or folder it names exists (under src/dllm, or
    the repository for tests/, bench/ and docs/), and every part of ARCHITECTURE.toml appears in its layering."""
    text = DESIGN_DOC.read_text(encoding="utf-8")
    in_repo = ("tests/", "bench/", "docs/")
    missing = [p for p in paths_named_in(text) if not (REPO / p if p.startswith(in_repo) else SRC / p).exists()]
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"
    for path, name in re.findall(r"`([a-z_/]+\.py): ([A-Za-z_.]+)`", text):  # a function or class it points at
        source = (SRC / path).read_text(encoding="utf-8")
        last = name.split(".")[-1]
        assert f"def {last}(" in source or f"class {last}" in source, f"docs/design.md: {path} has no {name}"
    allowed, _ = load_rules()
    unnamed = [part for part in allowed if part != ROOT and f"`{part}/`" not in text and f"`{part}.py`" not in text]
    assert not unnamed, f"docs/design.md's layering leaves out parts: {unnamed}"


def test_no_registry_declares_a_name_twice():
    """A registry is declared as a dict literal, where a second entry of a name would silently replace the first:
    each name is declared once."""
    tree = ast.parse((SRC / "config" / "registries.py").read_text(encoding="utf-8"))
    twice = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            names = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            twice += sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"config/registries.py declares these names twice: {twice}"


def test_the_checker_finds_a_name_declared_twice():
    twice = ast.parse('R = Registry("k", "p", {"a": "m:A", "b": "m:B", "a": "m:C"})')
    names = [k.value for node in ast.walk(twice) if isinstance(node, ast.Dict) for k in node.keys]
    assert names.count("a") == 2  # what the walk above counts


def test_the_serving_state_and_the_sampling_setup_are_typed():
    """What a server holds and what loading for inference returns name their types (no Any)."""
    import typing

    from dllm.checkpoint.loading import LoadedModel
    from dllm.inference.assembly import SamplingSetup
    from dllm.serving.app import ServeState
    from dllm.serving.engine import Engine

    for cls in (ServeState, SamplingSetup, LoadedModel):
        hints = typing.get_type_hints(cls)
        assert typing.Any not in hints.values(), (cls.__name__, hints)
    hints = typing.get_type_hints(Engine.__init__)
    assert typing.Any not in hints.values(), hints


def test_checker_sees_the_real_imports():
    """Guard against a checker that passes because it finds nothing."""
    edges = {(e.source, e.target) for e in import_edges(SRC)}
    assert {("cli", "config"), ("training", "models"), ("models", "attention"), ("data", ROOT)} <= edges
    assert len(edges) > 40


def test_checker_sees_the_registry_resolutions():
    """Names resolved through config/registries.py are edges too (training resolves OBJECTIVES in diffusion)."""
    edges = {(e.source, e.target) for e in registry_edges(SRC, real_registries())}
    assert {("training", "diffusion"), ("tokenization", "tokenization")} & edges == {("training", "diffusion")}
    assert len(edges) >= 3


def test_architecture_toml_is_a_dag():
    allowed, _ = load_rules()
    cycle = find_cycle(allowed)
    assert cycle is None, f"ARCHITECTURE.toml has a cycle: {' -> '.join(cycle or [])}"
    order = list(graphlib.TopologicalSorter(allowed).static_order())
    assert order.index("config") < order.index("models") < order.index("training") < order.index("cli")


def test_architecture_toml_places_every_part():
    allowed, planned = load_rules()
    on_disk = parts_on_disk(SRC)
    assert not on_disk - set(allowed), f"parts without an entry in ARCHITECTURE.toml: {sorted(on_disk - set(allowed))}"
    stale = set(allowed) - on_disk - planned
    assert not stale, f"entries for parts that do not exist (remove them or list them as planned): {sorted(stale)}"
    assert not planned & on_disk, f"planned parts that now exist: {sorted(planned & on_disk)}; drop them from planned"
    unknown = {t for targets in allowed.values() for t in targets} - set(allowed)
    assert not unknown, f"ARCHITECTURE.toml allows imports of parts it does not list: {sorted(unknown)}"


def test_architecture_toml_encodes_the_design_rules():
    """DESIGN.md section 3: these edges stay forbidden whatever else is allowed."""
    allowed, _ = load_rules()
    assert allowed[ROOT] == set()
    assert allowed["config"] <= {"errors", "registry"}
    assert not allowed["models"] & {"diffusion", "sampling", "training", "parallel"}
    assert not allowed["data"] & {"models", "training"}
    assert [p for p, targets in allowed.items() if "cli" in targets] == ["demo"]
    assert not any("demo" in targets for targets in allowed.values())
    assert not allowed["checkpoint"] & {"sampling", "inference"}  # saving and loading know nothing of decoding
    assert not allowed["sampling"] & {"inference", "serving"}  # a decoding loop never calls back into its driver


def test_a_training_launch_imports_no_decoding_module():
    """What a (non-RL) training worker imports: the run's build and its checkpoints, never the sampling loops
    or the inference engine (they load only for decoding)."""
    code = ("import sys, dllm.training.worker, dllm.training.build, dllm.checkpoint.manager, dllm.checkpoint.loading; "
            "print(sorted(m for m in sys.modules if m.startswith(('dllm.sampling', 'dllm.inference'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_import_dllm_is_light():
    code = "import dllm, sys; print(','.join(m for m in ('transformers', 'datasets') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


# --------------------------------------------------------------------------------------------------
# the checker itself


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_checker_reports_forbidden_edges_with_file_line_and_import(tmp_path: Path):
    root = tmp_path / "dllm"
    _write(root, "__init__.py", '__version__ = "0"\n')
    _write(root, "errors.py", "")
    _write(root, "diffusion/__init__.py", "")
    _write(root, "diffusion/corruption.py", "from dllm.models import layers\n")  # allowed: diffusion above models
    _write(root, "models/__init__.py", "from . import layers\n")  # inside the part
    _write(
        root,
        "models/layers.py",
        "from dllm import __version__\n"
        "from dllm.errors import UserError\n"
        "\n"
        "\n"
        "def f():\n"
        "    from dllm.diffusion import corruption\n"  # line 6: function-level
        "    return corruption\n"
        "\n"
        "\n"
        "def g():\n"
        "    from ..diffusion.corruption import mask\n"  # line 11: relative
        "    import dllm.diffusion\n"  # line 12
        "    from dllm import diffusion\n"  # line 13: a part named in `from dllm import`
        "    return mask, dllm, diffusion\n",
    )
    allowed = {ROOT: set(), "errors": set(), "models": {ROOT, "errors"}, "diffusion": {"models", "errors"}}
    found = violations(root, allowed)
    assert len(found) == 4, found
    for msg, (line, stmt) in zip(
        found,
        [
            (6, "from dllm.diffusion import corruption"),
            (11, "from ..diffusion.corruption import mask"),
            (12, "import dllm.diffusion"),
            (13, "from dllm import diffusion"),
        ],
        strict=True,
    ):
        assert msg.startswith(f"dllm/models/layers.py:{line}: `{stmt}` makes models import diffusion"), msg
        assert "models may import: dllm, errors" in msg
    assert violations(root, {**allowed, "models": {ROOT, "errors", "diffusion"}}) == []
    assert parts_on_disk(root) == {ROOT, "errors", "models", "diffusion"}


def test_cycle_in_the_rules_is_reported():
    rules = {"config": {"errors"}, "errors": set(), "models": {"config", "training"}, "training": {"models"}}
    assert set(find_cycle(rules) or []) == {"models", "training"}
    assert find_cycle({**rules, "training": {"config"}}) is None


def test_checker_reports_a_registry_resolution_across_the_layering(tmp_path: Path):
    """`OBJECTIVES.resolve(...)` in models imports diffusion through a string: reported like an import."""
    root = tmp_path / "dllm"
    _write(root, "__init__.py", "")
    _write(root, "diffusion/__init__.py", "")
    _write(root, "models/__init__.py", "")
    _write(root, "models/layers.py", "def f(name):\n    return OBJECTIVES.resolve(name)\n")
    allowed = {ROOT: set(), "models": set(), "diffusion": {"models"}}
    found = violations(root, allowed, {"OBJECTIVES": "diffusion", "NORMS": "models"})
    assert len(found) == 1 and found[0].startswith(
        "dllm/models/layers.py:2: `OBJECTIVES.resolve(name)` makes models import diffusion"
    ), found
    assert violations(root, allowed, {"OBJECTIVES": "models"}) == []  # resolving inside its own part


def test_checker_reports_an_import_cycle_inside_a_part(tmp_path: Path):
    """A cycle through a function-level, a relative and a TYPE_CHECKING import; an import from another
    part, or of a name a package defines, is no step of a cycle unless the package's __init__ closes one."""
    root = tmp_path / "dllm"
    _write(root, "__init__.py", "")
    _write(root, "errors.py", "from dllm.sampling import loop\n")  # another part: not a cycle of sampling
    _write(root, "sampling/__init__.py", "TIMEOUT_S = 1\n")
    _write(root, "sampling/loop.py", "import dllm.errors\n\n\ndef run():\n    from .runner import call\n")
    _write(root, "sampling/runner.py", "import typing\n\nif typing.TYPE_CHECKING:\n    from . import stats\n")
    _write(root, "sampling/stats.py", "from dllm.sampling import loop\n")
    cycle = ["dllm.sampling.loop", "dllm.sampling.runner", "dllm.sampling.stats", "dllm.sampling.loop"]
    assert module_cycles(root) == [cycle]
    _write(root, "sampling/stats.py", "from dllm.sampling import TIMEOUT_S\n")  # the package's name: no module
    assert module_cycles(root) == []
    _write(root, "sampling/__init__.py", "from dllm.sampling.loop import run\nTIMEOUT_S = 1\n")
    assert module_cycles(root) == [["dllm.sampling", *cycle[:-1], "dllm.sampling"]]


def test_checker_reports_unused_allowed_edges(tmp_path: Path):
    root = tmp_path / "dllm"
    _write(root, "__init__.py", "")
    _write(root, "errors.py", "")
    _write(root, "config/__init__.py", "from dllm import errors\n")
    allowed = {ROOT: set(), "errors": set(), "config": {"errors", ROOT}, "hub": {"config"}}
    assert unused_edges(allowed, import_edges(root)) == ["config -> dllm", "hub -> config"]
    assert unused_edges(allowed, import_edges(root), planned={"hub"}) == ["config -> dllm"]
