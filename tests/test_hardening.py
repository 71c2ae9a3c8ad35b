"""What clients and attackers actually send, through real servers: nothing brings the server down,
an isolated failure costs nobody else, a broken engine is detected and restarted, abandoned work
stops, and the client never lets one item spoil a shared stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from batchstring.client import (
    AsyncBatchClient,
    BatchClient,
    BatchstringError,
    DeadlineExceeded,
    InvalidArgument,
    RetryPolicy,
    Unavailable,
)
from batchstring.server.stats import metrics
from batchstring.server.supervisor import Supervisor
from tests.conftest import FAULT_MARKER, metric_reaches, start_server

POOL = [f"def worker_{i}(job):\n    " for i in range(16)]


def post(url: str, body: bytes, content_type: str = "application/x-www-form-urlencoded") -> tuple[int, str]:
    """What `curl -d @file` sends: a form-encoded content type, whatever the body is."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_oversized_requests_on_every_route_are_refused_and_nothing_in_flight_is_lost(server, client):
    expected = client.batchstring(POOL, max_tokens=24, ignore_eos=True)
    triton_pid, stub_pid = server.process.pid, server.stub_processes()[0].pid
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(lambda: [client.batchstring(POOL, max_tokens=24, ignore_eos=True) for _ in range(3)])
        big = b"text_input=" + b"x" * (4 << 20)  # 4 MB crashed Triton 2.51's HTTP frontend outright
        for route in ("generate", "generate_stream", "infer"):
            status, body = post(f"http://{server.http_url}/v2/models/llm/{route}", big)
            assert status == 413 and "1048576 bytes" in json.loads(body)["error"], (route, status, body)
        for path in ("/v2/health/ready", "/v2/models/llm/ready", "/v2/repository/index", "/metrics"):
            status, _ = post(f"http://{server.http_url}{path}", big)
            assert status in (404, 405, 413), (path, status)
        status, _ = post(server.metrics_url, big)
        assert status in (405, 413)
        with grpc.insecure_channel(server.grpc_url, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = service_pb2.ModelInferRequest(model_name="llm", raw_input_contents=[b"x" * (4 << 20)])
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.ModelStreamInfer(iter([request]), timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1048576" in refused.value.details()
        assert in_flight.result(timeout=120) == [expected] * 3, "every request in flight was answered, correctly"
    assert server.process.pid == triton_pid and server.process.poll() is None, "tritonserver never went down"
    assert server.stub_processes()[0].pid == stub_pid and server.model_ready()


def test_admin_apis_are_unreachable_from_outside(server):
    status, body = post(f"http://{server.http_url}/v2/repository/index", b"{}", "application/json")
    assert status == 404 and "no route" in body
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for call, message in ((stub.RepositoryIndex, service_pb2.RepositoryIndexRequest()),
                              (stub.RepositoryModelUnload, service_pb2.RepositoryModelUnloadRequest(model_name="llm")),
                              (stub.LogSettings, service_pb2.LogSettingsRequest())):
            with pytest.raises(grpc.RpcError) as refused:
                call(message, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert server.model_ready()
    assert server.sockets.directory.stat().st_mode & 0o777 == 0o700, "tritonserver is reachable by its user only"


def test_the_client_refuses_an_item_over_the_server_limit_without_spoiling_the_others(server, client):
    results = client.batchstring(["def fine():", "x" * (2 << 20), "def also_fine():"], max_tokens=4,
                                 return_exceptions=True)
    assert isinstance(results[1], InvalidArgument) and not results[1].retryable
    assert "at most 1048576 bytes" in str(results[1])
    assert isinstance(results[0], str) and isinstance(results[2], str)


def test_an_expired_deadline_stops_the_work_on_the_server(server):
    # 64 items of 450 tokens share the batch (each needs several seconds); the 2 s deadline leaves
    # ample time for every item to reach the engine first, and passes long before any can finish.
    items, before = 64, metrics(server.metrics_url)
    with BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=1)) as c:
        results = c.batchstring([f"def slow_{i}():" for i in range(items)], max_tokens=450, ignore_eos=True,
                                timeout=2.0, return_exceptions=True)
    assert all(isinstance(r, DeadlineExceeded) for r in results)
    dropped = metric_reaches(server.metrics_url, "batchstring_cancelled_total",
                             before.get("batchstring_cancelled_total", 0) + items)
    assert dropped - before.get("batchstring_cancelled_total", 0) >= items
    time.sleep(0.6)
    after = metrics(server.metrics_url)
    generated = after["batchstring_generated_tokens_total"] - before["batchstring_generated_tokens_total"]
    assert generated < items * 450 * 0.6, "the server stopped generating what nobody would read"
    assert after["batchstring_running_sequences"] == 0 and after["batchstring_waiting_sequences"] == 0


def test_cancelling_a_batchstring_call_cancels_its_items_on_the_server(server):
    # 48 items of 450 tokens share the batch: each takes seconds, far longer than the cancellation
    # needs to reach the engine (the responder asks Triton about every live request twice a second).
    # No speculation: it drafts this repetitive text several tokens a step, and an item that finishes
    # before its cancellation arrives is not cancelled.
    items = 48
    before = metrics(server.metrics_url)

    async def cancelled_call() -> None:
        async with AsyncBatchClient(server.grpc_url) as c:
            task = asyncio.create_task(c.batchstring([f"def long_{i}():" for i in range(items)], max_tokens=450,
                                                     ignore_eos=True, speculative=False))
            await asyncio.to_thread(metric_reaches, server.metrics_url, "batchstring_running_sequences", items)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(cancelled_call())
    name = "batchstring_cancelled_total"
    assert metric_reaches(server.metrics_url, name, before.get(name, 0) + items) - before.get(name, 0) >= items
    after = metrics(server.metrics_url)
    finished = "batchstring_generated_tokens_total"
    assert after[finished] - before[finished] < items * 450 / 2, "the items stopped well before their end"
    deadline = time.monotonic() + 10
    while metrics(server.metrics_url)["batchstring_running_sequences"] and time.monotonic() < deadline:
        time.sleep(0.25)
    assert metrics(server.metrics_url)["batchstring_running_sequences"] == 0


def test_a_stream_has_a_deadline(client):
    # 480 tokens one at a time (no speculation, which would draft this repetitive text) outlast 0.2 s
    with pytest.raises(DeadlineExceeded):
        list(client.stream("def endless():", max_tokens=480, ignore_eos=True, speculative=False, timeout=0.2))


# ----- a broken engine is detected and the server restarted ----------------------------------


@pytest.fixture(scope="module")
def supervised(request, model_dir):
    server = start_server(request, "supervised", config="cpu",
                          params={"fault_marker": FAULT_MARKER, "stall_seconds": "3"})
    events: list[tuple[float, str]] = []
    supervisor = Supervisor(server, interval=0.5, report=lambda line: events.append((time.monotonic(), line)))
    stop = threading.Event()
    watcher = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    watcher.start()
    yield server, supervisor, events
    stop.set()
    watcher.join()


@pytest.mark.parametrize("fault", ["loop", "stall", "device"])
def test_a_broken_engine_is_restarted_and_every_item_is_right_or_a_retryable_error(supervised, fault):
    server, supervisor, events = supervised
    with BatchClient(server.grpc_url) as c:
        reference = dict(zip(POOL, c.batchstring(POOL, max_tokens=12)))
    restarts = supervisor.restarts
    outcomes: list[tuple[str, object]] = []
    until = time.monotonic() + 12  # load before, across and after the fault and the restart

    def caller(k: int) -> None:
        with BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=30, max_backoff=1.0)) as c:
            n = 0
            while time.monotonic() < until:
                items = [POOL[(k * 5 + n + i) % len(POOL)] for i in range(3)]
                outcomes.extend(zip(items, c.batchstring(items, max_tokens=12, timeout=40, return_exceptions=True)))
                n += 1

    with ThreadPoolExecutor(6) as pool:
        load = [pool.submit(caller, k) for k in range(6)]
        time.sleep(1.0)
        injected = time.monotonic()
        with BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=1)) as once:  # never resent: it breaks
            poisoned = once.batchstring([f"def poisoned(): # {FAULT_MARKER}:{fault}"], max_tokens=12, timeout=30,
                                        return_exceptions=True)[0]
        for f in load:
            f.result(timeout=120)
    assert isinstance(poisoned, Unavailable) and poisoned.retryable, poisoned
    back = [t for t, line in events if "serving again" in line and t > injected]
    assert supervisor.restarts == restarts + 1 and back, events
    assert back[0] - injected <= 30, f"served again {back[0] - injected:.1f} s after the fault"
    wrong = [(item, out) for item, out in outcomes if out != reference[item]
             and not (isinstance(out, BatchstringError) and out.retryable)]
    assert wrong == [], "every item: right, or an explicit retryable error"
    served_after = [out for item, out in outcomes[-18:]]
    assert served_after == [reference[item] for item, _ in outcomes[-18:]], "served again, correctly"


def test_a_failing_send_costs_only_its_request(server, client):
    expected = client.batchstring(POOL[:6], max_tokens=8)
    stub_pid = server.stub_processes()[0].pid
    with BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=1)) as c:
        pieces = c.stream(f"def unlucky(): # {FAULT_MARKER}:send", max_tokens=40, ignore_eos=True, timeout=30)
        with pytest.raises(BatchstringError, match="could not be sent") as failed:
            list(pieces)
    assert not failed.value.retryable
    assert client.batchstring(POOL[:6], max_tokens=8) == expected
    assert server.stub_processes()[0].pid == stub_pid and server.model_ready()


def test_an_isolated_failure_does_not_throttle_the_others(server, client):
    def admission_steps_of_a_crowd() -> float:
        """Steps that admitted some of 48 strings: a few (they reach the engine in a wave or two);
        one per string if admissions were capped at 1, as the old bisection left them for 30 s."""
        before = metrics(server.metrics_url)
        client.batchstring([f"def crowd_{i}():" for i in range(48)], max_tokens=32, ignore_eos=True)
        time.sleep(0.6)  # metrics are published twice a second
        after = metrics(server.metrics_url)
        return after["batchstring_prefill_steps_total"] - before["batchstring_prefill_steps_total"]

    healthy = admission_steps_of_a_crowd()
    results = client.batchstring([*POOL[:15], POOL[15] + FAULT_MARKER], max_tokens=8, return_exceptions=True)
    assert isinstance(results[15], BatchstringError) and not isinstance(results[15], Unavailable)
    after = admission_steps_of_a_crowd()
    assert healthy < 16 and after <= max(12, 2 * healthy), (
        f"after an isolated failure the others are admitted as before ({after:.0f} admission steps vs {healthy:.0f})")
