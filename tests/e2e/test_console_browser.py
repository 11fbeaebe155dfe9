"""The web console in a real browser: headless Chromium driven by Playwright against the real API server,
real workers and the real Redis.

``test_console.py`` runs the page's script under node with a stand-in DOM; this runs the page itself:
layout, events, ``EventSource``, ``confirm()`` and ``sessionStorage`` as a browser has them. It needs a
Chromium binary (``apt install chromium``; or ``$HERMES_TEST_CHROMIUM``) and skips, saying so, without one.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e import test_console
from tests.e2e.test_console import GREET_YAML, ConsoleServer

pytestmark = pytest.mark.e2e

served = test_console.served  # the same fixture: a server over the real API, workers and Redis

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is a dev extra")

BROWSER_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",  # this machine has no internet: no update or sync traffic
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 20_000


def _chromium() -> str:
    found = os.environ.get("HERMES_TEST_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    if not found:
        pytest.skip("no Chromium here (apt install chromium, or set HERMES_TEST_CHROMIUM)")
    return found


class Page:
    """A browser page that records every script error, console error and failed request."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.problems: list[str] = []
        page.on("pageerror", lambda e: self.problems.append(f"script error: {e}"))
        page.on(
            "console",
            lambda m: self.problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None,
        )
        page.on(
            "response", lambda r: self.problems.append(f"{r.status} {r.url}") if r.status >= 400 else None
        )

    def text(self, selector: str) -> str:
        return str(self.page.text_content(selector) or "")

    def wait_text(self, selector: str, pattern: str) -> str:
        """Wait until the element's text matches ``pattern``; its text."""
        self.page.wait_for_function(
            "([sel, pat]) => new RegExp(pat).test(document.querySelector(sel).textContent)",
            arg=[selector, pattern],
            timeout=WAIT_MS,
        )
        return self.text(selector)


@pytest.fixture
def browser() -> Iterator[Any]:
    executable = _chromium()
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=BROWSER_ARGS)
        yield b
        b.close()


def _open(browser: Any, served: ConsoleServer) -> Page:
    page = Page(browser.new_page())
    page.page.goto(served.base + "/")
    return page


def test_register_run_trace_and_remove_a_tool_in_a_browser(browser: Any, served: ConsoleServer) -> None:
    page = _open(browser, served)
    page.wait_text("#tools", r"echo")
    page.wait_text("#broker", r"^broker: ")

    # Register from the YAML form: the table and the tool picker get it.
    page.page.fill("#spec", GREET_YAML)
    page.page.click("#register")
    assert page.wait_text("#regok", r"greet: added") == "greet: added (version 2)"
    assert page.text("#regerr") == ""
    page.wait_text("#tools", r"greet")
    assert page.page.input_value("#tool") == "greet"

    # Run it: the log streams its events over EventSource and the trace view fills in.
    page.page.fill("#args", '{"who": "Alice"}')
    page.page.click("#run")
    log = page.wait_text("#log", r"done\s+result")
    assert re.search(r'done\s+result \{"who":"Alice"\}', log), log
    for state in ("pending", "routing", "executing", "formatting"):
        assert re.search(rf"\b{state}\b", log), (state, log)
    head = page.wait_text("#trace-head", r"trace_id [0-9a-f]{32}")
    assert re.match(r"call \{tools\}\.[0-9a-f]{32} · greet · done · trace_id", head), head
    rows = page.page.locator("#trace tr")
    states = [rows.nth(i).locator("td").nth(5).text_content() for i in range(rows.count())]
    assert states == ["pending", "routing", "executing", "formatting", "done"], states
    assert '"who": "Alice"' in page.wait_text("#trace-request", "Alice")  # the call's request, shown
    assert re.search(
        r"greet\s+[0-9a-f]{8}\s+done", page.page.locator("#calls option").first.text_content() or ""
    )

    # Bad JSON args are caught in the page, before any request.
    page.page.fill("#args", '{"who": ')
    page.page.click("#run")
    assert page.wait_text("#runerr", r"^args: ").startswith("args: ")

    # Remove it behind the browser's confirm() dialog.
    page.page.once("dialog", lambda d: d.accept())
    page.page.locator("#tools tr", has_text="greet").locator("button").click()
    assert page.wait_text("#regok", r"removed") == "greet: removed"
    page.page.wait_for_function(
        "() => !document.querySelector('#tools').textContent.includes('greet')", timeout=WAIT_MS
    )
    page.wait_text("#status", r"workers: 1")
    assert page.problems == [], page.problems


@pytest.mark.parametrize("served", ["s3cret-token"], indirect=True)
def test_a_token_is_asked_for_and_then_used(browser: Any, served: ConsoleServer) -> None:
    page = _open(browser, served)
    page.page.wait_for_selector("#auth:not([hidden])", timeout=WAIT_MS)
    assert page.text("#tools") == ""
    page.page.fill("#token", "s3cret-token")
    page.page.click("#save")
    page.wait_text("#tools", r"echo")
    page.page.select_option("#tool", "echo")
    page.page.fill("#args", '{"x": 1}')
    page.page.click("#run")
    page.wait_text("#log", r'done\s+result \{"x":1\}')  # the event stream authenticates too
    # Only the first, tokenless requests were refused.
    assert page.problems and all(p.startswith(("401 ", "console.error")) for p in page.problems), (
        page.problems
    )
