"""The quick schema check never accepts what the full Draft 2020-12 validator rejects."""

from __future__ import annotations

import random
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from broker.errors import InvalidArgs
from workers import args as args_mod
from workers.args import quick_check

LEAVES: list[dict[str, Any]] = [
    {"type": "string"},
    {"type": "integer"},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "null"},
    {"type": ["string", "null"]},
    {"type": "integer", "minimum": 0, "maximum": 10},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1.5},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"enum": ["a", "b", 1, None]},
    {"enum": [1.0, True]},
    {"const": 0},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array"},
    {},
    {"description": "anything at all"},
]

VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 2, 10, 11, 0.0, 1.0, 1.5, 2.5, -0.5, float("nan"), float("inf"),
    "", "a", "b", "ab", "abcd", "abcde", "1", "true", b"bytes",
    [], [1], [1, 2, 3, 4], ["x"], [True], [1.0], {}, {"k": 1},
]  # fmt: skip


def schema_of(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    if depth >= 2 or rng.random() < 0.4:
        return dict(rng.choice(LEAVES))
    props = {name: schema_of(rng, depth + 1) for name in rng.sample(["a", "b", "c", "1"], rng.randint(0, 3))}
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if props and rng.random() < 0.5:
        schema["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
    roll = rng.random()
    if roll < 0.3:
        schema["additionalProperties"] = False
    elif roll < 0.5:
        schema["additionalProperties"] = schema_of(rng, depth + 1)
    if rng.random() < 0.2:
        schema.pop("type")
    return schema


def instance_of(rng: random.Random, depth: int = 0) -> Any:
    if depth >= 2 or rng.random() < 0.5:
        return rng.choice(VALUES)
    return {k: instance_of(rng, depth + 1) for k in rng.sample(["a", "b", "c", "1", "d"], rng.randint(0, 4))}


def test_never_accepts_what_the_full_validator_rejects_and_accepts_most_valid_ones() -> None:
    rng = random.Random(20261203)
    accepted = valid = checked = 0
    for _ in range(400):
        schema = schema_of(rng)
        quick = quick_check(schema)
        assert quick is not None, schema  # every keyword used here is covered
        full = Draft202012Validator(schema)
        for _ in range(40):
            instance = instance_of(rng)
            ok = full.is_valid(instance)
            fast = quick(instance)
            checked += 1
            valid += ok
            accepted += fast
            assert ok or not fast, (schema, instance)
    assert checked == 16_000
    assert accepted > 0.9 * valid  # "not sure" stays rare for valid arguments (True == 1 and the like)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "email"},  # format is asserted by our validator
        {"type": "string", "pattern": "^a"},
        {"$ref": "#/$defs/x", "$defs": {"x": {"type": "string"}}},
        {"anyOf": [{"type": "string"}]},
        {"type": "object", "patternProperties": {"^a": {"type": "string"}}},
        {"type": "array", "prefixItems": [{"type": "string"}]},
        {"type": "object", "properties": {"a": {"type": "string", "format": "uri"}}},
        {"type": "widget"},
        {"enum": [[1, 2]]},
    ],
)
def test_schemas_outside_the_covered_keywords_get_no_quick_check(schema: dict[str, Any]) -> None:
    assert quick_check(schema) is None


def test_python_equality_is_not_json_schema_equality() -> None:
    integer = quick_check({"type": "integer"})
    assert integer is not None and not integer(True) and integer(3) and integer(3.0) and not integer(3.5)
    enum = quick_check({"enum": [1]})
    assert enum is not None and not enum(True) and not enum(1.0) and enum(1)


def test_validate_args_still_reports_every_violation_when_the_quick_check_is_not_sure() -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1}, "s": {"type": "string"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    args_mod.validate_args(schema, {"n": 2, "s": "x"})  # quick path: no error
    with pytest.raises(InvalidArgs) as e:
        args_mod.validate_args(schema, {"n": 0, "s": 1, "x": None})
    assert e.value.details["violations"] == [
        "$: Additional properties are not allowed ('x' was unexpected)",
        "$.n: 0 is less than the minimum of 1",
        "$.s: 1 is not of type 'string'",
    ]


def test_an_invalid_schema_is_still_refused_before_any_quick_check() -> None:
    from broker.errors import InvalidSpec

    with pytest.raises(InvalidSpec):
        args_mod.validate_args({"type": "object", "required": "n"}, {"n": 1})


def test_values_that_are_not_plain_json_data_are_never_certainly_valid() -> None:
    import collections
    import decimal
    import enum
    import fractions

    class Big(enum.IntEnum):
        HUNDRED = 100

    class Name(str):
        pass

    bounded = {"type": "object", "properties": {"count": {"maximum": 10}, "name": {"maxLength": 2}}}
    check = quick_check(bounded)
    assert check is not None and check({"count": 5, "name": "ab"})
    for odd in (
        {"count": Big.HUNDRED},
        {"count": decimal.Decimal(99)},
        {"count": fractions.Fraction(99)},
        {"name": Name("too long")},
        collections.OrderedDict(count=99),
        collections.defaultdict(int, count=99),
        {1: "a non-string key"},
    ):
        assert check(odd) is False, odd
    required = quick_check({"required": ["x"]})
    assert required is not None and not required(collections.OrderedDict())
    # ... and the full validator then judges them: what jsonschema rejects is still refused.
    with pytest.raises(InvalidArgs):
        args_mod.validate_args(bounded, {"count": Big.HUNDRED})
    with pytest.raises(InvalidArgs):
        args_mod.validate_args(bounded, {"count": decimal.Decimal(99)})
