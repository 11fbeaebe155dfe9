"""The console's live views in headless Chromium, against the real API server, real workers and Redis:
the overview's charts fill while a batch runs (read from the page's chart data, not pixels), a killed
worker turns late, a breaker shows open then half-open, a retried call's waterfall has one row per
attempt, and the audit filter finds a call by its session id.

With ``HERMES_CONSOLE_SCREENSHOTS=<dir>`` the overview and a waterfall are saved there as PNG files
(``docs/console-overview.png`` and ``docs/console-waterfall.png`` in the README come from this).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.breaker import Breakers, rejecting
from broker.config import ConsoleSettings
from tests.conftest import wait_until
from tests.e2e.test_console import ConsoleServer
from tests.e2e.test_console_browser import WAIT_MS, Page, browser

pytestmark = pytest.mark.e2e

__all__ = ["browser"]  # the fixture, shared with test_console_browser
TRACE_URL = "http://localhost:16686/trace/{trace_id}"
SHOTS = os.environ.get("HERMES_CONSOLE_SCREENSHOTS")


@pytest.fixture
def serve(gateway: Any) -> Iterator[Any]:
    """``serve(token=None)``: the API and console over ``gateway`` (linking traces to Jaeger)."""
    gateway.settings = dataclasses.replace(gateway.settings, console=ConsoleSettings(trace_url=TRACE_URL))
    servers: list[ConsoleServer] = []

    def start(token: str | None = None) -> ConsoleServer:
        servers.append(ConsoleServer(gateway, token=token))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _open(browser: Any, server: ConsoleServer, viewport: dict[str, int] | None = None) -> Page:
    page = Page(browser.new_page(viewport=viewport or {"width": 1500, "height": 1000}))
    page.page.goto(server.base + "/")
    page.wait_text("#broker", r"^broker: ")
    return page


def _shot(page: Page, name: str, selector: str | None = None) -> None:
    if not SHOTS:
        return
    Path(SHOTS).mkdir(parents=True, exist_ok=True)
    target = page.page.locator(selector) if selector else page.page
    target.screenshot(path=str(Path(SHOTS) / name))


def test_the_overview_charts_get_points_while_a_batch_runs(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    home.sleep_tool("slow", concurrency=4, description="查询指定城市的实时天气情况 (sleeps)")
    gateway.sync_tools()
    workers(1, concurrency=16)
    page = _open(browser, serve())
    page.wait_text("#status", r"workers: 1")
    # A tool registered elsewhere after the page opened joins its list (the snapshot's directory version).
    gateway.register_tool({"name": "added_later", "executor": "python", "function": "workers.executors.builtin:echo"})
    page.wait_text("#tools", "added_later")

    def batch() -> None:
        # 96 calls of 0.3 s through 4 slots: the limit holds calls back for ~7 s, over several snapshots.
        for _ in range(4):
            work = [("slow", {"seconds": 0.3})] * 24 + [("echo", {"n": i}) for i in range(60)]
            gateway.submit_many(work, session_id="overview")
            time.sleep(0.7)

    runner = threading.Thread(target=batch)
    runner.start()
    try:
        # The limit of `slow` (4) holds its calls back: its bar says so while they wait.
        page.page.wait_for_selector("#limits .bottleneck", timeout=WAIT_MS)
        assert "tool:slow" in page.text("#limits .bottleneck")
        page.page.wait_for_function(
            "() => hermesConsole.charts.calls && hermesConsole.charts.calls.data[1].some((v) => v > 0)",
            timeout=WAIT_MS,
        )
    finally:
        runner.join(60)
    page.page.wait_for_function(
        "() => hermesConsole.charts.latency.data[2].some((v) => v !== null && v > 0)", timeout=WAIT_MS
    )
    calls = page.page.evaluate("() => hermesConsole.charts.calls.data")
    assert len(calls) == 4 and len(calls[0]) >= 2 and all(len(s) == len(calls[0]) for s in calls)
    assert max(calls[1]) > 10  # done per second: 240 echo calls in ~3 s, 96 slow ones over ~7 s
    latency = page.page.evaluate("() => hermesConsole.charts.latency.data")
    p50 = [v for v in latency[1] if v is not None]
    p99 = [v for v in latency[2] if v is not None]
    assert p50 and p99 and max(p99) >= 250  # the sleeping calls took 300 ms
    queues = page.page.evaluate("() => hermesConsole.charts.queues.series.map((s) => s.label)")
    assert queues[1:] == ["tools"]
    # The tool list shows the description in Chinese and the effective concurrency of `slow`.
    row = page.page.locator("#tools tr", has_text="slow").locator("td")
    assert row.nth(3).text_content() == "4" and "查询指定城市" in (row.nth(4).text_content() or "")
    # The next snapshot after the batch reaches the charts (what the screenshot shows; page problems count meanwhile).
    last = page.page.evaluate("() => hermesConsole.charts.calls.data[0].at(-1)")
    page.page.wait_for_function("(t) => hermesConsole.charts.calls.data[0].at(-1) > t", arg=last, timeout=WAIT_MS)
    _shot(page, "console-overview.png")
    assert page.problems == [], page.problems


def test_a_killed_worker_turns_late_in_the_workers_table(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    # A 6 s lease: heartbeats every 2 s, late after 5 s, dropped by the other worker after 12 s.
    keep, doomed = workers(2, lease=6.0)
    page = _open(browser, serve())
    rows = page.page.locator("#workers tr")
    page.page.wait_for_function("() => document.querySelectorAll('#workers tr').length === 2", timeout=WAIT_MS)
    assert page.page.locator("#workers tr.late").count() == 0
    assert "stop" not in (page.text("#workers") or "")  # no token: no stop buttons
    killed_at = time.monotonic()
    doomed.kill()
    late = page.page.locator("#workers tr.late")
    late.wait_for(timeout=WAIT_MS)
    assert time.monotonic() - killed_at < 2 * 2.0 + 1 + 2 * 1.5 + 1  # late threshold + two stream ticks
    assert doomed.name in (late.text_content() or "") and "(late)" in (late.text_content() or "")
    assert rows.count() == 2 and keep.name not in (late.text_content() or "")
    assert page.problems == [], page.problems


def test_stop_asks_to_confirm_and_stops_the_worker(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    (w,) = workers(1)
    page = Page(browser.new_page())
    server = serve("s3cret")
    page.page.goto(server.base + "/")
    page.page.wait_for_selector("#auth:not([hidden])", timeout=WAIT_MS)
    page.page.fill("#token", "s3cret")
    page.page.click("#save")
    button = page.page.locator("#workers tr", has_text=w.name).locator("button")
    button.wait_for(timeout=WAIT_MS)
    asked: list[str] = []
    page.page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    button.click()
    page.page.wait_for_timeout(300)
    assert asked and w.name in asked[0] and w.alive  # dismissed: nothing sent
    page.page.once("dialog", lambda d: d.accept())
    button.click()
    assert w.wait(20) == 0
    page.wait_text("#log", f"stop sent to {w.name}")


def test_a_breaker_opened_by_failures_shows_open_then_half_open(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    mode, log = tmp_path / "mode", tmp_path / "backend.log"
    mode.write_text("fail")
    home.tool(
        "fragile",
        function="tests.e2e.flowtools:backend",
        timeout=20,
        breaker={"failures": 2, "cooldown": 3},
        input_schema={"type": "object", "properties": {"hold": {"type": "number"}}},
    )
    gateway.sync_tools()
    workers(1)
    page = _open(browser, serve())

    def call(hold: float = 0.0) -> Any:
        return gateway.call_tool("fragile", {"mode_file": str(mode), "log": str(log), "hold": hold}, max_attempts=1)

    for _ in range(2):
        with pytest.raises(Exception):  # noqa: B017,PT011 - executor_error; the breaker is what is checked
            call().result(20)
    row = page.page.locator("#breakers tr", has_text="tool:fragile")
    page.page.wait_for_function(
        "() => /tool:fragile\\s*open/.test(document.querySelector('#breakers').textContent)", timeout=WAIT_MS
    )
    cells = row.locator("td")
    assert cells.nth(1).text_content() == "open" and cells.nth(2).text_content() == "0"
    assert "2 consecutive failures" in (cells.nth(3).text_content() or "")
    assert cells.nth(4).text_content() == "executor_error"
    assert "in " in (cells.nth(6).text_content() or "")  # when the next probe may go
    # After the cooldown the next call is the probe: half-open while it runs (3 s), then closed.
    mode.write_text("ok")
    breakers = Breakers(gateway.conn)

    def cooled_down() -> bool:  # still open, its cooldown over by its own opened_at: the next call is the probe
        view = breakers.state("tool:fragile")
        return view["state"] == "open" and not rejecting(view, 3)

    wait_until(cooled_down, 10, 0.01, "the breaker's cooldown to end")
    probe = call(hold=3.0)
    page.page.wait_for_function(
        "() => /tool:fragile\\s*half-open/.test(document.querySelector('#breakers').textContent)",
        timeout=WAIT_MS,
    )
    assert "probing" in (cells.nth(6).text_content() or "")
    assert probe.result(20)["ok"] is True
    page.page.wait_for_function(
        "() => /tool:fragile\\s*closed/.test(document.querySelector('#breakers').textContent)", timeout=WAIT_MS
    )
    assert page.problems == [], page.problems


def test_the_waterfall_of_a_retried_call_has_a_row_per_attempt(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    home.tool(
        "flaky",
        function="tests.e2e.flowtools:fail_times",
        timeout=10,
        retry={"max": 3, "backoff": 0.3, "jitter": 0},
        input_schema={"type": "object"},
        description="fails once, then answers",
    )
    gateway.sync_tools()
    workers(1)
    h = gateway.call_tool("flaky", {"counter": str(tmp_path / "count"), "times": 1})
    assert h.result(20) == {"attempts": 2}
    page = _open(browser, serve(), viewport={"width": 1100, "height": 900})
    page.page.fill("#trace-id", h.call_id)
    page.page.click("#trace-open")
    page.wait_text("#trace-head", r"done")
    labels = page.page.locator("#waterfall .wf-row .wf-label")
    page.page.wait_for_function("() => document.querySelectorAll('#waterfall .wf-lane').length === 2", timeout=WAIT_MS)
    assert [labels.nth(i).text_content() for i in range(labels.count())][1:] == ["attempt 1", "attempt 2"]
    lanes = page.page.locator("#waterfall .wf-lane")
    first = [lanes.nth(0).locator(".wf-bar").nth(i).text_content() for i in range(lanes.nth(0).locator(".wf-bar").count())]
    second = [lanes.nth(1).locator(".wf-bar").nth(i).text_content() for i in range(lanes.nth(1).locator(".wf-bar").count())]
    assert first == ["pending", "routing", "executing", "retrying"], first
    assert second == ["pending", "routing", "executing", "formatting", "done"], second
    # Bars sit in time order: the second attempt starts after the first one's retry wait.
    lefts = page.page.evaluate(
        "() => [...document.querySelectorAll('#waterfall .wf-lane')].map((l) => [...l.querySelectorAll('.wf-bar')].map((b) => parseFloat(b.style.left)))"
    )
    assert lefts[0] == sorted(lefts[0]) and lefts[1] == sorted(lefts[1]) and lefts[1][0] >= lefts[0][-1]
    link = page.page.locator("#trace-link")
    trace_id = link.text_content() or ""
    assert len(trace_id) == 32 and link.get_attribute("href") == TRACE_URL.format(trace_id=trace_id)
    _shot(page, "console-waterfall.png", "#trace-section")
    assert page.problems == [], page.problems


def test_the_audit_filter_finds_a_call_by_session_and_replays_it(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any
) -> None:
    home.echo_tool()
    gateway.sync_tools()
    workers(1)
    mine = gateway.call_tool("echo", {"who": "ann"}, session_id="sess-audit-1", principal="agent-a")
    mine.result(20)
    for i in range(3):
        gateway.call_tool("echo", {"i": i}, session_id="other").result(20)
    page = _open(browser, serve())
    page.page.fill("#audit-session", "sess-audit-1")
    page.page.click("#audit-search")
    page.wait_text("#audit-rows", mine.call_id)
    assert page.page.locator("#audit-rows tr").count() == 1
    page.page.locator("#audit-rows tr").first.click()
    assert '"who": "ann"' in page.wait_text("#audit-record", "ann")
    page.page.once("dialog", lambda d: d.accept())
    page.page.click("#audit-replay")
    out = page.wait_text("#audit-out", r"replay \{tools\}\.[0-9a-f]{32}: done")
    assert "same outcome as recorded" in out
    assert page.problems == [], page.problems


def test_a_call_streaming_5000_events_is_drawn_once_a_frame_and_keeps_bounded_sets(
    browser: Any, serve: Any, gateway: Any, home: Any, workers: Any, tmp_path: Path
) -> None:
    home.tool("chatty", function="tests.e2e.flowtools:chatty", timeout=120, input_schema={"type": "object"})
    gateway.sync_tools()
    workers(1)
    page = _open(browser, serve())
    page.wait_text("#tool", "chatty")
    page.page.select_option("#tool", "chatty")
    page.page.fill("#args", json.dumps({"n": 300, "until": str(tmp_path / "go")}))
    # Renders counted from outside the page's script: each draw of the trace sets its head, each of the calls list
    # empties the select; frames counted by a requestAnimationFrame loop of the test's own.
    page.page.evaluate(
        """() => { const w = globalThis.watch = {trace: 0, calls: 0, frames: 0};
        new MutationObserver((rs) => { w.trace += rs.length; }).observe($('trace-head'), {childList: true});
        new MutationObserver((rs) => { w.calls += rs.filter((r) => r.removedNodes.length).length; })
          .observe($('calls'), {childList: true});
        const tick = () => { w.frames += 1; requestAnimationFrame(tick); }; requestAnimationFrame(tick); }"""
    )
    counts = "() => ({...watch, events: calls.size && [...calls.values()].at(-1).events.length})"
    page.page.click("#run")  # 300 events first: one draw per event would freeze the page for minutes on 5,000
    page.wait_text("#log", r"step 299(?!\d)")
    burst = page.page.evaluate(counts)  # at most one draw of each per frame, not one per event
    assert burst["trace"] < 100 and burst["trace"] <= burst["frames"] + 3, burst
    assert burst["calls"] < 100 and burst["calls"] <= burst["frames"] + 3, burst
    (tmp_path / "go").write_text("")
    page.wait_text("#trace-head", r"· done ·")
    (tmp_path / "go").unlink()
    page.page.fill("#args", json.dumps({"n": 5000, "until": str(tmp_path / "go")}))
    page.page.click("#run")
    page.wait_text("#log", r"step 4999(?!\d)")
    page.wait_text("#trace-head", r"over 2000 events so far")
    after = page.page.evaluate(counts)
    assert after["trace"] <= after["frames"] + 3 and after["calls"] <= after["frames"] + 3, after
    kept = page.page.evaluate("() => [...calls.values()].map((c) => [c.events.length, c.seqs.size, c.events[0].seq])")
    assert kept[1] == [2000, 2000, 3004], kept  # the last 2,000 of 5,003 events, their seqs alone
    assert page.page.locator("#trace tr").count() == 2000
    (tmp_path / "go").write_text("")
    page.wait_text("#trace-head", r"· done ·")
    assert page.problems == [], page.problems
