"""The client is a library others import: ``import hermes_gateway`` loads no worker runtime."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_importing_the_client_loads_no_worker_module_no_jsonschema_and_no_tracing_sdk() -> None:
    code = "import sys, json, hermes_gateway; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert [m for m in loaded if m == "workers" or m.startswith("workers.")] == []
    assert [m for m in loaded if m.startswith("jsonschema")] == []
    # The span SDK (a worker's, or a CLI run with --trace) is loaded only where spans are exported.
    assert [m for m in loaded if m.startswith("opentelemetry.sdk.trace")] == []


def test_the_asyncio_client_is_exported_but_loaded_only_when_asked_for() -> None:
    code = (
        "import sys, hermes_gateway; before = 'hermes_gateway.aio' in sys.modules; "
        "from hermes_gateway import AsyncGateway; from hermes_gateway.aio import AsyncGateway as A; "
        "print(before, AsyncGateway is A, 'AsyncGateway' in hermes_gateway.__all__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True"]


def test_reading_the_policy_or_the_model_facing_tools_loads_no_argument_validator_and_no_hook() -> None:
    # (Gateway.tool_schemas, the Hermes plugin's tool list and `policy` commands import these on the client)
    code = "import sys, json, hermes_gateway.client, workers.policy; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert [m for m in loaded if m.startswith("jsonschema")] == []
    assert [m for m in loaded if m in ("workers.args", "workers.hooks", "workers.runner", "broker.audit")] == []
