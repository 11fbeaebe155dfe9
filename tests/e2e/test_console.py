"""The web console at ``GET /``: its page, the HTTP requests its script sends, and the script itself.

The page's script is run by node against a small stand-in for the DOM (elements by id, ``fetch`` to the
real server, ``EventSource`` over fetch): the same JS a browser runs, driving the real API, the real
workers and the real Redis. ``test_console_browser.py`` runs the page in headless Chromium.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_http_api import Served

pytestmark = pytest.mark.e2e

CONSOLE_IDS = (
    "tools", "spec", "register", "regok", "regerr",  # the tool list and the register form
    "tool", "args", "run", "runerr",  # run a call
    "log", "log-clear",  # the log stream
    "calls", "trace-show", "trace-id", "trace-open", "trace-err", "trace-head", "trace-table", "trace",  # trace
    "status", "auth", "token",
)

GREET_YAML = """\
name: greet
executor: python
function: workers.executors.builtin:echo
description: says what it got
timeout: 10
input_schema:
  type: object
  properties: {who: {type: string}, where: {type: string, default: {{city}}}}
"""


class ConsoleServer(Served):
    def __init__(self, gateway: Any, token: str | None = None) -> None:
        super().__init__(gateway, token=token)
        self.token = token


def _script(page: str) -> str:
    found = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(found) == 1, "one inline script, no external assets"
    return found[0]


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the console's script cannot be checked or run without a JS engine")
    return node


@pytest.fixture
def served(gateway: Any, home: Any, workers: Any, request: pytest.FixtureRequest) -> Iterator[ConsoleServer]:
    home.echo_tool()
    gateway.sync_tools()
    workers(1, concurrency=8)
    server = ConsoleServer(gateway, token=getattr(request, "param", None))
    yield server
    server.stop()


@pytest.fixture
def client(served: ConsoleServer) -> Iterator[httpx.Client]:
    auth = {"Authorization": f"Bearer {served.token}"} if served.token else {}
    with httpx.Client(base_url=served.base, timeout=30, headers=auth) as c:
        yield c


def test_the_console_page_has_the_register_form_the_log_stream_and_the_trace_view(client: httpx.Client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    for element in CONSOLE_IDS:
        assert f'id="{element}"' in html, element
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the console works offline: no external assets"
    script = _script(html)
    assert "innerHTML" not in script, "server text (tool descriptions, results) is shown as text, never as markup"


def test_the_console_script_parses(client: httpx.Client, tmp_path: Path) -> None:
    node = _node()
    path = tmp_path / "console.js"
    path.write_text(_script(client.get("/").text), encoding="utf-8")
    checked = subprocess.run([node, "--check", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr


def test_register_as_yaml_or_json_like_the_console_then_run_and_remove(client: httpx.Client) -> None:
    # YAML text goes as {"yaml": ...} in a JSON body, read like a spec file ({{field}} placeholders kept).
    created = client.post("/v1/tools", json={"yaml": GREET_YAML})
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "greet" and created.json()["outcome"] == "added"
    assert client.post("/v1/tools", json={"yaml": GREET_YAML}).json()["outcome"] == "unchanged"
    listed = {t["name"]: t for t in client.get("/v1/tools").json()}
    assert listed["greet"]["description"] == "says what it got"
    shown = client.get("/v1/tools/greet").json()
    assert shown["input_schema"]["properties"]["where"]["default"] == "{{city}}"
    done = client.post("/v1/tools/greet/calls", json={"args": {"who": "Alice"}, "wait": 20}).json()
    assert done["state"] == "done" and done["result"] == {"who": "Alice"}

    # JSON (what the console sends when the text parses as a JSON object) updates the same tool.
    spec = {
        "name": "greet",
        "executor": "python",
        "function": "workers.executors.builtin:echo",
        "description": "now from JSON",
    }
    updated = client.post("/v1/tools", json=spec)
    assert updated.status_code == 200 and updated.json()["outcome"] == "updated", updated.text
    assert {t["name"]: t for t in client.get("/v1/tools").json()}["greet"]["description"] == "now from JSON"

    # Removing it: gone from the list, calls to it are unknown.
    assert client.delete("/v1/tools/greet").json() == {"removed": "greet"}
    assert "greet" not in {t["name"] for t in client.get("/v1/tools").json()}
    gone = client.post("/v1/tools/greet/calls", json={"args": {}})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "unknown_tool"
    again = client.delete("/v1/tools/greet")
    assert again.status_code == 404 and again.json()["error"]["type"] == "unknown_tool"


def _nested_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("body", "kind", "says", "path"),
    [
        ({"yaml": "name: broken\nexecutor: python\n"}, "invalid_spec", "function", None),
        ({"yaml": "name: broken\nexecutor: pythn\n"}, "invalid_spec", "executor", "executor"),
        ({"yaml": "name: [broken\n"}, "invalid_spec", "not valid YAML", "yaml"),
        ({"yaml": "- name: a\n"}, "invalid_spec", "expected a mapping", None),
        (
            {"yaml": "name: d\nexecutor: python\nfunction: a:b\ninput_schema: {type: object, default: 2024-01-01}\n"},
            "invalid_spec",
            "date",
            "input_schema.default",
        ),
        (
            {"yaml": "name: n\nexecutor: python\nfunction: a:b\ninput_schema: {1: x}\n"},
            "invalid_spec",
            "keys must be strings",
            "input_schema",
        ),
        ({"yaml": 12}, "bad_request", "YAML text", None),
        ({"name": "broken", "executor": "python"}, "invalid_spec", "function", None),
        (  # a JSON Schema checker recurses: 100 levels overflowed it, a 500
            {"name": "broken", "executor": "python", "function": "a:b", "input_schema": _nested_schema(100)},
            "invalid_spec",
            "nested too deeply",
            None,
        ),
    ],
)
def test_an_invalid_spec_gets_the_typed_error_the_console_shows(
    client: httpx.Client, body: dict[str, Any], kind: str, says: str, path: str | None
) -> None:
    refused = client.post("/v1/tools", json=body)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["type"] == kind and says in error["message"], error
    if path is not None:
        assert error["details"]["path"] == path, error
    assert "broken" not in {t["name"] for t in client.get("/v1/tools").json()}


def test_yaml_aliases_cannot_blow_a_spec_up_and_the_body_must_still_be_declared_json(client: httpx.Client) -> None:
    # Six levels of ten aliases each: a million values from a few hundred bytes.
    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcde", "bcdef", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    default = "{" + ", ".join(levels) + "}"
    bomb = f"name: bomb\nexecutor: python\nfunction: a:b\ninput_schema: {{type: object, default: {default}}}\n"
    refused = client.post("/v1/tools", json={"yaml": bomb})
    assert refused.status_code == 400 and "too large" in refused.json()["error"]["message"], refused.text
    # Nine levels with a {{placeholder}} in the aliased node: unmasking copies each node once, so it is
    # refused at once (each level copied on its own took 10x longer: 3.6 s at seven levels, memory at nine).
    levels = ["a: &a ['{{x}}', x]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = bomb.replace(default, "{" + ", ".join(levels) + "}")
    refused = client.post("/v1/tools", json={"yaml": bomb}, timeout=30)  # (before: out of memory)
    assert refused.status_code == 400 and "too large" in refused.json()["error"]["message"], refused.text
    plain = client.post("/v1/tools", content=json.dumps({"yaml": GREET_YAML}), headers={"Content-Type": "text/plain"})
    assert plain.status_code == 400 and "application/json" in plain.json()["error"]["message"]


def test_a_calls_request_is_shown_as_submitted_with_its_secrets_masked(
    client: httpx.Client, gateway: Any, home: Any
) -> None:
    spec = {"name": "login", "executor": "python", "function": "workers.executors.builtin:echo",
            "sensitive": ["ssn"]}
    assert client.post("/v1/tools", json=spec).status_code in (200, 201)
    args = {"user": "ann", "ssn": "123-45-6789", "headers": {"Authorization": "Bearer abcdef123456"}}
    done = client.post("/v1/tools/login/calls", json={"args": args, "context": {"session_id": "s1"}, "wait": 20}).json()
    asked = client.get(f"/v1/calls/{done['call_id']}/request").json()
    assert asked["kind"] == "tool" and asked["name"] == "login" and asked["context"]["session_id"] == "s1"
    assert asked["args"]["user"] == "ann" and asked["args"]["ssn"].startswith("hmac-sha256:")  # the spec's `sensitive`
    assert "123-45-6789" not in json.dumps(asked) and "abcdef123456" not in json.dumps(asked)
    # It has ended, so its request is no longer kept: what is shown is its audit record's, and says so.
    assert asked["source"] == "audit" and "no longer kept" in asked["note"]
    gateway.conn.delete("hermes:{audit}", "hermes:{audit}:idx")  # past the audit log's retention too
    gone = client.get(f"/v1/calls/{done['call_id']}/request").json()
    assert "args" not in gone and "no longer kept" in gone["error"] and "no audit record" in gone["error"]
    missing = client.get("/v1/calls/0123456789abcdef0123456789abcdef/request")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "unknown_call"


# The page's script under node: a stand-in DOM with the page's element ids, fetch to the real server,
# EventSource over fetch. It registers a YAML spec, sees a bad one refused, runs a call, follows it in
# the log stream and the trace view, opens another call by id, removes the tool, and fills the log past its cap.
HARNESS = r"""
"use strict";
const fs = require("fs");
const vm = require("vm");
const [htmlPath, base, token] = process.argv.slice(2);
const html = fs.readFileSync(htmlPath, "utf8");
const script = html.match(/<script>([\s\S]*)<\/script>/)[1];

class El {
  constructor(id, tag) {
    Object.assign(this, {id, tagName: tag, children: [], _text: "", value: "", hidden: false, title: "", className: "",
      onclick: null, onchange: null, scrollTop: 0, scrollHeight: 0, clientHeight: 0});
  }
  get textContent() { return this.children.length ? this.children.map((c) => c.textContent).join("") : this._text; }
  set textContent(v) { this.children = []; this._text = String(v ?? ""); }
  appendChild(c) { this.children.push(c); return c; }
  replaceChildren(...cs) { this.children = cs; }
}
const byId = new Map([...html.matchAll(/\bid="([^"]+)"/g)].map((m) => [m[1], new El(m[1])]));
const el = (id) => { if (!byId.has(id)) throw new Error("no element " + id); return byId.get(id); };
const text = (id) => el(id).textContent;
const rows = (id) => el(id).children.map((tr) => tr.children.map((td) => td.textContent));

const store = new Map(token ? [["hermes-token", token]] : []);
const seen = {authorized: 0, requests: 0, streams: []};
const fetchHere = (path, options = {}) => {
  seen.requests += 1;
  if ((options.headers || {}).Authorization === "Bearer " + token) seen.authorized += 1;
  return fetch(new URL(path, base), options);
};

class EventSource {
  static CLOSED = 2;
  constructor(url) {
    this.url = url; this.readyState = 0; this.listeners = {}; this.onerror = null; this.ctrl = new AbortController();
    seen.streams.push(url);
    this.pump();
  }
  addEventListener(kind, f) { (this.listeners[kind] ||= []).push(f); }
  close() { this.readyState = 2; this.ctrl.abort(); }
  async pump() {
    try {
      const r = await fetch(new URL(this.url, base), {signal: this.ctrl.signal});
      this.readyState = 1;
      const decoder = new TextDecoder();
      let buf = "", ev = {};
      for await (const chunk of r.body) {
        buf += decoder.decode(chunk, {stream: true});
        const lines = buf.split(/\r\n|\r|\n/);
        buf = lines.pop();
        for (const line of lines) {
          if (line === "") {
            if (ev.data !== undefined && this.readyState !== 2) {
              for (const f of this.listeners[ev.event || "message"] || []) f({data: ev.data, lastEventId: ev.id});
            }
            ev = {};
          } else if (!line.startsWith(":")) {
            const at = line.indexOf(":");
            const field = at < 0 ? line : line.slice(0, at);
            const value = at < 0 ? "" : line.slice(at + 1).replace(/^ /, "");
            ev[field] = field === "data" && ev.data !== undefined ? ev.data + "\n" + value : value;
          }
        }
      }
    } catch (e) { /* aborted */ }
    if (this.readyState !== 2) { this.readyState = 2; if (this.onerror) this.onerror(); }
  }
}

const confirms = [];
const sandbox = {
  document: {getElementById: (id) => byId.get(id) ?? null, createElement: (tag) => new El(null, tag)},
  sessionStorage: {getItem: (k) => (store.has(k) ? store.get(k) : null), setItem: (k, v) => store.set(k, String(v))},
  confirm: (m) => { confirms.push(m); return true; },
  fetch: fetchHere, EventSource, console, URL, TextDecoder, AbortController, setTimeout,
  requestAnimationFrame: (f) => setTimeout(f, 16),
  setInterval: (f, ms) => { const t = setInterval(f, ms); t.unref(); return t; },
};
vm.createContext(sandbox);
vm.runInContext(script, sandbox, {filename: "console.html.js"});

const check = (ok, what) => { if (!ok) throw new Error(what); };
async function until(pred, what, ms = 30000) {
  const end = Date.now() + ms;
  while (!pred()) {
    if (Date.now() > end) throw new Error("timed out waiting for " + what());
    await new Promise((r) => setTimeout(r, 50));
  }
}
const GREET = fs.readFileSync(process.argv[5], "utf8");

(async () => {
  await until(() => rows("tools").some((r) => r[0] === "echo"), () => "the tool list: " + text("runerr"));

  el("spec").value = GREET;
  await el("register").onclick();
  check(text("regok").startsWith("greet: added (version"), "register: " + text("regok") + " | " + text("regerr"));
  const greet = rows("tools").find((r) => r[0] === "greet");
  check(greet && greet[1] === "python" && greet[4] === "says what it got" && greet[5] === "remove", "row " + greet);
  check(el("tool").value === "greet", "the new tool is chosen to run: " + el("tool").value);

  el("spec").value = '{"name": "broken", "executor": "python"}';
  await el("register").onclick();
  check(text("regerr").startsWith("invalid_spec: ") && text("regerr").includes("function"), "regerr " + text("regerr"));
  check(text("regok") === "", "no success shown on failure");
  el("spec").value = "name: broken\nexecutor: pythn\n";
  await el("register").onclick();
  check(text("regerr").includes("executor") && text("regerr").includes("(path: executor)"), "regerr " + text("regerr"));

  el("args").value = '{"who": "北京"}';
  await el("run").onclick();
  check(text("runerr") === "", "run: " + text("runerr"));
  const id = el("calls").children[0].value;
  check(/^\{tools\}\.[0-9a-f]{32}$/.test(id), "call id " + id);  // (ids start with their queue's hash tag)
  const logged = () => text("log").split("\n").filter((l) => l.includes(`  ${id.split(".").pop().slice(0, 8)}  `));
  await until(() => logged().some((l) => / done /.test(l)), () => "done in the log: " + text("log"));
  const states = logged().map((l) => l.split(/\s+/)[2]);
  check(JSON.stringify(states) === JSON.stringify(["pending", "routing", "executing", "formatting", "done"]), "log " + states);
  check(logged().every((l) => /^\d\d:\d\d:\d\d\.\d{3}  [0-9a-f]{8}  /.test(l)), "log line shape: " + logged());

  await until(() => text("trace-head").includes("result "), () => "the outcome in the trace: " + text("trace-head"));
  const head = text("trace-head");
  check(head.includes(`call ${id}`) && head.includes("greet") && head.includes("done"), "head " + head);
  check(/trace_id [0-9a-f]{32}/.test(head), "trace id in " + head);
  const trace = rows("trace");
  check(trace.map((r) => Number(r[0])).join() === trace.map((_, i) => i + 1).join(), "seqs " + trace.map((r) => r[0]));
  check(trace.map((r) => r[5]).join() === "pending,routing,executing,formatting,done", "trace states " + trace.map((r) => r[5]));
  check(/^\d\d:\d\d:\d\d\.\d{3}$/.test(trace[0][1]) && trace[0][2] === "0.0 ms" && trace[0][3] === "", "first row " + trace[0]);
  check(trace.slice(1).every((r) => / (ms|s)$/.test(r[3])) && trace.slice(0, -1).every((r) => / (ms|s)$/.test(r[4])), "durations");
  check(trace.every((r) => /^[0-9a-f]{16}$/.test(r[8])), "span ids " + trace.map((r) => r[8]));
  await until(() => text("trace-request") !== "", () => "the request in the trace");
  check(JSON.parse(text("trace-request")).who === "北京", "the call's args: " + text("trace-request"));

  // A call started elsewhere, opened by id: its history comes from the events route.
  const other = await (await fetchHere("/v1/tools/echo/calls", {method: "POST",
    headers: {"Content-Type": "application/json", ...(token ? {Authorization: "Bearer " + token} : {})},
    body: JSON.stringify({args: {n: 1}, wait: 20})})).json();
  check(other.state === "done", "other " + JSON.stringify(other));
  el("trace-id").value = other.call_id;
  await el("trace-open").onclick();
  await until(() => rows("trace").some((r) => r[5] === "done") && text("trace-head").includes(other.call_id),
    () => "the opened call's trace: " + text("trace-head") + text("trace-err"));
  check(el("calls").children.length === 2 && el("calls").value === other.call_id, "calls list");
  el("trace-id").value = "0123456789abcdef0123456789abcdef";
  await el("trace-open").onclick();
  check(text("trace-err").startsWith("unknown_call: "), "unknown call: " + text("trace-err"));
  el("calls").value = id;
  el("trace-show").onclick();
  check(text("trace-head").includes(`call ${id}`), "back to the first call");

  const row = el("tools").children.find((tr) => tr.children[0].textContent === "greet");
  await row.children[5].children[0].onclick();
  check(confirms.length === 1 && confirms[0].includes("greet"), "confirm " + confirms);
  check(!rows("tools").some((r) => r[0] === "greet"), "greet still listed");
  check(text("regok") === "greet: removed", "removed " + text("regok") + text("regerr"));

  for (let i = 0; i < 600; i++) sandbox.logLine("filler " + i);
  await new Promise((r) => setTimeout(r, 50));   // (drawn at the next frame)
  const lines = text("log").split("\n");
  check(lines.length === 500 && lines[499] === "filler 599" && lines[0] === "filler 100", "cap " + lines.length);

  console.log(JSON.stringify({ok: true, seen}));
  process.exit(0);
})().catch((e) => { console.error(e.stack || String(e)); process.exit(1); });
"""


@pytest.mark.parametrize("served", [None, "s3cret"], indirect=True, ids=["open", "token"])
def test_the_console_script_registers_runs_traces_and_removes_against_the_real_api(
    served: ConsoleServer, client: httpx.Client, tmp_path: Path
) -> None:
    node = _node()
    page = tmp_path / "console.html"
    page.write_text(client.get("/").text, encoding="utf-8")
    harness = tmp_path / "harness.js"
    harness.write_text(HARNESS, encoding="utf-8")
    greet = tmp_path / "greet.yaml"
    greet.write_text(GREET_YAML, encoding="utf-8")
    token = served.token or ""
    ran = subprocess.run(
        [node, str(harness), str(page), served.base, token, str(greet)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, f"stdout: {ran.stdout}\nstderr: {ran.stderr}"
    report = json.loads(ran.stdout.strip().splitlines()[-1])
    assert report["ok"] is True
    if token:
        assert report["seen"]["authorized"] == report["seen"]["requests"], "every /v1 request sent the bearer token"
        assert all("access_token=s3cret" in url for url in report["seen"]["streams"]), "EventSource: query token"
