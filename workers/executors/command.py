"""The ``command`` executor: run a program with argv filled from the arguments, never through a shell.

``command`` is split with :func:`shlex.split` FIRST, then each element is filled, so a value stays one
argument; a value never chooses the program, never becomes an option (unless ``args_separator``) and is
never code given to a shell or interpreter (checked at registration and again at run time). The child
gets only the ``env`` allow-list plus ``env_set`` (and the call's W3C context as ``TRACEPARENT``,
``TRACESTATE``, ``BAGGAGE``), runs in its own process group (killed after
``kill_grace`` on timeout or cancel) and its stdout (capped by ``max_output``) is the result.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from broker.errors import ExecutorError, InvalidArgs, InvalidSpec, OutputTooLarge
from broker.placeholders import OMIT, check_declared, fill, has, names, sole, value_of
from broker.toolspec import ToolSpec

from . import DEFAULT_MAX_OUTPUT, ExecContext, require

# Set in every command's environment, a token per run: its descendants keep it wherever they go (``setsid``,
# an exited parent), so the kill paths find them by it (``_marked``). Not a secret: it names a run.
RUN_MARK = "HERMES_COMMAND_RUN"
STRAY_WAIT = 0.2  # seconds the pipes may stay open after the command exits before its marked strays go
DEFAULT_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
STDERR_TAIL = 2000


# A worker killed outright takes its tools with it (an orphan would run beside its call's retry).
# util-linux's setpriv sets the parent-death signal and execs the tool (same pid); a preexec_fn would
# fork the whole worker with the GIL held.
_SETPRIV = shutil.which("setpriv")


def _dying_with_worker(argv: list[str], where: str, env: dict[str, str]) -> list[str]:
    if _SETPRIV is None:
        return argv
    # What Popen would have said, before setpriv hides it behind its own exit code.
    program = argv[0]
    found = program if os.sep in program else shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None or not os.path.exists(found):
        raise ExecutorError(f"{where}: command not found: {program}", command=program)
    if os.path.isdir(found) or not os.access(found, os.X_OK):
        raise ExecutorError(f"{where}: command not executable: {program}", command=program)
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *argv]  # it looks the program up as we just did


def split_command(where: str, template: Any) -> list[str]:
    """The ``command`` template as argv, before any filling, checked (module docstring)."""
    if isinstance(template, str):
        try:
            parts = shlex.split(template)
        except ValueError as e:
            raise InvalidSpec.at(where, "command", f"cannot split {template!r}: {e}") from e
    elif isinstance(template, list):
        for i, part in enumerate(template):
            if isinstance(part, bool) or not isinstance(part, str | int | float):
                raise InvalidSpec.at(where, f"command[{i}]", f"expected a string, got {type(part).__name__}")
        parts = [str(p) for p in template]
    else:
        raise InvalidSpec.at(where, "command", "expected a string or a list of strings")
    if not parts:
        raise InvalidSpec.at(where, "command", "is empty")
    if has(parts[0]):
        raise InvalidSpec.at(where, "command", "the program (argv[0]) may not contain a placeholder")
    if problem := code_placeholder(parts):
        raise InvalidSpec.at(where, "command", problem)
    return parts


# Programs that run code given on their command line, and the options that give it (bash's ``-ec`` too).
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish", "csh", "tcsh"})
_CODE_OPTIONS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    # program (basename, version suffix dropped) -> (short option letters, long options)
    **{sh: (frozenset("c"), frozenset({"--command"})) for sh in _SHELLS},
    **dict.fromkeys(("python", "pypy"), (frozenset("c"), frozenset())),
    **dict.fromkeys(("ruby", "lua", "luajit", "osascript"), (frozenset("e"), frozenset())),
    "perl": (frozenset("eE"), frozenset()),
    "node": (frozenset("ep"), frozenset({"--eval", "--print"})),
    "deno": (frozenset(), frozenset({"eval"})),
    "php": (frozenset("r"), frozenset()),
    "tclsh": (frozenset(), frozenset()),
    **dict.fromkeys(("su", "runuser", "flock"), (frozenset("c"), frozenset({"--command", "--session-command"}))),
    "git": (frozenset("c"), frozenset({"--config-env"})),  # (core.sshCommand, core.pager, alias.x=!cmd run code)
    "pwsh": (frozenset(), frozenset({"-c", "-command", "-encodedcommand", "-ec"})),
    "powershell": (frozenset(), frozenset({"-c", "-command", "-encodedcommand", "-ec"})),
}
# Programs that run the program named after them (``env sh {{x}}``, ``timeout 5 sh {{x}}``).
_WRAPPERS = frozenset({
    "env", "busybox", "nice", "nohup", "setsid", "stdbuf", "sudo", "doas", "time", "exec", "timeout", "xargs",
    "chroot", "ionice", "taskset", "unshare", "flock", "watch", "strace", "ltrace", "nsenter", "runuser",
})  # fmt: skip
# Options of an interpreter that take the next argument (so that argument is no script name).
_OPTION_ARGS = frozenset({
    "-o", "-O", "+o", "+O", "--rcfile", "--init-file",  # shells
    "-W", "-X", "--check-hash-based-pycs",  # python
    "-I", "-r", "-C", "-E", "--require", "--import", "--loader",  # perl, ruby, node
    "-v", "-F",  # awk
})  # fmt: skip
# Programs whose first operand is their program text (``awk {{x}}``; sed's ``e`` command runs a shell).
_SCRIPT_FIRST: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    **dict.fromkeys(("awk", "gawk", "mawk", "nawk"), (frozenset({"-e", "--source"}), frozenset({"-f", "--file"}))),
    **dict.fromkeys(("sed", "gsed"), (frozenset({"-e", "--expression"}), frozenset({"-f", "--file"}))),
}
_VERSION = re.compile(r"[\d.]+$")


def _program(part: str) -> str:
    name = part.rsplit("/", 1)[-1].lower().removesuffix(".exe")
    return _VERSION.sub("", name) if not name.startswith(("sh", "ksh")) else name


def _runs(parts: list[str], i: int) -> bool:
    """Whether ``parts[i]`` stands where a program does: first, or after a wrapper (``env``, ``timeout``...)
    and only its options, option values, ``VAR=value`` settings and durations."""
    if i == 0:
        return True
    for j in range(i - 1, -1, -1):
        prev = parts[j]
        if _program(prev) in _WRAPPERS:
            return True
        if not (prev.startswith(("-", "+")) or ("=" in prev and not has(prev)) or _VERSION.match(prev)
                or (j > 0 and parts[j - 1] in _OPTION_ARGS | {"-n", "-u", "-s", "-k", "-c", "-p", "-i", "-o"})):
            return False
    return False


def code_placeholder(parts: list[str]) -> str | None:
    """What is wrong when a shell or interpreter gets code holding a placeholder (wherever it stands:
    behind a wrapper such as ``env``, ``timeout --signal KILL 5`` or ``chroot /``, or ``find -exec``), a
    value names the script it runs (``sh {{script}}``), or a value names the program a wrapper runs
    (``env {{x}}``); None when nothing is."""
    for i, part in enumerate(parts):
        positioned = _runs(parts, i)  # (where a program goes: a value there would choose it)
        if i > 0 and has(part) and positioned and not part.startswith(("-", "+")):
            return f"{part}: a placeholder where a program goes would let a value choose the program run"
        if i > 0 and part.startswith("-"):
            continue
        program = _program(part)
        if program == "ssh":
            problem = _ssh_command(parts[i + 1 :])
        elif program in _SCRIPT_FIRST:
            problem = _script_first(program, parts[i + 1 :], positioned)
        elif program in _CODE_OPTIONS:
            problem = _code_option(program, parts[i + 1 :], positioned)
        else:
            continue
        if problem:
            return problem
    return None


_SSH_VALUED = frozenset("BbcDEeFIiJLlmOoPpQRSWw")  # ssh's options that take a value


def _ssh_command(rest: list[str]) -> str | None:
    """ssh joins what follows its host into one command for the remote shell: a placeholder there is code
    (``ssh host cat {{file}}`` runs ``; rm -rf ~`` too); the host itself may be one."""
    skip = False
    for j, opt in enumerate(rest):
        if skip:
            skip = False
            continue
        if opt.startswith("-") and len(opt) > 1:
            skip = opt[-1] in _SSH_VALUED and len(opt) == 2  # (-p 22; -p22 carries its value)
            continue
        if any(has(part) for part in rest[j + 1 :]):
            return "ssh runs what follows the host in the remote shell: a placeholder there would let a value be code"
        return None
    return None


def _code_option(program: str, rest: list[str], positioned: bool) -> str | None:
    """A placeholder in the code ``program``'s code option gives (``-c CODE``, ``-cCODE``, ``-ec CODE``,
    ``--eval=CODE``) or, where it runs as a program, in the script name it is given."""
    letters, longs = _CODE_OPTIONS[program]
    skip = False
    lock_file = program == "flock"  # (flock FILE -c CODE: its first operand is the lock)
    for j, opt in enumerate(rest):
        if skip:  # (the value of the option before it)
            skip = False
            continue
        name, eq, inline = opt.partition("=")
        code: str | None = None
        if name.lower() in longs:
            code = inline if eq else (rest[j + 1] if j + 1 < len(rest) else "")
        elif opt.startswith("-") and not opt.startswith("--"):
            for k, letter in enumerate(opt[1:], 1):  # a cluster of flags, the code option in it, maybe code
                if letter in letters:
                    code = opt[k + 1 :] or (rest[j + 1] if j + 1 < len(rest) else "")
                    break
                if not letter.isalpha():
                    break
        if code is not None:
            if has(code) or has(opt):
                return (
                    f"{program} {name if name.lower() in longs else opt[:2]} runs its next argument as code: a "
                    "placeholder there would let a value be code; pass values as arguments after the code "
                    "(sh -c 'cat \"$1\"' sh {{file}})"
                )
            return None
        if opt in _OPTION_ARGS:
            skip = True
            continue
        if not opt.startswith(("-", "+")):
            if lock_file:
                lock_file = False
                continue
            if has(opt) and positioned:
                return f"{program} {opt}: a placeholder would let a value name the script {program} runs"
            return None  # a script file: what follows are its arguments
    return None


def _script_first(program: str, rest: list[str], positioned: bool = True) -> str | None:
    """awk's or sed's program text: its first operand (where it runs as a program), or what follows
    ``-e`` / ``--source``; none after ``-f FILE``."""
    code_options, file_options = _SCRIPT_FIRST[program]
    skip = had_code = False
    for j, opt in enumerate(rest):
        if skip:
            skip = False
            continue
        name = opt.partition("=")[0]
        if name in file_options:
            return None
        if name in code_options:
            code = opt.partition("=")[2] if "=" in opt else (rest[j + 1] if j + 1 < len(rest) else "")
            if has(code):
                return f"{program} {name} runs its next argument as a program: a placeholder there would let a value be code"
            skip, had_code = "=" not in opt, True
            continue
        if opt in _OPTION_ARGS:
            skip = True
            continue
        if not opt.startswith("-"):
            if has(opt) and not had_code and positioned:  # (after -e CODE, the operands are files)
                return f"{program} {opt}: its first operand is a program: a placeholder there would let a value be code"
            return None
    return None


def build_argv(config: dict[str, Any], args: dict[str, Any], where: str) -> list[str]:
    """Split the template into argv, then fill each element on its own."""
    parts = split_command(where, config.get("command"))
    argv = [parts[0]]
    mode = config.get("args_separator")
    separated = mode is not True  # true: a "--" goes before the first element holding a value
    for part in parts[1:]:
        if not separated and has(part):
            argv.append("--")
            separated = True
        filled = fill(part, args, where)
        if mode is None and filled.startswith("-") and not part.startswith("-"):
            # A value made this element look like an option ("--output=F" for `sort {{x}}`).
            field = names(part)[0]
            raise InvalidArgs(
                f"{where}: the value of {{{{{field}}}}} starts with '-', so {argv[0]} would read it as an "
                "option; the spec can set args_separator: true (a '--' before the values) to pass such values",
                field=field,
                violations=[f"$.{field}: starts with '-'"],
            )
        argv.append(filled)
    if any("\x00" in a for a in argv):
        raise InvalidArgs(f"{where}: an argument contains a NUL byte, which no program can receive")
    return argv


def build_env(config: dict[str, Any], args: dict[str, Any], where: str, schema: Any = None) -> dict[str, str]:
    """The allow-listed part of the worker's environment plus ``env_set``."""
    names = config.get("env", DEFAULT_ENV)
    env = {n: os.environ[n] for n in ([names] if isinstance(names, str) else names) if n in os.environ}
    for key, val in (config.get("env_set") or {}).items():
        text = str(val)
        field = sole(text)
        if field is not None and value_of(args, field, where, schema=schema) is OMIT:
            continue  # an optional field left out: the variable is not set
        filled = env[str(key)] = fill(text, args, where, schema=schema)
        if "\x00" in filled:
            raise InvalidArgs(f"{where}: env_set {key}: a value contains a NUL byte")
    return env


class CommandExecutor:
    """Runs tool commands as child processes, each in its own process group."""

    keys = frozenset(
        {"command", "args_separator", "env", "env_set", "cwd", "stdin", "output", "max_output", "kill_grace"}
    )

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.running: dict[str, subprocess.Popen[bytes]] = {}  # run mark -> its command, while it runs

    @staticmethod
    def check(where: str, data: Mapping[str, Any]) -> None:
        require(where, "command", data, ("command",), "the program and its arguments, e.g. `echo Hello, {{name}}!`")
        split_command(where, data["command"])
        separator = data.get("args_separator")
        if separator is not None and not isinstance(separator, bool):
            raise InvalidSpec.at(where, "args_separator", f"expected true or false, got {separator!r}")
        if data.get("env_set") is not None and not isinstance(data["env_set"], dict):
            raise InvalidSpec.at(where, "env_set", "expected a mapping {NAME: value}")
        env = data.get("env")
        if env is not None and not (isinstance(env, str) or (isinstance(env, list) and all(isinstance(n, str) for n in env))):
            raise InvalidSpec.at(where, "env", "expected a variable name or a list of names")
        check_declared(where, data, ("command", "env_set"))

    def run(self, spec: ToolSpec, args: dict[str, Any], ctx: ExecContext) -> Any:
        config = {**self.settings, **spec.config}
        where = f"tool {spec.name!r}"
        argv = build_argv(config, args, where)
        env = build_env(config, args, where, spec.input_schema)
        for name, value in ctx.trace_headers().items():  # W3C context as OpenTelemetry's env carriers name it
            env.setdefault(name.upper(), value)
        env[RUN_MARK] = uuid.uuid4().hex
        max_output = int(config.get("max_output", DEFAULT_MAX_OUTPUT))
        grace = float(config.get("kill_grace", 2.0))
        stdin_data = json.dumps(args, ensure_ascii=False).encode() if config.get("stdin") == "json" else None
        ctx.check()
        try:
            proc = subprocess.Popen(
                _dying_with_worker(argv, where, env),
                stdin=subprocess.PIPE if stdin_data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=config.get("cwd"),
                env=env,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            raise ExecutorError(f"{where}: command not found: {argv[0]}", command=argv[0]) from e
        except PermissionError as e:
            raise ExecutorError(f"{where}: command not executable: {argv[0]}", command=argv[0]) from e
        except OSError as e:
            raise ExecutorError(f"{where}: cannot start {argv[0]}: {e}", command=argv[0]) from e
        self.running[env[RUN_MARK]] = proc
        try:
            out, err = _communicate(proc, stdin_data, ctx, max_output, where, env[RUN_MARK])
        except BaseException:
            _kill_group(proc, grace, env[RUN_MARK])
            raise
        finally:
            self.running.pop(env[RUN_MARK], None)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        code = proc.returncode
        ctx.status_code = code
        text = out.decode("utf-8", errors="replace")
        if code != 0:
            tail = err.decode("utf-8", errors="replace").strip()[-STDERR_TAIL:]
            reason = f"exit code {code}" if code > 0 else f"killed by signal {-code}"
            raise ExecutorError(
                f"{where}: {argv[0]} failed with {reason}" + (f": {tail}" if tail else ""),
                exit_code=code,
                stderr=tail,
            )
        if config.get("output") == "json":
            try:
                return json.loads(text)
            except ValueError as e:
                raise ExecutorError(f"{where}: output is not JSON: {e}") from e
        return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")

    def close(self) -> None:
        """Kill the commands still running: a stopping worker handed their calls back (they run again
        elsewhere), and one that ignores SIGTERM would outlive the worker inside its ``kill_grace``."""
        for mark, proc in list(self.running.items()):
            _signal_group(proc, signal.SIGKILL, _strays(proc) + _marked(mark))


def _communicate(
    proc: subprocess.Popen[bytes], stdin_data: bytes | None, ctx: ExecContext, max_output: int, where: str,
    mark: str,
) -> tuple[bytes, bytes]:
    """Read both pipes until EOF and exit, watching the deadline, cancellation and the output cap."""
    assert proc.stdout is not None and proc.stderr is not None
    out = bytearray()
    err = bytearray()
    pending = memoryview(stdin_data) if stdin_data is not None else None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        if proc.stdin is not None and pending is not None:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE, None)
        reaped: float | None = None  # (when the command was seen gone)
        strays_killed = False
        while True:
            ctx.check_at(where)
            if reaped is None and proc.poll() is not None:
                # Children the leader left holding our pipes must not keep the call open.
                _signal_group(proc, signal.SIGKILL)
                reaped = time.monotonic()
            elif reaped is not None and not strays_killed and sel.get_map() and time.monotonic() - reaped > STRAY_WAIT:
                # Still open: a descendant outside the group (setsid) holds them.
                _signal_group(proc, signal.SIGKILL, _marked(mark))
                strays_killed = True
            if not sel.get_map():
                # Pipes are closed; the process may still be running (it closed stdout itself).
                try:
                    proc.wait(timeout=ctx.poll_slice())
                except subprocess.TimeoutExpired:
                    continue
                break
            for key, _ in sel.select(timeout=ctx.poll_slice()):
                if key.data is None:
                    assert pending is not None and proc.stdin is not None
                    try:
                        written = os.write(key.fd, pending[:65536])
                    except OSError:  # the child stopped reading
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        sel.unregister(key.fileobj)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf: bytearray = key.data
                buf += chunk
                if buf is out and len(out) > max_output:
                    raise OutputTooLarge(
                        f"{where}: output passed the cap of {max_output} bytes", limit=max_output
                    )
                if buf is err and len(err) > 4 * STDERR_TAIL:
                    del err[: -2 * STDERR_TAIL]
    _signal_group(proc, signal.SIGKILL)
    return bytes(out), bytes(err)


def _signal_group(proc: subprocess.Popen[bytes], sig: int, strays: Sequence[psutil.Process] = ()) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    for stray in strays:  # (psutil checks each is still the process it found: no pid reused)
        with contextlib.suppress(psutil.Error):
            stray.send_signal(sig)


def _kill_group(proc: subprocess.Popen[bytes], grace: float, mark: str) -> None:
    """SIGTERM the whole process group, then SIGKILL whatever is left after ``grace`` seconds; the
    command's descendants that left its group (``setsid``) too, its children or carrying its ``mark``."""
    strays = _strays(proc) + _marked(mark)
    _signal_group(proc, signal.SIGTERM, strays)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    _signal_group(proc, signal.SIGKILL, strays)
    with contextlib.suppress(subprocess.TimeoutExpired):  # (only a kernel in trouble gets there)
        proc.wait(timeout=5)


def _strays(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The command's live descendants in a process group other than its own."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for child in descendants:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(child.pid) != proc.pid:
                out.append(child)
    return out


def _marked(mark: str) -> list[psutil.Process]:
    """The live processes whose environment holds ``RUN_MARK=mark`` (this user's: the commands run as the
    worker), wherever they went; one that cleared or changed its environment is not found."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(RUN_MARK) == mark:
                found.append(proc)
    return found

