"""Load a YAML config into a typed spec: dotted overrides, error messages with file:line, dumps.

Every error raised here is a `ConfigError` whose message is one line naming the file (and line, when
the YAML node is known), the dotted field path and what is wrong.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from dllm.errors import ConfigError

S = TypeVar("S", bound=BaseModel)


MAX_YAML_VALUES = 100_000
"""Most values a config may expand to: YAML aliases can make 700 bytes expand to billions (a "billion laughs")."""
MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists a config may have."""
MAX_INT_CHARS = 100
"""Longest integer literal read (Python refuses to convert more than 4300 digits, and no field needs 100)."""
PLAIN_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("null", "bool", "int", "float", "str", "seq", "map", "merge")
)
"""The YAML tags a config is read with; any other (!!binary, !!timestamp, !!set, !!omap, ...) makes a value no field
means (bytes, a date, a set), which pydantic might quietly turn into text."""


class _Refused(yaml.constructor.ConstructorError):
    """A YAML document that parses but is refused (duplicate key, too big, too deep, recursive)."""


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader whose integers must fit in 64 bits (the limit is checked before converting)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INT_CHARS:
            raise _Refused(None, None, f"integer of {len(node.value)} characters is too large", node.start_mark)
        value = super().construct_yaml_int(node)
        if not -(2**63) <= value < 2**63:
            raise _Refused(None, None, f"integer {node.value} does not fit in 64 bits", node.start_mark)
        return value


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
# Booleans are true and false only, as in YAML 1.2's core schema. YAML 1.1 also reads yes/no/on/off as booleans,
# which turned a field of words (`causal_context: on`) into true; a boolean field still takes those words as
# text, since pydantic reads yes/no/on/off as booleans.
_ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))  # fmt: skip


def _check_tree(root: yaml.Node) -> None:
    """Refuse duplicate keys, recursive aliases, deep nesting, alias expansion beyond MAX_YAML_VALUES and tags
    other than the plain ones (PLAIN_TAGS).

    Sizes are memoised per node, so a shared (aliased) node is walked once however often it is used."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise _Refused(None, None, "an alias refers to the node that contains it", node.start_mark)
        if depth > MAX_YAML_DEPTH:
            raise _Refused(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", node.start_mark)
        active.add(key)
        _check_tag(node)
        if isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(node)
            children = [child for pair in node.value for child in pair]
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else []
        total = 1 + sum(size(child, depth + 1) for child in children)
        active.discard(key)
        if total > MAX_YAML_VALUES:
            problem = f"expands to more than {MAX_YAML_VALUES:,} values through aliases; write it out without them"
            raise _Refused(None, None, problem, node.start_mark)
        sizes[key] = total
        return total

    size(root, 0)


def _check_tag(node: yaml.Node) -> None:
    if node.tag in PLAIN_TAGS:
        return
    name = node.tag.replace("tag:yaml.org,2002:", "!!")
    if isinstance(node, yaml.ScalarNode):
        problem = f"a {name} value ({node.value[:40]!r}) is not read in configs; write plain text (quoted), a number, "
        raise _Refused(None, None, problem + "true/false or null", node.start_mark)
    raise _Refused(None, None, f"a {name} is not read in configs; write a plain list or mapping", node.start_mark)


def _check_duplicate_keys(node: yaml.MappingNode) -> None:
    first: dict[tuple[str, str], int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue
        line = key_node.start_mark.line + 1
        seen = first.setdefault((key_node.tag, key_node.value), line)
        if seen != line:
            raise _Refused(
                None, None, f"duplicate key {key_node.value!r} (first on line {seen}); keep one", key_node.start_mark
            )


def parse_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """Parse one YAML document with the checks above; raises yaml.YAMLError (with a mark when known)."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _check_tree(node)
        return loader.construct_document(node), node
    except RecursionError:
        raise _Refused(None, None, "nested too deeply", None) from None
    finally:
        loader.dispose()


def _read_text(path: Path) -> str:
    """The file as text: UTF-8 (a leading byte-order mark is dropped), else one line naming the byte."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config ({e.strerror})") from None
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the config as UTF-8"
        ) from None


def read_yaml(path: Path) -> tuple[dict[str, Any], yaml.Node | None]:
    """Parse a YAML mapping; returns the data and its node tree (for line numbers)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data, node = parse_yaml(_read_text(path))
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
            value = parse_yaml(raw)[0] if raw.strip() else None
        except _Refused as e:
            raise ConfigError(f"--set {key}: {e.problem}") from None
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
    blamed = _overridden_key(dotted, overridden or set())
    if blamed == dotted:
        return f"--set {dotted}: {msg}"
    if blamed is not None:  # a section-level rule that an override broke: name the override, not the file
        return f"--set {blamed}: {dotted}: {msg}"
    line = _field_line(node, loc) if loc else None
    where = f"{source}:{line}" if line else source
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem(s))"
    return f"{where}: {dotted}: {msg}"


def _overridden_key(dotted: str, overridden: set[str]) -> str | None:
    """The `--set` key behind an error at `dotted`: the same field, one inside it, or a section holding it."""
    for key in sorted(overridden):
        if key == dotted or key.startswith(dotted + ".") or dotted.startswith(key + "."):
            return key
    return None


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
