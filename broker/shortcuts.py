"""Switches for the speed shortcuts that have a stock twin, so each can be measured on and off
(``bench/shortcuts.py``) and turned off where it misbehaves: ``workers.shortcuts_off`` in config.yaml, a
list of names. A worker process sets them once (``configure``) before it runs a call; all are on by
default. Each shortcut asks ``on(name)`` in its own module:

- ``threads``: a worker's call threads (``workers/worker.py``) instead of a ``ThreadPoolExecutor``;
- ``quickcheck``: the compiled quick check of common argument schemas (``workers/args.py``) before
  the full JSON Schema validator;
- ``frozen``: the envelope and audit record filled without their dataclass ``__init__`` (``broker/frozen.py``);
- ``redaction``: the log lines' redaction processor that skips ids and remembers short strings
  (``broker/logs.redact_event``) instead of ``broker.redact.RedactProcessor``.

The two shortcuts on library insides have settings of their own: ``broker.fast_path`` (``broker/pipes.py``)
and ``telemetry.lean_spans`` (``workers/spans.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ConfigError

NAMES = ("threads", "quickcheck", "frozen", "redaction")

_off: frozenset[str] = frozenset()


def check(names: Iterable[str], where: str = "workers.shortcuts_off") -> frozenset[str]:
    """The names as a set; ConfigError naming any that is not a shortcut."""
    found = frozenset(str(n).strip() for n in names if str(n).strip())
    unknown = sorted(found - set(NAMES))
    if unknown:
        raise ConfigError(f"{where}: unknown shortcut(s) {', '.join(unknown)}; known: {', '.join(NAMES)}")
    return found


def configure(off: Iterable[str]) -> None:
    """Turn off the shortcuts named (and every other one on)."""
    global _off
    _off = check(off)


def on(name: str) -> bool:
    """Whether the shortcut ``name`` is in use in this process."""
    return name not in _off
