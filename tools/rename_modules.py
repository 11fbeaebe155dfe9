"""Give every module of broker, workers, middleware and hermes_gateway a basename of its own (issue 32).

Moves each module below with ``git mv`` (history follows) and rewrites every reference to it in the
repository's tracked text files: imports (absolute, ``from pkg import mod``, relative ``from .mod``),
dotted names in strings (``monkeypatch.setattr("pkg.mod.x", ...)``) and paths in docs. Idempotent: a
second run finds nothing to move or rewrite, so it can be run again after other branches are merged.

    python tools/rename_modules.py            # README.md left alone
    python tools/rename_modules.py --readme   # README.md too
    python tools/rename_modules.py --check    # exit 1 if anything is left to move or rewrite

tests/test_layout.py fails while two modules share a basename.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# old module -> new module. The namesake that keeps its name is the one more widely imported
# (broker/config.py, broker/logs.py, workers/retry.py, workers/runner.py, workers/telemetry.py,
# hermes_gateway/flow.py: public API, workers/executors/base.py).
MODULES = {
    "middleware.config": "middleware.plugin_config",  # plugins.enabled/disabled in config.yaml
    "middleware.logs": "middleware.logger",  # the middleware package's logger
    "middleware.flow": "middleware.call_order",  # the contract's call order
    "workers.providers.retry": "workers.providers.backoff",  # when to retry a provider call
    "workers.providers.base": "workers.providers.provider",  # the provider protocol and cache
    "hermes_gateway.flows.runner": "hermes_gateway.flows.engine",  # FlowRunner
    "hermes_gateway.telemetry": "hermes_gateway.tracing",  # client-side producer spans, SDK set-up
    "workers.hooks.base": "workers.hooks.hook",  # the Hook base class and the call it sees
}

# Tests that mirror a renamed module follow it.
TESTS = {
    "tests/workers/providers/test_retry.py": "tests/workers/providers/test_backoff.py",
    "tests/workers/providers/test_base.py": "tests/workers/providers/test_provider.py",
}

# Bare basenames in prose, where the directory is only implied: exact text, rewritten as it is.
LITERALS = {
    "registry, chains, flows (`flow.py`;": "registry, chains, flows (`call_order.py`;",  # docs/ARCHITECTURE.md
}

TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".ini", ".txt", ".yaml", ".yml", ".sh", ".json", ".lua"}
TEXT_NAMES = {"Makefile", "Dockerfile"}


def path_of(module: str) -> str:
    return module.replace(".", "/") + ".py"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def moves() -> list[tuple[str, str]]:
    pairs = [(path_of(old), path_of(new)) for old, new in MODULES.items()]
    return pairs + list(TESTS.items())


def pending_moves() -> list[tuple[str, str]]:
    todo = []
    for old, new in moves():
        if (REPO / old).exists():
            if (REPO / new).exists():
                sys.exit(f"both {old} and {new} exist: merge them by hand, then run again")
            todo.append((old, new))
    return todo


def rules() -> list[tuple[re.Pattern[str], str, str | None]]:
    """(pattern, replacement, directory the rule is limited to or None)."""
    out: list[tuple[re.Pattern[str], str, str | None]] = []
    for old, new in MODULES.items():
        pkg, _, mod = old.rpartition(".")
        new_mod = new.rpartition(".")[2]
        # pkg.mod as a dotted name: imports, mock targets, prose.
        out.append((re.compile(rf"(?<![\w.]){re.escape(old)}(?!\w)"), new, None))
        # from pkg import mod  ->  from pkg import new_mod as mod (the module's callers keep their code).
        out.append(
            (
                re.compile(rf"^(\s*from {re.escape(pkg)} import ){mod}\b(?! as)", re.M),
                rf"\1{new_mod} as {mod}",
                None,
            )
        )
        # Relative imports inside the module's own package.
        pkg_dir = pkg.replace(".", "/")
        out.append((re.compile(rf"^(\s*from \.){mod}(?= import)", re.M), rf"\1{new_mod}", pkg_dir))
        out.append(
            (re.compile(rf"^(\s*from \. import ){mod}\b(?! as)", re.M), rf"\1{new_mod} as {mod}", pkg_dir)
        )
        # Paths in docs and comments: pkg/mod.py, and the shorter parent/mod.py (providers/retry.py).
        old_path, new_path = path_of(old), path_of(new)
        parts = old_path.split("/")
        for start in range(len(parts) - 1):
            short_old = "/".join(parts[start:])
            short_new = "/".join(new_path.split("/")[start:])
            out.append((re.compile(rf"(?<![\w/.]){re.escape(short_old)}"), short_new, None))
    for old, new in TESTS.items():
        out.append((re.compile(rf"(?<![\w/.]){re.escape(old)}"), new, None))
        dotted_old, dotted_new = old[:-3].replace("/", "."), new[:-3].replace("/", ".")
        out.append((re.compile(rf"(?<![\w.]){re.escape(dotted_old)}(?!\w)"), dotted_new, None))
    for old_text, new_text in LITERALS.items():
        out.append((re.compile(re.escape(old_text)), new_text.replace("\\", "\\\\"), None))
    return out


def text_files(readme: bool) -> list[Path]:
    me = Path(__file__).resolve()
    files = []
    for name in git("ls-files").splitlines():
        path = REPO / name
        if not path.is_file() or path.resolve() == me:
            continue
        if name == "README.md" and not readme:
            continue
        if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
            files.append(path)
    return files


def rewrite(path: Path, table: list[tuple[re.Pattern[str], str, str | None]], write: bool = True) -> bool:
    """Apply the table to one file; whether anything changed (written only with ``write``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return False
    rel = path.relative_to(REPO).as_posix()
    new = text
    for pattern, replacement, only_in in table:
        if only_in is not None and rel.rpartition("/")[0] != only_in:
            continue
        new = pattern.sub(replacement, new)
    if new == text:
        return False
    if write:
        path.write_text(new, encoding="utf-8")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="rewrite README.md too")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is left")
    opts = parser.parse_args()
    todo = pending_moves()
    table = rules()
    if opts.check:
        stale = [p for p in text_files(opts.readme) if rewrite(p, table, write=False)]
        for old, new in todo:
            print(f"to move: {old} -> {new}")
        for p in stale:
            print(f"to rewrite: {p.relative_to(REPO)}")
        return 1 if todo or stale else 0
    for old, new in todo:
        git("mv", old, new)
        print(f"moved {old} -> {new}")
    rewritten = []
    for path in text_files(opts.readme):  # after the moves: the moved files are rewritten too
        if rewrite(path, table):
            rewritten.append(path)
            print(f"rewrote {path.relative_to(REPO)}")
    sort_imports([p for p in rewritten if p.suffix == ".py"])
    return 0


def sort_imports(paths: list[Path]) -> None:
    """A renamed import may now sort elsewhere in its block: ruff puts it back in order (isort rules only)."""
    if not paths:
        return
    nearby = [REPO / ".venv" / "bin" / "ruff", Path(sys.executable).parent / "ruff"]
    exe = next((str(p) for p in nearby if p.exists()), None) or shutil.which("ruff")
    if exe is None:
        print("ruff not found: run `ruff check --fix --select I .` to sort the rewritten imports")
        return
    subprocess.run(
        [exe, "check", "--fix", "--select", "I", "--quiet", *map(str, paths)], cwd=REPO, check=False
    )


if __name__ == "__main__":
    sys.exit(main())
