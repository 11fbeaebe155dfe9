"""Filling a frozen dataclass without its ``__init__``, for the few built once per call on hot paths.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``; for the envelope a
worker decodes and the audit record it builds for every call, that showed in a profile. ``filler`` makes
them directly: the fields' defaults, fresh values from their default factories (for fields not given),
then the given values. The caller checks the values (required fields present, no unknown ones) first.
With ``workers.shortcuts_off: [frozen]`` it calls the class instead (bench/shortcuts.py measures both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

from . import shortcuts

T = TypeVar("T")


def filler(cls: type[T]) -> Callable[[Mapping[str, Any]], T]:
    """``make(values)``: an instance of the frozen dataclass ``cls`` holding ``values`` over its defaults."""
    defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}  # type: ignore[arg-type]
    factories = tuple((f.name, f.default_factory) for f in fields(cls) if f.default_factory is not MISSING)  # type: ignore[arg-type]

    def make(values: Mapping[str, Any]) -> T:
        if not shortcuts.on("frozen"):
            return cls(**values)
        obj = object.__new__(cls)
        held = obj.__dict__
        held.update(defaults)
        for name, factory in factories:
            if name not in values:
                held[name] = factory()
        held.update(values)
        return obj

    return make
