"""The grpc executor against a real gRPC server with reflection, its types built at test time."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection

from broker.errors import CallCancelled, ExecutorError, InvalidArgs, InvalidSpec, OutputTooLarge, ToolTimeout
from broker.toolspec import ToolSpec
from workers.executors import grpc as grpcexec
from workers.specs import check_spec

SERVICE = "hermes.test.Greeter"
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def build_pool() -> descriptor_pool.DescriptorPool:
    f = descriptor_pb2.FileDescriptorProto(name="hermes_test.proto", package="hermes.test", syntax="proto3")
    req = f.message_type.add(name="GreetRequest")
    req.field.add(name="name", number=1, type=9, label=1)  # string
    req.field.add(name="times", number=2, type=5, label=1)  # int32
    rep = f.message_type.add(name="GreetReply")
    rep.field.add(name="message", number=1, type=9, label=1)
    rep.field.add(name="tags", number=2, type=9, label=3)  # repeated string
    svc = f.service.add(name="Greeter")
    for m in ("Greet", "Fail", "Slow", "Big"):
        svc.method.add(name=m, input_type=".hermes.test.GreetRequest", output_type=".hermes.test.GreetReply")
    svc.method.add(  # `times` replies, `name` seconds apart (at most), then ends or fails
        name="Count", input_type=".hermes.test.GreetRequest", output_type=".hermes.test.GreetReply", server_streaming=True
    )
    svc.method.add(
        name="Collect", input_type=".hermes.test.GreetRequest", output_type=".hermes.test.GreetReply", client_streaming=True
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return pool


@pytest.fixture(scope="module")
def address():
    pool = build_pool()
    Req = message_factory.GetMessageClass(pool.FindMessageTypeByName("hermes.test.GreetRequest"))
    Rep = message_factory.GetMessageClass(pool.FindMessageTypeByName("hermes.test.GreetReply"))

    def greet(request, context):
        meta = dict(context.invocation_metadata())
        return Rep(
            message=f"Hello, {request.name}!",
            tags=[meta.get("traceparent", ""), meta.get("x-tenant", ""), meta.get("baggage", "")],
        )

    def fail(request, context):
        context.abort(getattr(grpc.StatusCode, request.name), f"backend refused: {request.name}")

    def slow(request, context):
        end = time.monotonic() + request.times
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.02)
        return Rep(message="late")

    def big(request, context):
        return Rep(message="x" * request.times)

    def count(request, context):
        pause = float(request.name) if request.name.replace(".", "").isdigit() else 0.0
        for i in range(request.times):
            if i and pause:
                time.sleep(pause)
            if not context.is_active():
                return
            yield Rep(message=f"{i + 1}", tags=[dict(context.invocation_metadata()).get("traceparent", "")])
        if request.name == "fail":
            context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")

    def collect(requests, context):
        return Rep(message=",".join(r.name for r in requests))

    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=Req.FromString, response_serializer=Rep.SerializeToString
        )
        for name, fn in (("Greet", greet), ("Fail", fail), ("Slow", slow), ("Big", big))
    }
    handlers["Count"] = grpc.unary_stream_rpc_method_handler(
        count, request_deserializer=Req.FromString, response_serializer=Rep.SerializeToString
    )
    handlers["Collect"] = grpc.stream_unary_rpc_method_handler(
        collect, request_deserializer=Req.FromString, response_serializer=Rep.SerializeToString
    )
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server, pool=pool)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def ex():
    executor = grpcexec.GrpcExecutor({})
    yield executor
    executor.close()


def spec(address: str, method: str, **extra) -> ToolSpec:
    return check_spec(
        {"name": "t", "executor": "grpc", "target": address, "method": f"{SERVICE}/{method}", **extra}
    )


def test_unary_call_json_in_json_out_with_trace_metadata(ex, address, make_ctx):
    out = ex.run(
        spec(address, "Greet", metadata={"X-Tenant": "acme"}),
        {"name": "北京"},
        make_ctx(traceparent=TP, baggage="user=7"),
    )
    assert out == {"message": "Hello, 北京!", "tags": [TP, "acme", "user=7"]}


def test_dotted_method_name_is_accepted(ex, address, make_ctx):
    s = check_spec({"name": "t", "executor": "grpc", "target": address, "method": f"{SERVICE}.Greet"})
    assert ex.run(s, {"name": "a"}, make_ctx())["message"] == "Hello, a!"


def test_arguments_that_do_not_fit_the_message_are_invalid_args(ex, address, make_ctx):
    with pytest.raises(InvalidArgs):
        ex.run(spec(address, "Greet"), {"nmae": "typo"}, make_ctx())
    with pytest.raises(InvalidArgs):
        ex.run(spec(address, "Greet"), {"times": "many"}, make_ctx())


@pytest.mark.parametrize(
    ("code", "error", "retryable"),
    [
        ("INVALID_ARGUMENT", InvalidArgs, False),
        ("UNAVAILABLE", ExecutorError, True),
        ("NOT_FOUND", ExecutorError, False),
        ("PERMISSION_DENIED", ExecutorError, False),
        ("DEADLINE_EXCEEDED", ToolTimeout, True),
    ],
)
def test_status_codes_map_to_typed_errors(ex, address, make_ctx, code, error, retryable):
    with pytest.raises(error) as info:
        ex.run(spec(address, "Fail"), {"name": code}, make_ctx())
    assert f"backend refused: {code}" in str(info.value)
    assert info.value.retryable is retryable


def test_deadline_is_tool_timeout(ex, address, make_ctx):
    with pytest.raises(ToolTimeout):
        ex.run(spec(address, "Slow"), {"times": 30}, make_ctx(timeout=0.5))


def test_cancellation(ex, address, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    with pytest.raises(CallCancelled):
        ex.run(spec(address, "Slow"), {"times": 30}, ctx)


def test_oversize_response(ex, address, make_ctx):
    with pytest.raises(OutputTooLarge):
        ex.run(spec(address, "Big", max_output=1000), {"times": 5000}, make_ctx())


def test_unknown_method_and_unreachable_server(ex, address, make_ctx):
    with pytest.raises(ExecutorError, match="does not offer"):
        ex.run(spec(address, "Nope"), {}, make_ctx())
    with pytest.raises(ExecutorError):
        ex.run(spec("127.0.0.1:1", "Greet"), {"name": "x"}, make_ctx(timeout=2))


def test_bad_method_name_is_spec_error(ex, address, make_ctx):
    with pytest.raises(InvalidSpec):
        ex.run(
            check_spec({"name": "t", "executor": "grpc", "target": address, "method": "Greet"}),
            {},
            make_ctx(),
        )


def test_a_server_stream_comes_back_as_a_list_with_progress_while_it_runs(ex, address, make_ctx):
    ctx = make_ctx(traceparent=TP)
    out = ex.run(spec(address, "Count"), {"times": 4, "name": "0.15"}, ctx)
    assert out == [{"message": str(i), "tags": [TP]} for i in range(1, 5)]
    # One progress event per message here (they come 0.15 s apart), then the end.
    assert [m.split(",")[0] for m in ctx.messages] == [f"gRPC stream: {i} message(s)" for i in range(1, 5)] + [
        "gRPC stream ended: 4 message(s)"
    ]


def test_a_fast_stream_is_announced_at_most_every_tenth_of_a_second(ex, address, make_ctx):
    ctx = make_ctx()
    out = ex.run(spec(address, "Count"), {"times": 500}, ctx)
    assert len(out) == 500 and out[-1]["message"] == "500"
    assert len(ctx.messages) < 20 and ctx.messages[-1].startswith("gRPC stream ended: 500 message(s)")


def test_a_stream_is_cancelled_timed_out_capped_and_its_errors_typed(ex, address, make_ctx):
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(CallCancelled):
        ex.run(spec(address, "Count"), {"times": 100, "name": "0.1"}, ctx)
    assert time.monotonic() - started < 2  # stopped mid-stream, not after its 10 s
    with pytest.raises(ToolTimeout):
        ex.run(spec(address, "Count"), {"times": 100, "name": "0.1"}, make_ctx(timeout=0.5))
    with pytest.raises(OutputTooLarge):
        ex.run(spec(address, "Count", max_output=50), {"times": 100}, make_ctx())
    with pytest.raises(ExecutorError, match="stream broke") as info:
        ex.run(spec(address, "Count"), {"times": 2, "name": "fail"}, make_ctx())
    assert info.value.retryable is True


def test_a_client_streaming_method_is_refused_as_a_spec_error(ex, address, make_ctx):
    with pytest.raises(InvalidSpec, match="streams its requests"):
        ex.run(spec(address, "Collect"), {"name": "a"}, make_ctx())


@pytest.fixture
def silent_reflection():
    """A server whose reflection service takes the stream and never answers it."""
    release = threading.Event()

    def hang(requests, context):
        release.wait(30)
        return iter(())

    handler = grpc.stream_stream_rpc_method_handler(hang)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("grpc.reflection.v1alpha.ServerReflection", {"ServerReflectionInfo": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    release.set()
    server.stop(0)


def test_a_reflection_service_that_never_answers_is_held_to_the_timeout_and_the_cancel(
    ex, silent_reflection, make_ctx
):
    started = time.monotonic()
    with pytest.raises(ToolTimeout):
        ex.run(spec(silent_reflection, "Greet"), {"name": "x"}, make_ctx(timeout=0.8))
    assert time.monotonic() - started < 3  # (it waited for ever, holding the target for every other call)
    ctx = make_ctx(timeout=30)
    threading.Timer(0.3, ctx.cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(CallCancelled):
        ex.run(spec(silent_reflection, "Greet"), {"name": "x"}, ctx)
    assert time.monotonic() - started < 3
