"""The package layout: every module's basename is its own, and the command line lives in hermes_gateway/cli/."""

from __future__ import annotations

import ast
from collections import defaultdict

import click

from tests.conftest import REPO

PACKAGES = ("broker", "workers", "middleware", "hermes_gateway")


def test_no_two_modules_of_the_packages_share_a_basename() -> None:
    seen: dict[str, list[str]] = defaultdict(list)
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name not in ("__init__.py", "__main__.py"):
                seen[path.name].append(path.relative_to(REPO).as_posix())
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert shared == {}, "rename one of each (tools/rename_modules.py rewrites the imports)"


def _defines_click_commands(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef):
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if isinstance(target, ast.Attribute) and target.attr in ("command", "group"):
                    return True
    return False


def test_every_click_command_is_defined_under_hermes_gateway_cli() -> None:
    outside = [
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "cli" not in path.relative_to(REPO / package).parts[:-1]
        and _defines_click_commands(path.read_text(encoding="utf-8"))
    ]
    assert outside == []
    stray = [
        p.name
        for p in sorted((REPO / "hermes_gateway").glob("*.py"))
        if p.stem == "cli" or p.stem.startswith("cli_") or p.stem.endswith("_cli")
    ]
    assert stray == []


def test_each_command_group_is_one_module_of_hermes_gateway_cli_named_after_it() -> None:
    from hermes_gateway.cli import main

    misplaced = []
    for name, command in main.commands.items():
        home = command.callback.__module__ if command.callback else ""
        if isinstance(command, click.Group):
            expected = f"hermes_gateway.cli.{name}_cmd"
            subs = {
                f"{name} {sub}": c.callback.__module__ if c.callback else ""
                for sub, c in command.commands.items()
            }
            misplaced += [(full, where) for full, where in subs.items() if where != expected]
        else:  # a single command: the root group's own, or a module named after it
            expected = home if home in ("hermes_gateway.cli", f"hermes_gateway.cli.{name}_cmd") else "?"
        if home != expected:
            misplaced.append((name, home))
    assert misplaced == []
    shared = {p.stem for p in (REPO / "hermes_gateway" / "cli").glob("*.py")} - {"__init__", "common"}
    assert all(stem.endswith("_cmd") for stem in shared), sorted(shared)
