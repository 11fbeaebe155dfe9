"""The command executor: argv filled per element, never a shell, deadline/cancel kill the group."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from broker.errors import CallCancelled, ExecutorError, InvalidArgs, InvalidSpec, OutputTooLarge, ToolTimeout
from broker.toolspec import ToolSpec
from workers.executors import command
from workers.specs import check_spec

RECORDER = str(Path(__file__).with_name("argv_recorder.py"))
PY = sys.executable


def spec(**config: object) -> ToolSpec:
    return check_spec({"name": "t", "executor": "command", **config})


@pytest.fixture
def ex() -> command.CommandExecutor:
    return command.CommandExecutor({})


def test_seed_hello_prints_greeting_without_trailing_newline(ex, make_ctx):
    assert ex.run(spec(command="echo Hello, {{name}}!"), {"name": "Alice"}, make_ctx()) == "Hello, Alice!"


def test_only_one_trailing_newline_is_removed(ex, make_ctx):
    out = ex.run(spec(command=["printf", "a\\n\\n"]), {}, make_ctx())
    assert out == "a\n"


def test_list_form_keeps_value_with_spaces_as_one_argument(ex, make_ctx):
    out = ex.run(spec(command=[PY, RECORDER, "{{name}}"], output="json"), {"name": "a b  c"}, make_ctx())
    assert out["argv"] == ["a b  c"]


def test_non_string_values_render_as_json_or_str(ex, make_ctx):
    s = spec(command=f"{PY} {RECORDER} {{{{d}}}} {{{{n}}}} {{{{b}}}}", output="json")
    out = ex.run(s, {"d": {"k": [1, "x"]}, "n": 3.5, "b": True}, make_ctx())
    assert out["argv"] == ['{"k":[1,"x"]}', "3.5", "True"]


def test_missing_placeholder_value_is_invalid_args(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="name"):
        ex.run(spec(command="echo {{name}}"), {}, make_ctx())


def test_placeholder_in_program_is_refused(ex, make_ctx):
    with pytest.raises(InvalidSpec, match="argv"):
        ex.run(spec(command="{{prog}} -x"), {"prog": "rm"}, make_ctx())


def test_args_separator_puts_double_dash_before_first_value(ex, make_ctx):
    s = spec(command=[PY, RECORDER, "-v", "{{a}}", "{{b}}"], args_separator=True, output="json")
    out = ex.run(s, {"a": "--delete", "b": "x"}, make_ctx())
    assert out["argv"] == ["-v", "--", "--delete", "x"]


def test_nonzero_exit_is_executor_error_with_code_and_stderr(ex, make_ctx):
    s = spec(command=[PY, "-c", "import sys; sys.stderr.write('boom happened'); sys.exit(3)"])
    with pytest.raises(ExecutorError) as info:
        ex.run(s, {}, make_ctx())
    assert "exit code 3" in str(info.value) and "boom happened" in str(info.value)
    assert info.value.details["exit_code"] == 3


def test_missing_program_is_executor_error(ex, make_ctx):
    with pytest.raises(ExecutorError, match="command not found"):
        ex.run(spec(command="/nonexistent/prog x"), {}, make_ctx())


def test_env_is_allow_listed_and_env_set_added(ex, make_ctx, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "s3cr3t")
    monkeypatch.setenv("KEEP_ME", "yes")
    s = spec(
        command=[PY, RECORDER], env=["PATH", "KEEP_ME"], env_set={"GREETING": "hi {{name}}"}, output="json"
    )
    env = ex.run(s, {"name": "Bob"}, make_ctx())["env"]
    assert "SECRET_TOKEN" not in env
    assert env["KEEP_ME"] == "yes" and env["GREETING"] == "hi Bob"


def test_default_env_keeps_secrets_out(ex, make_ctx, monkeypatch):
    monkeypatch.setenv("DEEPSEEK_API_KEY", "sk-x")
    env = ex.run(spec(command=[PY, RECORDER], output="json"), {}, make_ctx())["env"]
    assert "DEEPSEEK_API_KEY" not in env and "PATH" in env


def test_the_trace_context_reaches_the_program_in_its_environment(ex, make_ctx):
    """As OpenTelemetry's environment carriers name it (TRACEPARENT, TRACESTATE, BAGGAGE), so a traced
    program joins the call's trace; an env_set of the same name wins."""
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ctx = make_ctx(traceparent=tp, tracestate="a=b", baggage="tenant=acme")
    env = ex.run(spec(command=[PY, RECORDER], output="json"), {}, ctx)["env"]
    assert (env["TRACEPARENT"], env["TRACESTATE"], env["BAGGAGE"]) == (tp, "a=b", "tenant=acme")
    env = ex.run(spec(command=[PY, RECORDER], output="json", env_set={"BAGGAGE": "mine"}), {}, ctx)["env"]
    assert env["BAGGAGE"] == "mine"
    assert "TRACEPARENT" not in ex.run(spec(command=[PY, RECORDER], output="json"), {}, make_ctx())["env"]


def test_cwd_is_used(ex, make_ctx, tmp_path):
    out = ex.run(spec(command=[PY, RECORDER], cwd=str(tmp_path), output="json"), {}, make_ctx())
    assert os.path.realpath(out["cwd"]) == os.path.realpath(tmp_path)


def test_stdin_json_passes_arguments(ex, make_ctx):
    s = spec(command=[PY, "-c", "import sys, json; print(json.load(sys.stdin)['q'][::-1])"], stdin="json")
    assert ex.run(s, {"q": "abc; rm -rf /"}, make_ctx()) == "/ fr- mr ;cba"


def test_oversize_output_is_output_too_large(ex, make_ctx):
    with pytest.raises(OutputTooLarge):
        ex.run(spec(command=["yes", "spam"], max_output=10_000), {}, make_ctx())


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


GROUP_SCRIPT = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen(['sleep', '30'])\n"
    "open(sys.argv[1], 'w').write(str(p.pid))\n"
    "time.sleep(30)\n"
)


# The second child calls setsid(): the group's signals miss it.
SESSION_SCRIPT = GROUP_SCRIPT.replace("['sleep', '30']", "['sleep', '30'], start_new_session=True")


# The child starts a setsid() grandchild and exits first: the grandchild belongs to init, not to the command.
ORPHAN_SCRIPT = (
    "import subprocess, sys, time\n"
    "inner = \"import subprocess, sys; subprocess.Popen(['sleep', '30'], start_new_session=True, "
    'stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "\n'
    "subprocess.run([sys.executable, '-c', inner + \"open(sys.argv[1], 'w').write('')\", sys.argv[1]])\n"
    "time.sleep(30)\n"
)



def _tagged(tag: str) -> list[int]:
    """The live processes whose environment has ``TEST_TAG=tag`` (set by the test's tool with env_set)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            pass
    return found



@pytest.mark.parametrize("script", [GROUP_SCRIPT, SESSION_SCRIPT], ids=["in_its_group", "left_the_group_by_setsid"])
def test_timeout_kills_the_whole_process_group_and_children_that_left_it(ex, make_ctx, tmp_path, wait_until, script):
    pidfile = tmp_path / "pid"
    s = spec(command=[PY, "-c", script, str(pidfile)], kill_grace=0.5)
    with pytest.raises(ToolTimeout):
        ex.run(s, {}, make_ctx(timeout=1.0))
    child = int(pidfile.read_text())
    wait_until(lambda: not _alive(child), 2.5, message=f"child {child} to be killed")


def test_timeout_kills_a_setsid_descendant_whose_parent_already_exited(ex, make_ctx, tmp_path, wait_until):
    done, tag = tmp_path / "started", uuid.uuid4().hex
    s = spec(command=[PY, "-c", ORPHAN_SCRIPT, str(done)], kill_grace=0.5, env_set={"TEST_TAG": tag})
    with pytest.raises(ToolTimeout):
        ex.run(s, {}, make_ctx(timeout=1.5))
    assert done.exists()  # the orphan was started (its parent wrote the file after starting it)
    wait_until(lambda: not _tagged(tag), 2.5, message="the orphaned sleep to be killed")



def test_a_setsid_child_holding_the_pipes_after_the_command_exits_does_not_hold_the_call(
    ex, make_ctx, wait_until
):
    tag = uuid.uuid4().hex
    script = "import subprocess; subprocess.Popen(['sleep', '30'], start_new_session=True); print('bye')"
    t0 = time.monotonic()
    assert (
        ex.run(spec(command=[PY, "-c", script], env_set={"TEST_TAG": tag}), {}, make_ctx(timeout=20)) == "bye"
    )
    assert time.monotonic() - t0 < 10  # (not the 20 s deadline: the stray holding stdout was killed)
    wait_until(lambda: not _tagged(tag), 2.5, message="the stray sleep to be killed")



def test_cancellation_kills_the_command(ex, make_ctx, tmp_path, wait_until):
    pidfile = tmp_path / "pid"
    ctx = make_ctx(timeout=20)
    s = spec(command=[PY, "-c", GROUP_SCRIPT, str(pidfile)], kill_grace=0.5)

    def cancel_when_started() -> None:
        for _ in range(200):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.02)
        ctx.cancelled.set()

    threading.Thread(target=cancel_when_started, daemon=True).start()
    with pytest.raises(CallCancelled):
        ex.run(s, {}, ctx)
    grandchild = int(pidfile.read_text())
    wait_until(lambda: not _alive(grandchild), 2.5, message=f"child {grandchild} to be killed")


def hostile_values(marker: Path) -> list[str]:
    m = str(marker)
    return [
        f"; touch {m}",
        f"&& touch {m}",
        f"| touch {m}",
        f"`touch {m}`",
        f"$(touch {m})",
        f"\ntouch {m}",
        f"x; touch {m} #",
        f"' ; touch {m}; '",
        f'" ; touch {m}; "',
        f"> {m}",
        f"< /etc/passwd > {m}",
        f"$(touch${{IFS}}{m})",
        "--help",
        "-rf",
        "--output=/etc/passwd",
        "-o/tmp/pwned",
        "-",
        "--",
        "../../../../etc/passwd",
        "/etc/shadow",
        "~root/.ssh/id_rsa",
        "$HOME",
        "${PATH}",
        "*",
        "/*",
        "{a,b}",
        "a b c",
        "\t\ttabs\t",
        "quote'single",
        'quote"double',
        "back\\slash",
        "ünïcødé 北京",
        "{{name}}",
        "null\\x00byte",
        "%s%s%n",
        "",
    ]


def test_hostile_values_arrive_as_exactly_one_argument_and_never_run(ex, make_ctx, tmp_path):
    marker = tmp_path / "pwned"
    values = hostile_values(marker)
    assert len(values) >= 30
    templates = [
        spec(command=[PY, RECORDER, "{{v}}"], args_separator=False, output="json"),
        spec(command=f"{PY} {RECORDER} --name={{{{v}}}}", output="json"),
        spec(command=f"{PY} {RECORDER} {{{{v}}}}", args_separator=True, output="json"),
    ]

    def one(job: tuple[int, str]) -> tuple[int, str, list[str]]:
        i, value = job
        return i, value, ex.run(templates[i], {"v": value}, make_ctx())["argv"]

    jobs = [(i, v) for i in range(len(templates)) for v in values]
    with ThreadPoolExecutor(8) as pool:  # also exercises many calls in flight on one executor
        results = list(pool.map(one, jobs))
    for i, value, argv in results:
        expected = [[value], [f"--name={value}"], ["--", value]][i]
        assert argv == expected, (value, argv)
    assert not marker.exists()
    assert not Path("/tmp/pwned").exists()


def test_nul_byte_in_value_is_invalid_args_not_a_crash(ex, make_ctx):
    with pytest.raises(InvalidArgs, match="NUL"):
        ex.run(spec(command=[PY, RECORDER, "{{v}}"]), {"v": "a\x00; touch /tmp/x"}, make_ctx())


def test_unbalanced_quotes_in_template_are_a_spec_error(ex, make_ctx):
    with pytest.raises(InvalidSpec):
        ex.run(spec(command="echo 'unterminated"), {}, make_ctx())


def test_output_json_parse_failure_is_executor_error(ex, make_ctx):
    with pytest.raises(ExecutorError, match="not JSON"):
        ex.run(spec(command="echo not-json", output="json"), {}, make_ctx())


def test_values_in_json_output_round_trip(ex, make_ctx):
    out = ex.run(
        spec(command=[PY, "-c", "import json; print(json.dumps({'a': 1}))"], output="json"), {}, make_ctx()
    )
    assert out == {"a": 1} and json.dumps(out)
