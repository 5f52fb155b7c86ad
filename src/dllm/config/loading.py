"""Load a YAML config into a typed spec: dotted overrides, error messages with file:line, dumps.

Every error raised here is a `ConfigError` whose message is one line naming the file (and line, when
the YAML node is known), the dotted field path and what is wrong.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dllm.errors import ConfigError

S = TypeVar("S", bound=BaseModel)


def read_yaml(path: Path) -> tuple[dict[str, Any], yaml.Node | None]:
    """Parse a YAML mapping; returns the data and its node tree (for line numbers)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, not {type(data).__name__}")
    return data, node


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict copy."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. training.steps=50")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def _field_line(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """1-based line of the key at a field path, or of its deepest parent present in the file."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            pair = next(((k, v) for k, v in node.value if getattr(k, "value", None) == str(part)), None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def union_tags(cls: type[BaseModel]) -> set[str]:
    """The tag values of every discriminated union (`kind`/`name` literals) inside a config class."""
    tags: set[str] = set()
    seen: set[type] = set()

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation in seen:
                return
            seen.add(annotation)
            for name, f in annotation.model_fields.items():
                if name in ("kind", "name") and typing.get_origin(f.annotation) is Literal:
                    tags.update(str(a) for a in typing.get_args(f.annotation))
                visit(f.annotation)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(cls)
    return tags


def _strip_union_tags(loc: tuple[Any, ...], data: Any, tags: set[str]) -> tuple[Any, ...]:
    """Drop the tag pydantic inserts for a discriminated union (`sources.0.jsonl.path` -> `sources.0.path`)."""
    out: list[Any] = []
    node = data
    for part in loc:
        if part in tags and not (isinstance(node, dict) and part in node):
            continue
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(out)


def format_validation_error(
    err: ValidationError,
    source: str,
    node: yaml.Node | None,
    overridden: set[str] | None = None,
    data: Any = None,
    tags: set[str] | None = None,
) -> str:
    """One line for the first error: `file:line: field.path: problem (got value)`."""
    # an unknown key is usually the root cause (a typo) of a "missing" error next to it: report it first
    errors = sorted(err.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    loc = _strip_union_tags(loc, data, tags or set())
    dotted = ".".join(str(p) for p in loc) or "(top level)"
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    kind = first["type"]
    if kind == "extra_forbidden":
        msg = "unknown field; check the spelling (`dllm config schema` lists the fields)"
    elif kind == "missing":
        msg = "required field is missing"
    elif "input" in first and kind not in ("model_type", "dict_type") and not isinstance(first["input"], dict):
        msg = f"{msg} (got {first['input']!r})"
    if overridden and dotted in overridden:
        return f"--set {dotted}: {msg}"
    line = _field_line(node, loc) if loc else None
    where = f"{source}:{line}" if line else source
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return f"{where}: {dotted}: {msg}"


def load_config(cls: type[S], path: str | Path, overrides: list[str] | None = None) -> S:
    """Read `path`, apply overrides and validate into `cls`; raises ConfigError with file:line."""
    path = Path(path)
    data, node = read_yaml(path)
    overrides = list(overrides or [])
    data = apply_overrides(data, overrides)
    return validate_config(cls, data, source=str(path), base_dir=path.parent, node=node, overrides=overrides)


def validate_config(
    cls: type[S],
    data: dict[str, Any],
    *,
    source: str,
    base_dir: Path | None,
    node: yaml.Node | None = None,
    overrides: list[str] | None = None,
) -> S:
    """Validate a dict into `cls`, turning pydantic errors into a one-line ConfigError."""
    try:
        return cls.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as e:
        keys = {o.partition("=")[0].strip() for o in overrides or []}
        raise ConfigError(format_validation_error(e, source, node, keys, data, union_tags(cls))) from None


def dump_config(spec: BaseModel) -> str:
    """The resolved config as YAML (absolute paths, every default filled in)."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False, default_flow_style=None)
