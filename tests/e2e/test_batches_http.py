"""Batches over HTTP (`serve`'s routes, real workers, real Redis): submit a JSON array or JSONL, status,
streamed results each index once, cancel, typed errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until
from tests.e2e.test_batches import MARK, _runs
from tests.e2e.test_http_api import Served

pytestmark = pytest.mark.e2e


@pytest.fixture
def api(gateway: Any, home: Any, workers: Any) -> Iterator[httpx.Client]:
    home.tool("mark", function=MARK, timeout=20, concurrency=4)
    gateway.sync_tools()
    workers(1, concurrency=8)
    served = Served(gateway)
    with httpx.Client(base_url=served.base, timeout=60) as client:
        yield client
    served.stop()


def test_a_json_array_batch_runs_and_its_results_stream_each_index_once(api: httpx.Client, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    items = [{"i": i, "path": str(marks)} for i in range(60)]
    r = api.post("/v1/batches?tool=mark", json=items)
    assert r.status_code == 202, r.text
    batch_id = r.json()["id"]
    assert r.json()["items"] == 60
    with api.stream("GET", f"/v1/batches/{batch_id}/results") as stream:  # follows until the batch is complete
        assert stream.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in stream.iter_lines() if line]
    assert sorted(x["index"] for x in lines) == list(range(60))
    assert all(x["state"] == "done" and x["result"]["twice"] == 2 * x["index"] for x in lines)
    status = api.get(f"/v1/batches/{batch_id}").json()
    assert status["state"] == "finished" and status["counts"]["done"] == 60 and status["total"] == 60
    assert batch_id in {b["id"] for b in api.get("/v1/batches").json()}
    again = api.post(f"/v1/batches?resume={batch_id}", json=items)  # the same items again: nothing reruns
    assert again.status_code == 202 and again.json()["id"] == batch_id, again.text
    assert len(api.get(f"/v1/batches/{batch_id}/results").text.splitlines()) == 60
    assert api.get(f"/v1/batches/{batch_id}").json()["counts"]["done"] == 60
    assert set(_runs(marks).values()) == {1}
    assert api.post("/v1/batches?resume=nosuch", json=items).status_code == 404
    assert api.post("/v1/batches?resume=", json=items).status_code == 404  # (an empty id is unknown too)


def test_a_jsonl_body_keeps_a_bad_line_as_a_failed_item_and_delete_cancels(api: httpx.Client, tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    body = "\n".join([json.dumps({"i": 0, "path": str(marks)}), "{not json", json.dumps({"i": 2, "path": str(marks)})])
    r = api.post("/v1/batches", params={"tool": "mark"}, content=body, headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 202, r.text
    got = {x["index"]: x for x in map(json.loads, api.get(f"/v1/batches/{r.json()['id']}/results").text.splitlines())}
    assert sorted(got) == [0, 1, 2]
    assert got[1]["state"] == "failed" and got[1]["error"]["type"] == "invalid_args"

    slow = [{"i": i, "path": str(marks), "seconds": 0.2} for i in range(100)]
    r = api.post("/v1/batches", json={"tool": "mark", "items": slow, "window": 10})
    batch_id = r.json()["id"]
    cancelled = api.delete(f"/v1/batches/{batch_id}")
    assert cancelled.status_code == 200
    # (a call already running ends once its worker hears of the cancel and stops the tool: a few ms on)
    status = wait_until(
        lambda: (s := api.get(f"/v1/batches/{batch_id}").json())["complete"] and s, timeout=10, message="the batch to end"
    )
    results = [json.loads(x) for x in api.get(f"/v1/batches/{batch_id}/results").text.splitlines()]
    assert status["state"] == "cancelled" and status["submitted"] < 100
    assert sorted(x["index"] for x in results) == list(range(status["submitted"]))


def test_batch_routes_answer_typed_errors(api: httpx.Client) -> None:
    assert api.get("/v1/batches/nosuch").json()["error"]["type"] == "unknown_batch"
    assert api.get("/v1/batches/nosuch").status_code == 404
    assert api.post("/v1/batches", json=[{"i": 1}]).status_code == 400  # no tool named
    assert api.post("/v1/batches?tool=nosuch", json=[{"i": 1}]).status_code == 404
    assert api.post("/v1/batches?tool=mark", content="[]", headers={"content-type": "text/plain"}).status_code == 400
    assert api.post("/v1/batches?tool=mark&window=0", json=[]).status_code == 400


def test_metrics_and_the_console_snapshot_count_each_batch_by_state(
    api: httpx.Client, gateway: Any, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from hermes_gateway import console_data

    marks = tmp_path / "marks"
    items: list[Any] = [{"i": i, "path": str(marks)} for i in range(20)]
    items[3] = "not arguments"
    batch_id = api.post("/v1/batches?tool=mark", json=items).json()["id"]
    api.get(f"/v1/batches/{batch_id}/results")  # (follows until complete)
    samples = {
        s.labels["hermes_batch_state"]: s.value
        for fam in text_string_to_metric_families(api.get("/metrics").text)
        for s in fam.samples
        if fam.name.startswith("hermes_batch_items") and s.labels.get("hermes_batch_id") == batch_id
    }
    assert samples == {"done": 19, "failed": 1, "cancelled": 0, "running": 0, "unsent": 0}
    row = next(b for b in console_data.snapshot(gateway)["batches"] if b["id"] == batch_id)
    assert row["counts"] == {"done": 19, "failed": 1, "cancelled": 0} and row["state"] == "finished"


def test_followers_of_a_stalled_batch_hold_no_server_thread_and_go_with_their_clients(gateway: Any, home: Any) -> None:
    # A batch on a queue no worker serves makes no progress; 50 followers that give up after half a
    # second (more than the server's thread pool of 40) leave every route that uses the pool answering.
    home.echo_tool("stalled", queue="nobody")
    gateway.sync_tools()
    served = Served(gateway)
    try:
        with httpx.Client(base_url=served.base, timeout=30) as client:
            r = client.post("/v1/batches?tool=stalled", json=[{}])
            assert r.status_code == 202, r.text
            batch_id = r.json()["id"]

            def follow(_: int) -> None:
                with pytest.raises(httpx.ReadTimeout):
                    with httpx.Client(base_url=served.base, timeout=0.5) as follower:
                        follower.get(f"/v1/batches/{batch_id}/results")

            with ThreadPoolExecutor(10) as pool:
                list(pool.map(follow, range(50)))
            assert client.get("/v1/status", timeout=10).status_code == 200
            assert client.get(f"/v1/batches/{batch_id}", timeout=10).json()["state"] != "finished"
            assert client.delete(f"/v1/batches/{batch_id}", timeout=10).json() == {"id": batch_id, "cancelled": 1}
    finally:
        served.stop()
