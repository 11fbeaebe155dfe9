"""Each speed shortcut has a switch (``workers.shortcuts_off``) that puts its stock twin in its place."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from broker.config import load_settings
from broker.envelope import filler
from broker.errors import ConfigError
from broker.logs import MASK, RedactProcessor, redact_event
from broker.settings import configure_shortcuts
from workers.args import quick_check
from workers.worker import CallThreads, StockThreads, call_threads


@pytest.fixture(autouse=True)
def all_on() -> Iterator[None]:
    yield
    configure_shortcuts(())


def test_config_yaml_names_the_shortcuts_to_run_without(tmp_path: Path) -> None:
    assert load_settings(tmp_path, environ={}).workers.shortcuts_off == frozenset()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"workers": {"shortcuts_off": ["threads", "frozen"]}}))
    assert load_settings(tmp_path, environ={}).workers.shortcuts_off == {"threads", "frozen"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"workers": {"shortcuts_off": "quickcheck, redaction"}}))
    assert load_settings(tmp_path, environ={}).workers.shortcuts_off == {"quickcheck", "redaction"}


def test_an_unknown_shortcut_is_a_config_error_naming_it_and_the_known_ones(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"workers": {"shortcuts_off": ["thread"]}}))
    with pytest.raises(ConfigError, match=r"workers.shortcuts_off: unknown shortcut\(s\) thread; known: threads"):
        load_settings(tmp_path, environ={})


def test_threads_off_runs_calls_on_a_thread_pool_executor_that_drops_what_has_not_started() -> None:
    assert type(call_threads(2, "t")) is CallThreads
    configure_shortcuts(["threads"])
    pool = call_threads(1, "t")
    assert isinstance(pool, StockThreads)
    release, ran = threading.Event(), []
    pool.submit(lambda _: release.wait(10), None)
    pool.submit(ran.append, 1)
    pool.submit(lambda _: 1 / 0, None)  # (a failing task is logged, not raised)
    last = threading.Event()
    pool.submit(lambda _: last.set(), None)
    release.set()
    assert last.wait(10)  # (one thread: everything before it has run)
    assert pool.shutdown() == 0 and ran == [1]
    pool = call_threads(1, "t")
    started = threading.Event()
    pool.submit(lambda _: (started.set(), release.wait(10)), None)
    pool.submit(ran.append, 2)
    assert started.wait(10)
    assert pool.shutdown() == 1 and ran == [1]
    with pytest.raises(RuntimeError):
        pool.submit(ran.append, 3)


@dataclass(frozen=True)
class _Made:
    a: int
    b: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inited", True)


def test_frozen_off_calls_the_dataclass_itself() -> None:
    make = filler(_Made)
    assert make({"a": 1}) == _Made(1) and not hasattr(make({"a": 1}), "inited")
    configure_shortcuts(["frozen"])
    assert make({"a": 1}) == _Made(1) and vars(make({"a": 1}))["inited"]


def test_quickcheck_off_leaves_every_instance_to_the_full_validator() -> None:
    quick = quick_check({"type": "object", "properties": {"n": {"type": "integer"}}})
    assert quick is not None and quick({"n": 1})
    configure_shortcuts(["quickcheck"])
    assert not quick({"n": 1})


def test_redaction_off_runs_the_stock_processor_over_the_whole_event() -> None:
    event = {"event": "call finished", "call_id": "{tools}.9f2c0a11", "password": "hunter2", "n": 3}
    fast = redact_event(None, "info", dict(event))
    configure_shortcuts(["redaction"])
    stock = redact_event(None, "info", dict(event))
    assert stock == RedactProcessor()(None, "info", dict(event))
    assert fast["password"] == stock["password"] == MASK and fast["n"] == stock["n"] == 3
