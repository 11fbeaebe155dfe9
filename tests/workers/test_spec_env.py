"""``${VAR}`` in tool specs: filled from the worker's environment before placeholders, never in arguments."""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ExecutorError, InvalidSpec
from broker.toolspec import ToolSpec
from workers import executors as specenv
from workers.executors import ExecContext, command
from workers.specs import check_spec

RECORDER = str(Path(__file__).parent / "executors" / "argv_recorder.py")
PY = sys.executable
TOKEN = "tok-9f8e7d6c5b4a-secret"


def spec(**fields: Any) -> ToolSpec:
    return check_spec({"name": "t", "executor": "command", "command": "echo hi", **fields})


def make_ctx() -> ExecContext:
    messages: list[str] = []
    ctx = ExecContext(call_id="c1", tool_name="t", timeout=10, progress_sink=messages.append)
    ctx.messages = messages  # type: ignore[attr-defined]
    return ctx


@pytest.fixture(autouse=True)
def _fresh_cache() -> Any:
    specenv.clear_cache()
    yield
    specenv.clear_cache()


def test_references_in_the_config_are_filled_and_the_stored_spec_is_left_as_written() -> None:
    s = check_spec(
        {
            "name": "w",
            "executor": "http",
            "endpoint": "http://127.0.0.1/x",
            "headers": {"Authorization": "Bearer ${TOKEN_A}", "X-Region": "${REGION:-eu}"},
            "description": "uses ${TOKEN_A}",
        }
    )
    prepared = specenv.expand_spec(s, {"TOKEN_A": TOKEN})
    assert prepared.spec.config["headers"] == {"Authorization": f"Bearer {TOKEN}", "X-Region": "eu"}
    assert prepared.spec.description == "uses ${TOKEN_A}"  # only the executor's configuration
    assert s.config["headers"]["Authorization"] == "Bearer ${TOKEN_A}"  # the directory's copy is untouched
    assert s.to_dict()["headers"]["Authorization"] == "Bearer ${TOKEN_A}"


def test_lists_and_nested_mappings_are_filled() -> None:
    s = spec(command=[PY, RECORDER, "--dir=${DATA_DIR}"], env_set={"K": "${K_VAL}"})
    prepared = specenv.expand_spec(s, {"DATA_DIR": "/srv/data", "K_VAL": "kv"})
    assert prepared.spec.config["command"][2] == "--dir=/srv/data"
    assert prepared.spec.config["env_set"] == {"K": "kv"}


def test_an_unset_variable_is_a_typed_error_naming_the_key_path_and_the_variable() -> None:
    s = check_spec(
        {"name": "x", "executor": "database", "dsn": "${WEATHER_DB_DSN}", "query": "SELECT 1"}
    )
    with pytest.raises(InvalidSpec) as info:
        specenv.expand_spec(s, {})
    assert str(info.value) == "tool 'x': dsn: ${WEATHER_DB_DSN} is not set in the worker's environment"
    assert info.value.to_wire()["type"] == "invalid_spec"
    assert info.value.details == {"path": "dsn", "variable": "WEATHER_DB_DSN"}
    nested = spec(env_set={"A": "ok", "B": "x-${NOPE}"})
    with pytest.raises(InvalidSpec, match=r"env_set\.B: \$\{NOPE\} is not set"):
        specenv.expand_spec(nested, {})
    listed = spec(command=["echo", "${NOPE}"])
    with pytest.raises(InvalidSpec, match=r"command\[1\]: \$\{NOPE\} is not set"):
        specenv.expand_spec(listed, {})


def test_the_config_expanders_rules_hold_default_and_set_but_empty() -> None:
    s = spec(env_set={"A": "${UNSET_X:-fallback}", "B": "${EMPTY}", "C": "${UNSET_Y:-}"})
    prepared = specenv.expand_spec(s, {"EMPTY": ""})
    assert prepared.spec.config["env_set"] == {"A": "fallback", "B": "", "C": ""}


def test_a_spec_without_references_is_used_as_is() -> None:
    s = spec(command="echo {{name}} $HOME")
    assert specenv.expand_spec(s, {}).spec is s


def test_an_argument_value_that_looks_like_a_reference_stays_literal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hostile: a caller (or a model) sends "${HOME}" and "${SECRET_FOR_TEST}"; neither may be expanded.
    monkeypatch.setenv("SECRET_FOR_TEST", TOKEN)
    monkeypatch.setenv("SPEC_FLAG", "on")
    s = spec(command=[PY, RECORDER, "{{a}}", "x{{b}}y", "--flag=${SPEC_FLAG}"], output="json")
    out = specenv.run_executor(command.CommandExecutor({}), s, {"a": "${HOME}", "b": "${SECRET_FOR_TEST}"}, make_ctx())
    assert out["argv"] == ["${HOME}", "x${SECRET_FOR_TEST}y", "--flag=on"]


def test_a_filled_in_value_is_never_read_as_a_reference_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTER_REF", "${HOME}")
    s = spec(command=[PY, RECORDER, "${OUTER_REF}"], output="json")
    assert specenv.run_executor(command.CommandExecutor({}), s, {}, make_ctx())["argv"] == ["${HOME}"]


def test_prepared_specs_are_cached_per_spec_object(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHED_V", "first-value")
    s = spec(env_set={"V": "${CACHED_V}"})
    first = specenv.prepare(s)
    monkeypatch.setenv("CACHED_V", "second-value")
    assert specenv.prepare(s) is first  # the same version of the spec: not walked again
    again = spec(env_set={"V": "${CACHED_V}"})  # a new version is a new object
    assert specenv.prepare(again).spec.config["env_set"] == {"V": "second-value"}


def test_an_unset_variable_is_not_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LATE_VAR", raising=False)
    s = spec(env_set={"V": "${LATE_VAR}"})
    with pytest.raises(InvalidSpec):
        specenv.prepare(s)
    monkeypatch.setenv("LATE_VAR", "now-set")
    assert specenv.prepare(s).spec.config["env_set"] == {"V": "now-set"}


class _Leaky:
    """An executor whose errors and progress quote its configuration, as real ones can."""

    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.seen: dict[str, Any] = {}

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        self.seen = dict(spec.config)
        dsn = spec.config["dsn"]
        ctx.progress(f"connecting to {dsn}")
        if self.error is not None:
            raise self.error
        return "ok"

    def close(self) -> None:
        pass


DSN = "postgresql://reader:pw-Zx81-secret@db.internal:5432/weather"


def db_spec() -> ToolSpec:
    return check_spec(
        {"name": "d", "executor": "database", "dsn": "${LEAKY_DSN}", "query": "SELECT 1"}
    )


def test_errors_and_progress_never_carry_a_filled_in_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAKY_DSN", DSN)
    ctx = make_ctx()
    error = ExecutorError(f"cannot reach {DSN}", dsn=DSN, nested={"tries": [DSN]})
    leaky = _Leaky(error)
    with pytest.raises(ExecutorError) as info:
        specenv.run_executor(leaky, db_spec(), {}, ctx)
    assert leaky.seen["dsn"] == DSN  # the executor got the real value
    wire = repr(info.value.to_wire())
    assert "pw-Zx81-secret" not in wire and "${LEAKY_DSN}" in wire
    assert all("pw-Zx81-secret" not in m for m in ctx.messages)  # type: ignore[attr-defined]
    assert ctx.messages == ["connecting to ${LEAKY_DSN}"]  # type: ignore[attr-defined]


def test_a_password_quoted_alone_is_scrubbed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAKY_DSN", DSN)
    with pytest.raises(ExecutorError) as info:
        specenv.run_executor(
            _Leaky(ExecutorError("auth failed for password pw-Zx81-secret")), db_spec(), {}, make_ctx()
        )
    assert "pw-Zx81-secret" not in str(info.value)


def test_a_library_exception_quoting_a_value_becomes_a_clean_executor_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LEAKY_DSN", DSN)
    with pytest.raises(ExecutorError) as info:
        specenv.run_executor(_Leaky(ValueError(f"bad url {DSN}")), db_spec(), {}, make_ctx())
    assert "pw-Zx81-secret" not in str(info.value) and info.value.__cause__ is None
    # One that quotes nothing of ours goes through unchanged.
    with pytest.raises(KeyError):
        specenv.run_executor(_Leaky(KeyError("other")), db_spec(), {}, make_ctx())


def test_the_progress_sink_is_given_back_after_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEAKY_DSN", DSN)
    ctx = make_ctx()
    sink = ctx.progress_sink
    assert specenv.run_executor(_Leaky(None), db_spec(), {}, ctx) == "ok"
    assert ctx.progress_sink is sink


def test_concurrent_first_calls_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONC_V", "concurrent-value")
    s = spec(env_set={"V": "${CONC_V}"})
    seen: list[Any] = []

    def go() -> None:
        seen.append(specenv.prepare(s).spec.config["env_set"]["V"])

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == ["concurrent-value"] * 8
