"""A small, safe expression language for flows: paths, literals, comparisons, boolean logic. Never eval.

``steps.lookup.result.city == 'Paris' and len(steps.search.result) > 0``. Names are looked up in the
scope (``args``, ``steps``, a ``for_each`` item); ``.name`` and ``[key]`` read mapping keys and list
items only (never Python attributes); a missing key reads as ``null``. Templates put ``{{ expr }}`` in
strings: a string that is one whole template keeps the value's type, otherwise values are interpolated.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from broker.errors import FlowError

_TOKEN = re.compile(
    r"""\s*(?:
    (?P<num>\d+(?:\.\d+)?)
  | (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
  | (?P<op>==|!=|<=|>=|<|>|\(|\)|\[|\]|\.|,|\+|-)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)
_TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
_CONSTANTS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_KEYWORDS = {"and", "or", "not", "in"}
_COMPARE = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt,
    "<=": operator.le, ">": operator.gt, ">=": operator.ge,
}


def _length(v: Any) -> int:
    if not isinstance(v, str | list | dict):
        raise FlowError(f"len() of a {type(v).__name__}")
    return len(v)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "len": _length,
    "lower": lambda s: str(s).lower(),
    "upper": lambda s: str(s).upper(),
    "str": _text,
    "int": lambda v: int(v),
    "float": lambda v: float(v),
}

Node = tuple[Any, ...]


def _tokens(text: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise FlowError(f"expression {text!r}: unexpected {text[pos:].strip()[:20]!r}")
        pos = m.end()
        kind, raw = m.lastgroup, m.group(m.lastgroup or 0)
        if kind == "num":
            out.append(("lit", float(raw) if "." in raw else int(raw)))
        elif kind == "str":
            out.append(("lit", _unquote(raw)))
        elif kind == "op" or raw in _KEYWORDS:
            out.append(("op", raw))
        elif raw in _CONSTANTS:
            out.append(("lit", _CONSTANTS[raw]))
        else:
            out.append(("name", raw))
    return out


def _unquote(raw: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), raw[1:-1])


class _Parser:
    """Precedence climbing: or < and < not < comparison < + - < unary < postfix."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def error(self, what: str) -> FlowError:
        return FlowError(f"expression {self.text!r}: {what}", expression=self.text)

    def peek(self, value: str) -> bool:
        return self.i < len(self.toks) and self.toks[self.i] == ("op", value)

    def accept(self, value: str) -> bool:
        """Consume the operator ``value`` if it comes next."""
        if self.peek(value):
            self.i += 1
            return True
        return False

    def take(self, value: str) -> None:
        if not self.accept(value):
            raise self.error(f"expected {value!r}")

    def parse(self) -> Node:
        if not self.toks:
            raise self.error("empty")
        node = self.or_()
        if self.i != len(self.toks):
            raise self.error(f"unexpected {self.toks[self.i][1]!r}")
        return node

    def or_(self) -> Node:
        node = self.and_()
        while self.accept("or"):
            node = ("or", node, self.and_())
        return node

    def and_(self) -> Node:
        node = self.not_()
        while self.accept("and"):
            node = ("and", node, self.not_())
        return node

    def not_(self) -> Node:
        if self.accept("not"):
            return ("not", self.not_())
        return self.compare()

    def compare(self) -> Node:
        node = self.sum()
        for op in ("==", "!=", "<=", ">=", "<", ">", "in"):
            if self.accept(op):
                return ("cmp", op, node, self.sum())
        if self.peek("not") and self.i + 1 < len(self.toks) and self.toks[self.i + 1] == ("op", "in"):
            self.i += 2
            return ("not", ("cmp", "in", node, self.sum()))
        return node

    def sum(self) -> Node:
        node = self.unary()
        while self.peek("+") or self.peek("-"):
            op = self.toks[self.i][1]
            self.i += 1
            node = ("arith", op, node, self.unary())
        return node

    def unary(self) -> Node:
        if self.accept("-"):
            return ("neg", self.unary())
        return self.postfix()

    def postfix(self) -> Node:
        node = self.primary()
        while True:
            if self.accept("."):
                if self.i >= len(self.toks) or self.toks[self.i][0] != "name":
                    raise self.error("expected a name after '.'")
                node = ("get", node, ("lit", self.toks[self.i][1]))
                self.i += 1
            elif self.accept("["):
                key = self.or_()
                self.take("]")
                node = ("get", node, key)
            else:
                return node

    def primary(self) -> Node:
        if self.i >= len(self.toks):
            raise self.error("ends too early")
        kind, v = self.toks[self.i]
        self.i += 1
        if kind == "lit":
            return ("lit", v)
        if kind == "name":
            if self.peek("("):
                if v not in FUNCTIONS:
                    raise self.error(f"unknown function {v!r} (known: {', '.join(sorted(FUNCTIONS))})")
                self.i += 1
                args = [] if self.peek(")") else self.items()
                self.take(")")
                return ("call", v, *args)
            return ("name", v)
        if v == "(":
            node = self.or_()
            self.take(")")
            return node
        if v == "[":
            items = [] if self.peek("]") else self.items()
            self.take("]")
            return ("list", *items)
        raise self.error(f"unexpected {v!r}")

    def items(self) -> list[Node]:
        out = [self.or_()]
        while self.accept(","):
            out.append(self.or_())
        return out


MAX_CHARS = 1000  # an expression's length at most (its parser and evaluator recurse with its nesting)


def _too_deep(text: str) -> FlowError:
    """What a RecursionError in parsing, checking or evaluating ``text`` becomes."""
    return FlowError(f"expression {text[:40]!r}...: nested too deeply", expression=text)


class Expression:
    """A parsed expression; ``evaluate(scope)`` reads only the scope's data."""

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        if len(self.text) > MAX_CHARS:
            raise FlowError(
                f"expression {self.text[:40]!r}...: {len(self.text)} characters, more than {MAX_CHARS}",
                expression=self.text[:MAX_CHARS],
            )
        try:
            self.tree = _Parser(self.text).parse()
        except RecursionError:
            raise _too_deep(self.text) from None

    def __repr__(self) -> str:
        return f"Expression({self.text!r})"

    def evaluate(self, scope: dict[str, Any]) -> Any:
        try:
            return _eval(self.tree, scope)
        except (FlowError, TypeError, ValueError, ArithmeticError) as e:  # (int(1e999): OverflowError)
            raise FlowError(f"expression {self.text!r}: {e}", expression=self.text) from e
        except RecursionError:
            raise _too_deep(self.text) from None


def _eval(n: Node, scope: dict[str, Any]) -> Any:
    op = n[0]
    if op == "lit":
        return n[1]
    if op == "name":
        if n[1] not in scope:
            raise FlowError(f"unknown name {n[1]!r} (known: {', '.join(sorted(scope))})")
        return scope[n[1]]
    if op == "get":
        base, key = _eval(n[1], scope), _eval(n[2], scope)
        if isinstance(base, dict):
            return base.get(key)
        if isinstance(base, list) and isinstance(key, int) and not isinstance(key, bool):
            return base[key] if -len(base) <= key < len(base) else None
        return None
    if op == "and":
        return bool(_eval(n[1], scope)) and bool(_eval(n[2], scope))
    if op == "or":
        return bool(_eval(n[1], scope)) or bool(_eval(n[2], scope))
    if op == "not":
        return not _eval(n[1], scope)
    if op == "neg":
        return -_number(_eval(n[1], scope))
    if op == "list":
        return [_eval(c, scope) for c in n[1:]]
    if op == "call":
        return FUNCTIONS[n[1]](*(_eval(c, scope) for c in n[2:]))
    if op == "arith":
        a, b = _eval(n[2], scope), _eval(n[3], scope)
        if n[1] == "+" and isinstance(a, str) and isinstance(b, str):
            return a + b
        return _number(a) + _number(b) if n[1] == "+" else _number(a) - _number(b)
    a, b = _eval(n[2], scope), _eval(n[3], scope)
    if n[1] == "in":
        return a in b if isinstance(b, str | list | dict) else False
    if n[1] not in ("==", "!=") and (a is None or b is None):
        return False  # an ordering against a missing value is never true
    return _COMPARE[n[1]](a, b)


def _number(v: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise FlowError(f"expected a number, got {v!r}")
    return v


# -- templates ---------------------------------------------------------------------------------------


def compile_template(value: Any) -> Any:
    """Parse every ``{{ expr }}`` in a value (nested mappings and lists too) once, up front."""
    if isinstance(value, str):
        parts = _TEMPLATE.split(value)
        if len(parts) == 1:
            return value
        if len(parts) == 3 and parts[0] == "" and parts[2] == "":
            return Expression(parts[1])  # the whole string: keep the value's own type
        return _Interpolated([Expression(p) if i % 2 else p for i, p in enumerate(parts)])
    if isinstance(value, dict):
        return {k: compile_template(v) for k, v in value.items()}
    if isinstance(value, list):
        return [compile_template(v) for v in value]
    return value


class _Interpolated:
    """A string with templates inside: its text parts and expressions, in order."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    def render(self, scope: dict[str, Any]) -> str:
        return "".join(_text(p.evaluate(scope)) if isinstance(p, Expression) else p for p in self.parts)


def expressions(compiled: Any) -> Iterator[Expression]:
    """Every expression of a compiled template (or the expression itself)."""
    if isinstance(compiled, Expression):
        yield compiled
    elif isinstance(compiled, _Interpolated):
        yield from (p for p in compiled.parts if isinstance(p, Expression))
    elif isinstance(compiled, dict):
        for v in compiled.values():
            yield from expressions(v)
    elif isinstance(compiled, list):
        for v in compiled:
            yield from expressions(v)


def check_names(
    expr: Expression, names: AbstractSet[str], step_ids: AbstractSet[str], ended: AbstractSet[str] | None = None
) -> None:
    """FlowError unless every name ``expr`` reads is one of ``names`` and every ``steps.<id>`` it reads
    (a literal id) is a step of the flow, one of ``ended`` when given (those ended before it is evaluated):
    a typo or a forward reference shows at ``flow check``, not as a failed run or a null."""

    def walk(n: Node) -> None:
        if n[0] == "name" and n[1] not in names:
            raise FlowError(f"expression {expr.text!r}: unknown name {n[1]!r} (known here: {', '.join(sorted(names))})",
                            expression=expr.text)
        step = n[2][1] if n[0] == "get" and n[1] == ("name", "steps") and n[2][0] == "lit" else None
        if step is not None and step not in step_ids:
            raise FlowError(f"expression {expr.text!r}: no step {step!r} in this flow "
                            f"(its steps: {', '.join(sorted(step_ids))})", expression=expr.text)
        if step is not None and ended is not None and step not in ended:
            raise FlowError(f"expression {expr.text!r}: step {step!r} has not run yet here (it comes later, runs "
                            "in parallel with this one, or is this step or a group around it)", expression=expr.text)
        for child in n[1:]:
            if isinstance(child, tuple):
                walk(child)

    try:
        walk(expr.tree)
    except RecursionError:
        raise _too_deep(expr.text) from None


def render(compiled: Any, scope: dict[str, Any]) -> Any:
    """Fill a compiled template from the scope."""
    if isinstance(compiled, Expression):
        return compiled.evaluate(scope)
    if isinstance(compiled, _Interpolated):
        return compiled.render(scope)
    if isinstance(compiled, dict):
        return {k: render(v, scope) for k, v in compiled.items()}
    if isinstance(compiled, list):
        return [render(v, scope) for v in compiled]
    return compiled
