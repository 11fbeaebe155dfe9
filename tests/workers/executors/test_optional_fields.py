"""A field the schema does not require, left out by the caller (review 17, D12): it drops out, or reads as ""."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from broker.errors import InvalidArgs
from broker.placeholders import OMIT, fill, fill_structure, optional
from broker.toolspec import ToolSpec
from workers.executors import command, database
from workers.executors import http as httpexec
from workers.executors.http import parse_body
from workers.specs import check_spec

from . import test_http

RECORDER = str(Path(__file__).with_name("argv_recorder.py"))
PY = sys.executable
# The seed's get_weather: city required, unit optional.
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
SEED_TEMPLATE = "{query: {{city}}, opts: {unit: {{unit}}}}"


# The same loopback back end and guarded executor as test_http (module-scoped there, here too).
server = test_http.server
ex = test_http.ex


def http_spec(**config: Any) -> ToolSpec:
    return check_spec({"name": "get_weather", "executor": "http", "input_schema": WEATHER, **config})


# -- the template rules ----------------------------------------------------------------------------


def test_optional_means_declared_and_not_required() -> None:
    assert optional(WEATHER, "unit") and not optional(WEATHER, "city")
    assert not optional(WEATHER, "undeclared") and not optional({"type": "object"}, "unit")
    assert not optional(None, "unit")
    nested = {
        "type": "object",
        "properties": {
            "opts": {"type": "object", "properties": {"unit": {}, "lang": {}}, "required": ["lang"]},
            "must": {"type": "object", "properties": {"x": {}}, "required": ["x"]},
        },
        "required": ["must"],
    }
    assert optional(nested, "opts.unit") and optional(nested, "opts.lang")  # opts itself is optional
    assert not optional(nested, "must.x") and not optional(nested, "opts.nope")


def test_the_seeds_template_without_the_optional_unit_leaves_it_out() -> None:
    structure = parse_body(SEED_TEMPLATE, "w")
    assert fill_structure(structure, {"city": "北京"}, "w", WEATHER) == {"query": "北京", "opts": {}}
    assert fill_structure(structure, {"city": "北京", "unit": "celsius"}, "w", WEATHER) == {
        "query": "北京",
        "opts": {"unit": "celsius"},
    }


def test_list_items_drop_out_and_text_reads_empty() -> None:
    structure = parse_body("{tags: [{{city}}, {{unit}}, x], note: 'in {{unit}} units'}", "w")
    assert fill_structure(structure, {"city": "a"}, "w", WEATHER) == {"tags": ["a", "x"], "note": "in  units"}
    assert fill("u={{unit}}", {}, "w", schema=WEATHER) == "u="


def test_an_explicit_null_in_a_structure_stays_null() -> None:
    structure = parse_body(SEED_TEMPLATE, "w")
    assert fill_structure(structure, {"city": "a", "unit": None}, "w", WEATHER) == {
        "query": "a",
        "opts": {"unit": None},
    }


def test_a_missing_required_field_is_still_the_callers_mistake() -> None:
    structure = parse_body(SEED_TEMPLATE, "w")
    with pytest.raises(InvalidArgs, match=r"no value for placeholder \{\{city\}\}"):
        fill_structure(structure, {"unit": "celsius"}, "w", WEATHER)
    with pytest.raises(InvalidArgs, match="city"):
        fill("q={{city}}", {}, "w", schema=WEATHER)


def test_without_a_schema_every_missing_field_is_an_error_as_before() -> None:
    with pytest.raises(InvalidArgs, match="unit"):
        fill_structure(parse_body(SEED_TEMPLATE, "w"), {"city": "a"}, "w")
    assert fill_structure("{{unit}}", {}, "w", WEATHER) is OMIT


# -- the http executor -----------------------------------------------------------------------------


def test_http_body_template_with_the_optional_unit_left_out(ex, server, make_ctx) -> None:
    s = http_spec(method="POST", endpoint=f"{server.base}/search", body_template=SEED_TEMPLATE)
    out = ex.run(s, {"city": "北京"}, make_ctx())
    assert json.loads(out["body"]) == {"query": "北京", "opts": {}}
    with pytest.raises(InvalidArgs, match="city"):
        ex.run(s, {"unit": "celsius"}, make_ctx())


def test_http_the_seeds_template_from_executor_settings(server, make_ctx) -> None:
    # The reviewer's setup: executors.http.body_template in config.yaml, the seed's get_weather spec.
    executor = httpexec.HttpExecutor({"allow_networks": ["127.0.0.1/32"], "body_template": SEED_TEMPLATE})
    try:
        out = executor.run(
            http_spec(method="POST", endpoint=f"{server.base}/w"), {"city": "北京"}, make_ctx()
        )
    finally:
        executor.close()
    assert json.loads(out["body"]) == {"query": "北京", "opts": {}}


def test_http_a_template_that_is_only_the_left_out_field_sends_no_body(ex, server, make_ctx) -> None:
    s = http_spec(method="POST", endpoint=f"{server.base}/nobody", body_template="{{unit}}")
    out = ex.run(s, {"city": "a"}, make_ctx())
    assert out["body"] == ""


def test_http_headers_and_query_parameters_of_a_left_out_field_are_omitted(ex, server, make_ctx) -> None:
    s = http_spec(
        endpoint=f"{server.base}/q?city={{{{city}}}}&unit={{{{unit}}}}&label=u-{{{{unit}}}}",
        headers={"X-Unit": "{{unit}}", "X-Note": "unit={{unit}}", "X-City": "{{city}}"},
    )
    out = ex.run(s, {"city": "Beijing"}, make_ctx())
    assert out["query"] == [["city", "Beijing"], ["label", "u-"]]
    assert "x-unit" not in out["headers"] and out["headers"]["x-note"] == "unit="
    assert out["headers"]["x-city"] == "Beijing"
    full = ex.run(s, {"city": "Beijing", "unit": "celsius"}, make_ctx())
    assert full["query"] == [["city", "Beijing"], ["unit", "celsius"], ["label", "u-celsius"]]
    assert full["headers"]["x-unit"] == "celsius"
    with pytest.raises(InvalidArgs, match="city"):
        ex.run(s, {"unit": "celsius"}, make_ctx())


def test_http_a_left_out_field_in_the_path_reads_empty(ex, server, make_ctx) -> None:
    out = ex.run(http_spec(endpoint=f"{server.base}/w/{{{{unit}}}}/x"), {"city": "a"}, make_ctx())
    assert out["raw_path"] == "/w//x"


# -- command: env_set follows the rule, argv does not ----------------------------------------------


def test_command_env_set_of_a_left_out_field_is_not_set(make_ctx) -> None:
    s = check_spec(
        {
            "name": "c",
            "executor": "command",
            "command": [PY, RECORDER, "{{city}}"],
            "env_set": {"UNIT": "{{unit}}", "LABEL": "u-{{unit}}"},
            "input_schema": WEATHER,
            "output": "json",
        }
    )
    out = command.CommandExecutor({}).run(s, {"city": "北京"}, make_ctx())
    assert "UNIT" not in out["env"] and out["env"]["LABEL"] == "u-"
    assert out["argv"] == ["北京"]


def test_command_argv_still_wants_every_value(make_ctx) -> None:
    s = check_spec(
        {"name": "c", "executor": "command", "command": "echo {{city}} {{unit}}", "input_schema": WEATHER}
    )
    with pytest.raises(InvalidArgs, match="unit"):
        command.CommandExecutor({}).run(s, {"city": "北京"}, make_ctx())


# -- database: a left-out optional parameter binds NULL --------------------------------------------


def test_database_optional_parameter_binds_null(tmp_path, make_ctx) -> None:
    dsn = f"sqlite:///{tmp_path / 'w.sqlite'}"
    engine = sa.create_engine(dsn)
    with engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE w (city TEXT, unit TEXT, temp INTEGER)")
        c.exec_driver_sql("INSERT INTO w VALUES ('北京', 'celsius', 21), ('北京', 'fahrenheit', 70)")
    engine.dispose()
    s = check_spec(
        {
            "name": "d",
            "executor": "database",
            "dsn": dsn,
            "query": "SELECT temp FROM w WHERE city = :city AND (:unit IS NULL OR unit = :unit) ORDER BY temp",
            "input_schema": WEATHER,
        }
    )
    ex = database.DatabaseExecutor({})
    try:
        assert ex.run(s, {"city": "北京"}, make_ctx()) == [{"temp": 21}, {"temp": 70}]
        assert ex.run(s, {"city": "北京", "unit": "celsius"}, make_ctx()) == [{"temp": 21}]
        with pytest.raises(InvalidArgs, match=":city"):
            ex.run(s, {"unit": "celsius"}, make_ctx())
    finally:
        ex.close()
