"""Argument handling: Hermes-style coercion, Draft 2020-12 validation listing every violation, parsing."""

from __future__ import annotations

import pytest

from broker.errors import InvalidArgs, InvalidOutput, InvalidSpec
from workers.args import check_output, coerce_args, parse_args_text, validate_args, validator_for, violations

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "ids": {"type": "array", "items": {"type": "integer"}},
        "opts": {
            "type": "object",
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "n": {"type": "integer"},
            },
        },
        "maybe": {"type": ["integer", "null"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}


def test_numeric_and_boolean_strings_are_coerced_where_schema_says():
    out = coerce_args(SCHEMA, {"city": "42", "days": "3", "ratio": "0.5", "metric": "TRUE"})
    assert out == {"city": "42", "days": 3, "ratio": 0.5, "metric": True}


def test_integer_with_fraction_stays_a_string_for_validation_to_reject():
    assert coerce_args(SCHEMA, {"days": "3.5"})["days"] == "3.5"
    assert coerce_args(SCHEMA, {"days": "3.0"})["days"] == 3


def test_big_integers_keep_precision():
    assert coerce_args(SCHEMA, {"days": "12345678901234567891"})["days"] == 12345678901234567891


def test_a_number_the_wire_cannot_carry_stays_a_string_for_validation_to_reject():
    """Past msgpack's 64-bit integers (or Python's digit limit) a coerced integer could not be written: the
    call's end failed to encode and the call ran again every lease. It stays text; the schema refuses it."""
    out = coerce_args(SCHEMA, {"days": "1" + "0" * 30, "ratio": "1e30", "maybe": "9" * 5000})
    assert out["days"] == "1" + "0" * 30 and out["ratio"] == 1e30 and out["maybe"] == "9" * 5000
    assert coerce_args(SCHEMA, {"days": str(2**64 - 1)})["days"] == 2**64 - 1
    with pytest.raises(InvalidArgs):
        validate_args(SCHEMA, {"city": "x", "days": "1" + "0" * 30})
    deep = "[" * 600 + "]" * 600  # (deeper than arguments may nest: not read as JSON)
    assert coerce_args(SCHEMA, {"tags": deep})["tags"] == [deep]


def test_nan_and_inf_are_not_numbers():
    assert coerce_args(SCHEMA, {"ratio": "nan", "days": "inf"}) == {"ratio": "nan", "days": "inf"}


def test_bare_value_is_wrapped_where_an_array_is_expected():
    assert coerce_args(SCHEMA, {"tags": "a"})["tags"] == ["a"]
    assert coerce_args(SCHEMA, {"ids": "7"})["ids"] == [7]
    assert coerce_args(SCHEMA, {"ids": 7})["ids"] == [7]


def test_json_strings_become_arrays_and_objects_and_recurse():
    out = coerce_args(SCHEMA, {"ids": '["1", 2]', "opts": '{"unit": "celsius", "n": "4"}'})
    assert out["ids"] == [1, 2]
    assert out["opts"] == {"unit": "celsius", "n": 4}


def test_nested_properties_are_coerced():
    assert coerce_args(SCHEMA, {"opts": {"n": "5"}})["opts"] == {"n": 5}


def test_null_string_becomes_none_only_where_null_is_allowed():
    assert coerce_args(SCHEMA, {"maybe": "null", "city": "null"}) == {"maybe": None, "city": "null"}


def test_coercion_does_not_mutate_input():
    args = {"days": "3"}
    coerce_args(SCHEMA, args)
    assert args == {"days": "3"}


def test_validation_lists_every_violation_by_path():
    with pytest.raises(InvalidArgs) as info:
        validate_args(SCHEMA, {"days": "x", "opts": {"unit": "kelvin"}, "extra": 1}, tool="get_weather")
    found = info.value.details["violations"]
    assert "$.city: 'city' is a required property" in found
    assert any(v.startswith("$.days: ") for v in found)
    assert any(v.startswith("$.opts.unit: 'kelvin' is not one of") for v in found)
    assert any(v.startswith("$: Additional properties") for v in found)
    assert len(found) == 4
    assert "get_weather" in info.value.message and info.value.type == "invalid_args"


def test_valid_args_pass():
    assert validate_args(SCHEMA, {"city": "北京", "tags": ["x"], "maybe": None}) is None
    assert violations(SCHEMA, {"city": "北京", "tags": ["x"], "maybe": None}) == []


def test_validators_are_cached_by_schema_content():
    assert validator_for(dict(SCHEMA)) is validator_for(dict(SCHEMA))


def test_a_schema_object_seen_before_is_validated_by_its_own_rules():
    first = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    other = {"type": "object", "properties": {"n": {"type": "string"}}, "required": ["n"]}
    for _ in range(2):  # the second round comes from the by-identity cache
        validate_args(first, {"n": 1})
        with pytest.raises(InvalidArgs):
            validate_args(first, {"n": "1"})
        validate_args(other, {"n": "1"})
        with pytest.raises(InvalidArgs):
            validate_args(other, {"n": 1})


def test_invalid_schema_is_a_spec_error():
    with pytest.raises(InvalidSpec):
        validate_args({"type": "not-a-type"}, {})


def test_format_is_checked():
    with pytest.raises(InvalidArgs, match="ipv4"):
        validate_args(
            {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}}}, {"ip": "x"}
        )


def test_check_output_raises_invalid_output():
    schema = {"type": "object", "properties": {"temp": {"type": "number"}}, "required": ["temp"]}
    check_output(schema, {"temp": 3.5})
    with pytest.raises(InvalidOutput) as info:
        check_output(schema, {"temp": "hot"})
    assert info.value.type == "invalid_output"
    assert info.value.details["violations"] == ["$.temp: 'hot' is not of type 'number'"]


def test_parse_args_text_accepts_json_and_yaml_flow():
    assert parse_args_text('{"name": "Alice"}') == {"name": "Alice"}
    assert parse_args_text("{name: Alice}") == {"name": "Alice"}
    assert parse_args_text("{city: 北京, days: 3}") == {"city": "北京", "days": 3}
    assert parse_args_text("") == {}


def test_parse_args_text_keeps_yaml11_words_and_dates_as_strings():
    assert parse_args_text("{answer: no, on: yes, d: 2024-01-01, t: true}") == {
        "answer": "no",
        "on": "yes",
        "d": "2024-01-01",
        "t": True,
    }


def test_parse_args_text_rejects_non_mappings_and_garbage():
    with pytest.raises(InvalidArgs, match="mapping"):
        parse_args_text("[1, 2]")
    with pytest.raises(InvalidArgs, match="mapping"):
        parse_args_text("Alice")
    with pytest.raises(InvalidArgs):
        parse_args_text("{name: [unclosed")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"name": Alice', "expected ',' or '}', but got '<stream end>' at line 1, column 15"),
        ("{name: [}", "expected the node content, but found '}' at line 1, column 9"),
        ('{\n  "a": 1,\n  "b": : 2\n}', "at line 3, column 8"),
    ],
)
def test_unparsable_arguments_are_one_line_naming_the_position(text: str, where: str) -> None:
    with pytest.raises(InvalidArgs) as refused:
        parse_args_text(text)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("arguments are neither JSON nor YAML: "), message
    assert message.endswith(where), message


def test_the_yaml_form_keeps_the_text_typed_where_the_schema_wants_a_string():
    schema = {
        "type": "object",
        "properties": {
            "x": {"type": "string"}, "n": {"type": "integer"}, "zip": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "inner": {"type": "object", "properties": {"flag": {"type": "string"}}},
            "either": {"type": ["string", "integer"]},
        },
    }  # fmt: skip
    typed = "{x: 1, n: 5, zip: 02134, tags: [1, 2.50], inner: {flag: true}, either: 7, other: 3, none: null}"
    assert parse_args_text(typed, schema) == {
        "x": "1", "n": 5, "zip": "02134", "tags": ["1", "2.50"], "inner": {"flag": "true"}, "either": 7,
        "other": 3, "none": None,
    }  # fmt: skip
    assert parse_args_text('{"x": 1}', schema) == {"x": 1}  # JSON says what it means: left to the schema
    assert parse_args_text("{x: 1}") == {"x": 1}  # (no schema: YAML's reading)
