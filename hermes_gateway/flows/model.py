"""A flow: steps run in order. A step is a tool call (``tool``, ``args``, ``when``, ``fallback``: skip or
{tool, args}, ``on_error``, ``timeout``), a parallel fan-out (``parallel``), a serial group (``steps``) or a
tool call per item (``for_each``, ``as``); ``result`` templates the flow's result. Written as a YAML or JSON
document (docs/flow-control.md) or built with :class:`Flow` (``step``, ``parallel``, ``for_each``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from broker.errors import FlowError, UnknownTool

from .expr import Expression, check_names, compile_template, expressions

_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
SCOPE = frozenset({"args", "steps"})  # the names every expression of a flow may read (flows/engine.py)
ON_ERROR = ("fail", "continue")
_STEP_KEYS = {
    "id", "tool", "args", "when", "fallback", "on_error", "timeout", "parallel", "steps", "for_each", "as"
}


@dataclass(frozen=True)
class Fallback:
    """What to do when a step's tool has its circuit breaker open: call ``tool`` instead, or skip."""

    tool: str | None = None
    args: Any = None  # None: the step's own arguments

    @property
    def skip(self) -> bool:
        return self.tool is None


@dataclass
class Step:
    """One step. Exactly one of ``tool``, ``parallel`` or ``steps``; ``for_each`` repeats a tool step."""

    id: str
    tool: str | None = None
    args: Any = field(default_factory=dict)
    when: str | None = None
    fallback: Fallback | None = None
    on_error: str = "fail"
    timeout: float | None = None
    parallel: list[Step] | None = None
    steps: list[Step] | None = None
    for_each: str | None = None
    as_name: str = "item"
    # Compiled once by Flow.validate().
    when_expr: Expression | None = field(default=None, repr=False)
    args_tpl: Any = field(default=None, repr=False)
    each_expr: Expression | None = field(default=None, repr=False)
    fallback_tpl: Any = field(default=None, repr=False)

    @property
    def kind(self) -> str:
        if self.parallel is not None:
            return "parallel"
        if self.steps is not None:
            return "group"
        return "for_each" if self.for_each is not None else "tool"

    def children(self) -> list[Step]:
        return list(self.parallel or self.steps or [])

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Step:
        if not isinstance(data, dict):
            raise FlowError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = set(data) - _STEP_KEYS
        if unknown:
            raise FlowError(
                f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_STEP_KEYS))}"
            )
        sid = data.get("id")
        where = f"{where} ({sid})" if sid else where
        fb = data.get("fallback")
        fallback = None
        if fb == "skip":
            fallback = Fallback()
        elif isinstance(fb, dict) and isinstance(fb.get("tool"), str):
            fallback = Fallback(fb["tool"], fb.get("args"))
        elif fb is not None:
            raise FlowError(f"{where}: fallback: expected 'skip' or {{tool: ..., args: ...}}")
        each = data.get("for_each")
        if isinstance(each, str):
            each = each.strip()
            if each.startswith("{{") and each.endswith("}}"):
                each = each[2:-2]
        return cls(
            id=str(sid) if sid is not None else "",
            tool=data.get("tool"),
            args=data.get("args") if data.get("args") is not None else {},
            when=data.get("when"),
            fallback=fallback,
            on_error=str(data.get("on_error", "fail")),
            timeout=data.get("timeout"),
            parallel=_substeps(data, "parallel", where),
            steps=_substeps(data, "steps", where),
            for_each=each,
            as_name=str(data.get("as") or "item"),
        )


def _substeps(data: dict[str, Any], key: str, where: str) -> list[Step] | None:
    """The steps under ``key`` (``parallel`` or ``steps``), None when the step has no such key."""
    if key not in data:
        return None
    value = data[key]
    if not isinstance(value, list) or not value:
        raise FlowError(f"{where}: {key}: expected a non-empty list of steps")
    return [Step.from_dict(s, f"{where}.{key}[{i}]") for i, s in enumerate(value)]


@dataclass
class Flow:
    """A named list of steps, plus an optional ``result`` template."""

    name: str = "flow"
    steps: list[Step] = field(default_factory=list)
    result: Any = None
    result_tpl: Any = field(default=None, repr=False)

    # -- building in Python ----------------------------------------------------------------------

    def step(self, id: str, tool: str, args: Any = None, **options: Any) -> Flow:
        """Add a tool step (``when=``, ``fallback=`` "skip" or {tool, args}, ``on_error=``, ``timeout=``)."""
        self.steps.append(
            Step.from_dict({"id": id, "tool": tool, "args": args or {}, **options}, f"step {id}")
        )
        return self

    def parallel(self, id: str, branches: list[dict[str, Any] | Step], **options: Any) -> Flow:
        """Add a fan-out: every branch at once, one combined result, failures reported per branch (one fails the
        step unless ``on_error="continue"``: then it is ``partial``)."""
        steps = [b if isinstance(b, Step) else Step.from_dict(b, f"{id} branch") for b in branches]
        step = Step.from_dict({"id": id, **options, "parallel": [{}]}, f"step {id}")
        step.parallel = steps
        self.steps.append(step)
        return self

    def for_each(
        self, id: str, items: str, tool: str, args: Any = None, *, as_name: str = "item", **options: Any
    ) -> Flow:
        """Add a fan-out over a list (``items`` is an expression): one call per item."""
        data = {"id": id, "for_each": items, "as": as_name, "tool": tool, "args": args or {}, **options}
        self.steps.append(Step.from_dict(data, f"step {id}"))
        return self

    # -- documents -------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Any) -> Flow:
        if not isinstance(data, dict):
            raise FlowError(f"flow: expected a mapping, got {type(data).__name__}")
        steps = data.get("steps")
        if not isinstance(steps, list) or not steps:
            raise FlowError("flow: steps: expected a non-empty list")
        return cls(
            name=str(data.get("name") or "flow"),
            steps=[Step.from_dict(s, f"steps[{i}]") for i, s in enumerate(steps)],
            result=data.get("result"),
        ).validate()

    @classmethod
    def load(cls, path: str | Path) -> Flow:
        """Read a flow document (``.json`` or YAML)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise FlowError(f"{p}: {e}") from e
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (ValueError, yaml.YAMLError) as e:
            raise FlowError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from e
        return cls.from_dict(data)

    def validate(self) -> Flow:
        """Check ids and shapes and compile every expression, so mistakes show before any call is made."""
        seen: set[str] = set()
        for step in self.steps:
            _check(step, seen)
        self.result_tpl = compile_template(self.result)
        # What each expression may read: the flow's args, the steps ended before its own starts (by a declared
        # id), and in a for_each step's args (and its fallback's, called per item) its item and index.
        ended: dict[str, frozenset[str]] = {}
        _ended_before(self.steps, frozenset(), ended)
        for step in self.all_steps():
            each = {step.as_name, "index"} if step.each_expr is not None else set()
            for names, compiled in ((SCOPE, step.when_expr), (SCOPE, step.each_expr), (SCOPE | each, step.args_tpl),
                                    (SCOPE | each, step.fallback_tpl)):
                for expr in expressions(compiled):
                    try:
                        check_names(expr, names, seen, ended[step.id])
                    except FlowError as e:
                        raise FlowError(f"step {step.id}: {e}") from e
        for expr in expressions(self.result_tpl):
            check_names(expr, SCOPE, seen)
        return self

    def check_tools(self, known: AbstractSet[str]) -> None:
        """UnknownTool naming the first step whose tool (or fallback tool) is not one of ``known``."""
        for step in self.all_steps():
            for tool in (step.tool, step.fallback.tool if step.fallback else None):
                if tool is not None and tool not in known:
                    raise UnknownTool(f"step {step.id}: unknown tool {tool!r}: it is not in the tool directory",
                                      tool=tool)

    def all_steps(self) -> list[Step]:
        """Every step, nested ones too, each before its children."""
        return list(_walk(self.steps))


def _walk(steps: list[Step]) -> Iterator[Step]:
    for step in steps:
        yield step
        yield from _walk(step.children())


def _ended_before(
    steps: list[Step], ended: frozenset[str], out: dict[str, frozenset[str]], serial: bool = True
) -> frozenset[str]:
    """Put in ``out`` each step's id -> the ids of the steps ended before it starts (not a later one, a parallel
    sibling's, nor its own or its group's); returns the ids ended after ``steps``."""
    after = ended
    for step in steps:
        out[step.id] = after if serial else ended
        after = after | _ended_before(step.children(), out[step.id], out, step.parallel is None) | {step.id}
    return after


def _check(step: Step, seen: set[str]) -> None:
    where = f"step {step.id or '?'}"
    if not step.id or not _ID.match(step.id):
        raise FlowError(f"{where}: id: expected a name like lookup_1 (letters, digits, _ and -)")
    if step.id in seen:
        raise FlowError(f"{where}: id used twice")
    seen.add(step.id)
    shapes = [step.tool is not None, step.parallel is not None, step.steps is not None]
    if sum(shapes) != 1:
        raise FlowError(f"{where}: expected exactly one of tool, parallel, steps")
    if step.tool is not None and not isinstance(step.tool, str):
        raise FlowError(f"{where}: tool: expected a tool name")
    if step.for_each is not None and step.tool is None:
        raise FlowError(f"{where}: for_each repeats a tool step: give it a tool")
    if step.on_error not in ON_ERROR:
        raise FlowError(f"{where}: on_error: expected one of {', '.join(ON_ERROR)}")
    if step.fallback is not None and step.tool is None:
        raise FlowError(f"{where}: fallback applies to tool steps")
    if step.timeout is not None and (
        isinstance(step.timeout, bool) or not isinstance(step.timeout, int | float) or not 0 < step.timeout < 1e9
    ):
        raise FlowError(f"{where}: timeout: expected a number of seconds above 0, got {step.timeout!r}")
    try:
        step.when_expr = Expression(step.when) if step.when else None
        step.each_expr = Expression(step.for_each) if step.for_each else None
        step.args_tpl = compile_template(step.args)
        if step.fallback is not None and step.fallback.args is not None:
            step.fallback_tpl = compile_template(step.fallback.args)
    except FlowError as e:
        raise FlowError(f"{where}: {e}") from e
    for child in step.children():
        _check(child, seen)
