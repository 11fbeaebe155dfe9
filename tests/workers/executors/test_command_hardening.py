"""The command executor by default lets no value become an option, and no spec hands a value to a shell
or interpreter as code (issue 24.6)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from broker.errors import InvalidArgs, InvalidSpec
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


def test_a_value_cannot_become_an_option_of_sort_by_default(ex, make_ctx, tmp_path):
    # The probe's case: `sort {{x}}` with x = --output=F wrote F.
    target = tmp_path / "written"
    with pytest.raises(InvalidArgs, match="starts with '-'") as info:
        ex.run(spec(command="sort {{x}}"), {"x": f"--output={target}"}, make_ctx())
    assert info.value.details["field"] == "x"
    assert not target.exists()
    # A value that does not start with '-' still arrives as it is.
    (tmp_path / "in.txt").write_text("b\na\n")
    assert ex.run(spec(command="sort {{x}}"), {"x": str(tmp_path / "in.txt")}, make_ctx()) == "a\nb"


@pytest.mark.parametrize("value", ["-", "-n", "--help", "--output=/tmp/x"])
def test_every_dash_value_in_a_bare_placeholder_element_is_refused(ex, make_ctx, value):
    with pytest.raises(InvalidArgs):
        ex.run(spec(command=[PY, RECORDER, "x{{a}}", "{{b}}"], output="json"), {"a": "-", "b": value}, make_ctx())


def test_the_spec_opts_in_to_dash_values_with_a_separator_or_explicitly(ex, make_ctx):
    sep = spec(command=[PY, RECORDER, "-v", "{{a}}"], args_separator=True, output="json")
    assert ex.run(sep, {"a": "--delete"}, make_ctx())["argv"] == ["-v", "--", "--delete"]
    raw = spec(command=[PY, RECORDER, "{{n}}"], args_separator=False, output="json")
    assert ex.run(raw, {"n": -5}, make_ctx())["argv"] == ["-5"]
    # An option the spec itself wrote may take any value.
    opt = spec(command=[PY, RECORDER, "--name={{a}}", "-n{{b}}"], output="json")
    assert ex.run(opt, {"a": "-x", "b": "-1"}, make_ctx())["argv"] == ["--name=-x", "-n-1"]


def test_args_separator_must_be_a_boolean():
    with pytest.raises(InvalidSpec, match="args_separator"):
        spec(command="sort {{x}}", args_separator="yes")


@pytest.mark.parametrize(
    "cmd",
    [
        'sh -c "ls {{dir}}"',
        ["bash", "-c", "echo {{x}}"],
        'bash -ec "echo {{x}}"',
        '/bin/sh -c {{x}}',
        'env LC_ALL=C sh -c "grep {{x}} f"',
        'timeout 5 bash -c "{{x}}"',
        'busybox sh -c "{{x}}"',
        'python3 -c "print({{x}})"',
        'python3 -u -c "print({{x}})"',
        'perl -e "print {{x}}"',
        'node -e "{{x}}"',
        "node --eval={{x}}",
        'ruby -e "{{x}}"',
        "pwsh -Command {{x}}",
        "sh {{script}}",
        # options that take a value before the code option; wrappers with their own arguments
        'bash -o errexit -c "echo {{x}}"',
        'bash --rcfile /dev/null -c "echo {{x}}"',
        'python3 -W ignore -c "print({{x}})"',
        'perl -I /tmp -e "{{x}}"',
        "timeout 5 sh {{script}}",
        'sudo -u bob bash -c "{{x}}"',
        # program text as an operand (sed's `e` command runs a shell)
        "awk {{x}}",
        "gawk -v n=1 {{x}} file",
        "sed -n {{x}} file",
        "sed -e {{x}} file",
        # a value choosing the program a wrapper runs
        "env {{x}}",
        "xargs {{x}}",
        "timeout 5 {{x}}",
        "env LC_ALL=C {{x}} arg",
        # behind wrappers with operands and long options of their own, and code attached to its option
        'chroot / sh -c "echo hello {{x}}"',
        'flock /tmp/lk -c "echo hello {{x}}"',
        'flock /tmp/lk sh -c "echo hello {{x}}"',
        'timeout --signal KILL 5 sh -c "echo hello {{x}}"',
        'setpriv --reuid 0 sh -c "echo {{x}}"',
        "find . -exec sh -c 'echo {{x}}' ';'",
        "python3 -c\"print('hello {{x}}')\"",
        'python3 -Bc "print({{x}})"',
        'perl -e"print {{x}}"',
        'gawk --source="BEGIN{print {{x}}}"',
        'su -c "echo {{x}}" bob',
        "ssh host cat {{file}}",
        "ssh -p 22 -o BatchMode=yes host 'ls {{dir}}'",
        "git -c core.sshCommand={{x}} fetch",
    ],
)
def test_a_placeholder_in_shell_or_interpreter_code_is_refused_at_registration(cmd):
    with pytest.raises(InvalidSpec, match="code|script|program"):
        spec(command=cmd)


@pytest.mark.parametrize(
    "cmd",
    [
        "sh -c 'cat -- \"$1\"' sh {{file}}",  # the value is $1, an argument, never code
        "bash script.sh {{x}}",
        "python3 tool.py -c {{x}}",
        "grep -c {{pattern}} file",
        "echo sh {{x}}",
        "env LC_ALL=C sort {{file}}",
        "timeout 5 curl {{url}}",
        "awk '{print $1}' {{file}}",
        "awk -f prog.awk {{file}}",
        "sed -e s/a/b/ {{file}}",
        "sed -n 1p {{file}}",
        "git -C {{repo}} log",
        "python3 -m http.server {{port}}",
        "grep -r python {{dir}}",
        "find {{dir}} -name '*.py'",
        "flock /tmp/lk sh -c 'echo \"$1\"' sh {{x}}",
        "python3 tool.py --city={{city}}",
        "ssh {{host}} uptime",
        "git -C {{repo}} log --author={{who}}",
    ],
)
def test_values_passed_as_arguments_after_the_code_are_fine(cmd):
    spec(command=cmd)


def test_a_stored_spec_with_code_placeholders_is_refused_at_run_time(ex, make_ctx):
    stored = ToolSpec.from_stored({"name": "t", "executor": "command", "command": 'sh -c "echo {{x}}"'})
    with pytest.raises(InvalidSpec, match="code"):
        ex.run(stored, {"x": "$(id)"}, make_ctx())


@pytest.mark.parametrize("name", ["-", "--help", "-rf", "-x_y"])
def test_tool_names_that_read_as_options_are_refused(name):
    with pytest.raises(InvalidSpec, match="not starting with '-'"):
        check_spec({"name": name, "executor": "command", "command": "true"})


@pytest.mark.parametrize("name", ["a-b", "_x", "9lives", "get_weather"])
def test_ordinary_tool_names_still_register(name):
    assert check_spec({"name": name, "executor": "command", "command": "true"}).name == name
