"""Registries: one per kind of extension point (objective, schedule, policy, source, backend, ...).

A registry is declared in one place (src/dllm/config/registries.py) as `name -> "module:object"`
entries, so the config's allowed values are the registry's names (`Literal[REG.names()]`) without
config importing the layers above it. The implementation is imported the first time a name is
resolved, which happens once, when a run, a model or a sampler is assembled; after that code holds
objects. Adding an implementation is its own file plus one entry.

An entry may carry tags: facts about the implementation the config needs before anything is
imported (a block objective, a policy that follows a step schedule), read with `names(tag)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """Where one implementation lives (`module:object`, the module relative to the registry's part)."""

    target: str
    tags: frozenset[str] = frozenset()

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2]


def entry(target: str, *tags: str) -> Entry:
    """`entry("objectives.block:BD3LMObjective", "block")`: a target with tags."""
    return Entry(target, frozenset(tags))


class Registry(Generic[T]):
    """A name -> implementation map for one kind of extension point, resolved lazily.

    `part` is the subpackage of dllm every target lives in (tests/test_architecture.py checks it),
    so an entry `"objectives.mdlm:MDLMObjective"` of part `diffusion` is
    `dllm.diffusion.objectives.mdlm.MDLMObjective`.
    """

    def __init__(self, kind: str, part: str, entries: Mapping[str, str | Entry]) -> None:
        self.kind = kind
        self.part = part
        self._entries = {name: e if isinstance(e, Entry) else Entry(e) for name, e in entries.items()}
        for name, e in self._entries.items():
            assert ":" in e.target, f"{kind} {name!r}: target {e.target!r} is not 'module:object'"
        self._resolved: dict[str, T] = {}

    def names(self, tag: str | None = None) -> tuple[str, ...]:
        """The registered names in declaration order (only those with `tag`, if given)."""
        return tuple(n for n, e in self._entries.items() if tag is None or tag in e.tags)

    def has(self, name: str, tag: str) -> bool:
        """Whether `name` is registered and carries `tag`."""
        e = self._entries.get(name)
        return e is not None and tag in e.tags

    def module_of(self, name: str) -> str:
        """The absolute module path of `name`'s implementation."""
        return f"dllm.{self.part}.{self._entry(name).module}"

    def resolve(self, name: str) -> T:
        """The implementation registered as `name` (imported on first use); raises on an unknown name."""
        if name not in self._resolved:
            obj: Any = importlib.import_module(self.module_of(name))
            for attr in self._entry(name).attribute.split("."):
                obj = getattr(obj, attr)
            self._resolved[name] = obj
        return self._resolved[name]

    def _entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(self._entries)
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
