"""Plugin discovery (directories, entry points), config.yaml editing, loading and reload."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

from middleware import (
    ENTRY_POINTS_GROUP,
    PlainDiscovery,
    PluginManager,
    ToolCallFlow,
    disable_plugin,
    enable_plugin,
    list_plugins,
)
from tests.middleware.helpers import EXAMPLES, install_example, warnings_of, write_plugin

TAGGER = """
def register(ctx):
    ctx.register_middleware("tool_request", tag)
    ctx.register_hook("post_tool_call", lambda **kw: None)

def tag(**kwargs):
    return {"args": {**kwargs["args"], "tag": TAG}, "source": "tagger"}

TAG = "v1"
"""


def config(home: Path) -> dict[str, Any]:
    return yaml.safe_load((home / "config.yaml").read_text())


@pytest.fixture
def fake_entry_points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Install a module on sys.path and advertise it in the hermes_agent.plugins group."""
    pkg_root = tmp_path / "site"
    pkg_root.mkdir()
    monkeypatch.syspath_prepend(str(pkg_root))
    eps: list[importlib.metadata.EntryPoint] = []
    real = importlib.metadata.entry_points

    def entry_points(**params: Any) -> Any:
        if params.get("group") == ENTRY_POINTS_GROUP:
            return list(eps)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)

    def add(name: str, module: str, source: str) -> None:
        (pkg_root / f"{module}.py").write_text(source)
        eps.append(importlib.metadata.EntryPoint(name=name, value=module, group=ENTRY_POINTS_GROUP))

    return add


def test_directory_plugins_are_discovered_flat_and_in_categories(home: Path) -> None:
    write_plugin(home, "flat", TAGGER)
    nested = home / "plugins" / "observability" / "tracer"
    nested.mkdir(parents=True)
    (nested / "plugin.yml").write_text("name: tracer\ndescription: traces\n")
    (nested / "__init__.py").write_text("def register(ctx):\n    pass\n")
    infos = {i.key: i for i in list_plugins(home)}
    assert set(infos) == {"flat", "observability/tracer"}
    assert infos["observability/tracer"].name == "tracer"
    assert infos["observability/tracer"].description == "traces"
    assert infos["flat"].source == "user" and infos["flat"].path == str(home / "plugins" / "flat")
    assert not any(i.enabled for i in infos.values())


def test_entry_point_plugins_are_discovered_and_loaded(home: Path, fake_entry_points: Any) -> None:
    fake_entry_points("ep-tagger", "ep_tagger_mod", TAGGER)
    [info] = list_plugins(home)
    assert (info.name, info.source, info.path) == ("ep-tagger", "entrypoint", "ep_tagger_mod")
    enable_plugin(home, "ep-tagger")
    manager = PluginManager(home)
    [loaded] = manager.load()
    assert loaded.enabled and loaded.middleware == ("tool_request",) and loaded.hooks == ("post_tool_call",)
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a) == {"tag": "v1"}


def test_enable_and_disable_edit_config_yaml_in_hermes_format_preserving_other_keys(home: Path) -> None:
    write_plugin(home, "b-plugin", TAGGER)
    write_plugin(home, "a-plugin", TAGGER)
    (home / "config.yaml").write_text(
        yaml.safe_dump(
            {"model": {"default": "gpt-x"}, "plugins": {"entries": {"x": {"allow_tool_override": False}}}}
        )
    )
    assert enable_plugin(home, "b-plugin") == "b-plugin"
    enable_plugin(home, "a-plugin")
    cfg = config(home)
    assert cfg["model"] == {"default": "gpt-x"}
    assert cfg["plugins"]["entries"] == {"x": {"allow_tool_override": False}}
    assert cfg["plugins"]["enabled"] == ["a-plugin", "b-plugin"]  # sorted, as Hermes writes it
    assert cfg["plugins"]["disabled"] == []
    disable_plugin(home, "b-plugin")
    cfg = config(home)
    assert cfg["plugins"]["enabled"] == ["a-plugin"] and cfg["plugins"]["disabled"] == ["b-plugin"]
    assert cfg["model"] == {"default": "gpt-x"}
    enable_plugin(home, "b-plugin")  # enabling again takes it off the deny-list
    assert config(home)["plugins"]["disabled"] == []
    assert {i.name: i.enabled for i in list_plugins(home)} == {"a-plugin": True, "b-plugin": True}


def test_enable_resolves_a_category_plugin_by_its_leaf_name(home: Path) -> None:
    nested = home / "plugins" / "observability" / "tracer"
    nested.mkdir(parents=True)
    (nested / "plugin.yaml").write_text("name: tracer\n")
    (nested / "__init__.py").write_text("def register(ctx):\n    pass\n")
    assert enable_plugin(home, "tracer") == "observability/tracer"
    assert config(home)["plugins"]["enabled"] == ["observability/tracer"]


def test_enabling_an_unknown_plugin_is_an_error(home: Path) -> None:
    with pytest.raises(LookupError, match="not installed"):
        enable_plugin(home, "missing")
    assert not (home / "config.yaml").exists()


def test_disabled_wins_over_enabled(home: Path) -> None:
    write_plugin(home, "p", TAGGER)
    (home / "config.yaml").write_text(yaml.safe_dump({"plugins": {"enabled": ["p"], "disabled": ["p"]}}))
    manager = PluginManager(home)
    [info] = manager.load()
    assert not info.enabled and info.error == "disabled via config"
    assert manager.runtime.empty


def test_missing_enabled_key_means_nothing_enabled(home: Path) -> None:
    write_plugin(home, "p", TAGGER)
    (home / "config.yaml").write_text(yaml.safe_dump({"plugins": {"disabled": []}, "other": 1}))
    assert PluginManager(home).load()[0].enabled is False


def test_reload_reimports_plugin_modules_fresh(home: Path) -> None:
    plugin_dir = write_plugin(home, "p", TAGGER)
    enable_plugin(home, "p")
    manager = PluginManager(home)
    manager.load()
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a)["tag"] == "v1"
    (plugin_dir / "__init__.py").write_text(TAGGER.replace('TAG = "v1"', 'TAG = "v2"'))
    manager.load()  # idempotent: no re-import
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a)["tag"] == "v1"
    manager.reload()
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a)["tag"] == "v2"


def test_reload_picks_up_config_changes(home: Path) -> None:
    write_plugin(home, "p", TAGGER)
    enable_plugin(home, "p")
    manager = PluginManager(home)
    manager.load()
    assert not manager.runtime.empty
    disable_plugin(home, "p")
    manager.reload()
    assert manager.runtime.empty


def test_plugin_packages_can_use_relative_imports(home: Path) -> None:
    plugin_dir = write_plugin(
        home, "pkg-plugin", "from . import helpers\n\ndef register(ctx):\n    helpers.go(ctx)\n"
    )
    (plugin_dir / "helpers.py").write_text(
        "def go(ctx):\n    ctx.register_middleware('tool_request', lambda **kw: {'args': {'via': 'helpers'}})\n"
    )
    enable_plugin(home, "pkg-plugin")
    manager = PluginManager(home)
    assert manager.load()[0].error is None
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a) == {"via": "helpers"}


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("raise ImportError('needs a missing lib')\n", "needs a missing lib"),
        ("x = 1\n", "no register() function"),
        ("def register(ctx):\n    raise RuntimeError('register broke')\n", "register broke"),
    ],
)
def test_broken_plugins_are_reported_and_do_not_stop_the_others(
    home: Path, logs: list, source: str, error: str
) -> None:
    write_plugin(home, "broken", source)
    write_plugin(home, "good", TAGGER)
    enable_plugin(home, "broken")
    enable_plugin(home, "good")
    infos = {i.name: i for i in PluginManager(home).load()}
    assert not infos["broken"].enabled and error in (infos["broken"].error or "")
    assert infos["good"].enabled
    assert any(error in w["event"] for w in warnings_of(logs))


def test_broken_manifest_is_listed_with_its_error(home: Path) -> None:
    plugin_dir = home / "plugins" / "bad-yaml"
    plugin_dir.mkdir()
    (plugin_dir / "plugin.yaml").write_text("name: [unclosed\n")
    (plugin_dir / "__init__.py").write_text("")
    [info] = list_plugins(home)
    assert info.name == "bad-yaml" and info.error


def test_memory_provider_plugins_are_left_to_their_own_loader(home: Path) -> None:
    write_plugin(home, "mem", "def register(ctx):\n    ctx.register_memory_provider(object())\n")
    enable_plugin(home, "mem")
    [info] = PluginManager(home).load()
    assert not info.enabled and "exclusive" in (info.error or "")


def test_hermes_only_registrations_are_ignored_with_a_warning(home: Path, logs: list) -> None:
    source = (
        "def register(ctx):\n"
        "    ctx.register_tool('x', None, None, None)\n"
        "    ctx.register_command('y', None)\n"
        "    ctx.register_middleware('tool_request', lambda **kw: {'args': {'ok': True}})\n"
    )
    write_plugin(home, "hermes-extras", source)
    enable_plugin(home, "hermes-extras")
    manager = PluginManager(home)
    assert manager.load()[0].enabled
    assert ToolCallFlow(manager).run("t", {}, execute=lambda a: a) == {"ok": True}
    assert len([w for w in warnings_of(logs) if "does not support" in w["event"]]) == 2


def test_unknown_hook_names_warn_but_are_kept(home: Path, logs: list) -> None:
    write_plugin(
        home, "h", "def register(ctx):\n    ctx.register_hook('on_custom_event', lambda **kw: 'x')\n"
    )
    enable_plugin(home, "h")
    manager = PluginManager(home)
    manager.load()
    assert any("on_custom_event" in w["event"] and "pre_tool_call" in w["event"] for w in warnings_of(logs))
    assert manager.runtime.emit("on_custom_event") == ["x"]


def test_all_four_example_plugins_load_together_and_compose(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in sorted(p.name for p in EXAMPLES.iterdir() if p.is_dir()):
        install_example(home, name)
        enable_plugin(home, name)
    manager = PluginManager(home)
    infos = manager.load()
    assert [(i.name, i.enabled, i.middleware) for i in infos] == [
        ("middleware-demo-llm-tag", True, ("llm_request",)),
        ("middleware-demo-llm-timing", True, ("llm_execution",)),
        ("middleware-demo-terminal-workdir", True, ("tool_request",)),
        ("middleware-demo-tool-annotate", True, ("tool_execution",)),
    ]
    rt = manager.runtime
    result = rt.run_tool_call("terminal", {"command": "ls"}, execute=lambda a: a)
    assert result["workdir"].endswith("hermes-middleware-demo")
    response = rt.run_llm_call({"model": "m"}, call_provider=lambda req: req)
    assert response["extra_body"]["metadata"]["hermes_middleware_demo"] is True


def test_hermes_safe_mode_loads_no_plugin(home: Path) -> None:
    write_plugin(home, "tagger", TAGGER)
    enable_plugin(home, "tagger")
    manager = PluginManager(home, discovery=PlainDiscovery(safe_mode=True))  # (the gateway: HERMES_SAFE_MODE=1)
    assert manager.load() == [] and manager.runtime.empty
    manager.discovery = PlainDiscovery(safe_mode=False)
    assert [i.key for i in manager.reload() if i.enabled] == ["tagger"]


def test_project_plugins_load_only_when_opted_in_and_win_over_user_plugins(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_plugin(home, "tagger", TAGGER)
    project = tmp_path / "project"
    write_plugin(project / ".hermes", "tagger", TAGGER.replace('TAG = "v1"', 'TAG = "project"'))
    enable_plugin(home, "tagger")
    monkeypatch.chdir(project)

    def tag(discovery: PlainDiscovery) -> Any:
        manager = PluginManager(home, discovery=discovery)
        manager.load()
        return ToolCallFlow(manager).run("t", {}, execute=lambda a: a)["tag"]

    assert tag(PlainDiscovery()) == "v1"
    assert tag(PlainDiscovery(project_plugins=True)) == "project"  # (the gateway: HERMES_ENABLE_PROJECT_PLUGINS)
