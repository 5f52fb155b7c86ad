"""Render a config as YAML with each key's one-line description as a comment above it."""

from __future__ import annotations

import typing
from typing import Any

import yaml
from pydantic import BaseModel


def section_classes(annotation: Any) -> list[type[BaseModel]]:
    """Every config section class inside an annotation (T, T | None, list[T], a tagged union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in section_classes(arg)]


def _section_class(annotation: Any, value: Any = None) -> type[BaseModel] | None:
    """The section class for `value`: in a tagged union, the member whose kind/name matches."""
    members = section_classes(annotation)
    if isinstance(value, dict):
        for cls in members:
            for tag in ("kind", "name"):
                f = cls.model_fields.get(tag)
                is_literal = f is not None and typing.get_origin(f.annotation) is typing.Literal
                if is_literal and value.get(tag, f.default) in typing.get_args(f.annotation):
                    return cls
    return members[0] if members else None


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text[: -len("...")].strip() if text.endswith("...") else text


def render_commented(cls: type[BaseModel], values: dict[str, Any], indent: int = 0) -> list[str]:
    lines: list[str] = []
    pad = " " * indent
    for key, value in values.items():
        field = cls.model_fields[key]
        if field.description:
            lines += [f"{pad}# {line.strip()}" for line in field.description.splitlines()]
        sub = _section_class(field.annotation, value)
        if sub is not None and isinstance(value, (dict, list)) and not value:
            lines.append(f"{pad}{key}: {'{}' if isinstance(value, dict) else '[]'}")
        elif sub is not None and isinstance(value, dict):
            lines.append(f"{pad}{key}:")
            lines += render_commented(sub, value, indent + 2)
        elif sub is not None and isinstance(value, list):
            lines.append(f"{pad}{key}:")
            for item in value:
                item_lines = render_commented(_section_class(field.annotation, item) or sub, item, indent + 4)
                first = next(i for i, ln in enumerate(item_lines) if not ln.lstrip().startswith("#"))
                item_lines[first] = f"{pad}  - {item_lines[first].lstrip()}"
                lines += item_lines
        else:
            lines.append(f"{pad}{key}: {_scalar(value)}")
    return lines


def commented_yaml(cls: type[BaseModel], values: dict[str, Any], header: str = "") -> str:
    body = "\n".join(render_commented(cls, values))
    head = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return head + body + "\n"
