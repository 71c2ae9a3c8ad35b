"""Whether the front door should be sent work: the model process behind Triton is alive, and
the front door is not stopping (`Drain`).

In Triton 2.51 `/v2/models/llm/ready` stays 200 after the Python backend's stub process (the
model process, where the engine runs) has died: requests then fail with "stub process is not
healthy" and nothing restarts it. So the front door looks for the stub itself: a child process
of its tritonserver, found in /proc. Readiness through the front door is Triton's answer and
this one together.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tritonclient.grpc import service_pb2

STUB = b"triton_python_backend_stub"


def stub_alive(triton_pid: int, proc: Path = Path("/proc")) -> bool:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == triton_pid and state != "Z" and STUB in (entry / "cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while we looked
    return False


class ModelProcess:
    """The model process behind one tritonserver (`triton_pid`; None: not watched, as when the
    front door is pointed at a server it did not start). Every readiness answer the front door
    gives, over HTTP or gRPC, to a probe, a client or its own exit watch, passes through `judge`,
    so `has_been_ready` is true as soon as anyone was told "ready": a model that dies between two
    polls of the watch has still served, and its death is not mistaken for a slow load."""

    LOOK_EVERY = 0.5  # seconds: a /proc scan runs on the event loop; probes may come much more often

    def __init__(self, triton_pid: int | None = None) -> None:
        self.triton_pid = triton_pid
        self.has_been_ready = False
        self._looked, self._gone = -self.LOOK_EVERY, False

    def gone(self) -> bool:
        if self.triton_pid is None:
            return False
        now = time.monotonic()
        if now - self._looked >= self.LOOK_EVERY:
            self._looked, self._gone = now, not stub_alive(self.triton_pid)
        return self._gone

    def judge(self, triton_ready: bool) -> bool:
        ready = triton_ready and not self.gone()
        self.has_been_ready |= ready
        return ready


class Drain:
    """The front door's stop, in the order that loses nothing: from `begin()` on, readiness is off
    (load balancers and our client's prober move new work elsewhere) and every new request is
    refused with a retryable UNAVAILABLE, while the requests already admitted run to their end.
    Only then may the ports close and tritonserver stop: nothing is left for either to wait for.

    Requests are counted from admission to their last byte: an HTTP request or unary call while
    its handler runs, a request on a gRPC stream until Triton's final response to it (a stream
    outlives its requests: our client keeps one open per call). A request whose last response
    Triton sends without data and unmarked (a client that did not set
    `triton_enable_empty_final_response`, as our client does) counts until the deadline.
    """

    MESSAGE = "UNAVAILABLE: the server is shutting down; send the request again (to another server)"

    def __init__(self) -> None:
        self.draining = False
        self._requests = 0
        self._streams: set[StreamRequests] = set()

    def begin(self) -> None:
        self.draining = True

    @property
    def pending(self) -> int:
        return self._requests + sum(s.pending for s in self._streams)

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        self._requests += 1
        try:
            yield
        finally:
            self._requests -= 1

    @contextlib.contextmanager
    def stream(self, cut: Callable[[], None]) -> Iterator[StreamRequests]:
        """A gRPC stream's requests; `cut` ends the stream if its requests outlast the drain."""
        requests = StreamRequests(cut)
        self._streams.add(requests)
        try:
            yield requests
        finally:
            self._streams.discard(requests)

    async def wait(self, seconds: float) -> int:
        """Waits until no admitted request is left, at most `seconds`; ends the streams of those
        left then (their clients see the stream break and send them again). Returns how many."""
        self.begin()
        deadline = time.monotonic() + seconds
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.pending
        for requests in list(self._streams):
            if requests.pending:
                requests.cut()
        return left


class StreamRequests:
    """The requests of one gRPC stream that have no final response yet."""

    def __init__(self, cut: Callable[[], None]) -> None:
        self.pending = 0
        self.cut = cut

    def sent(self) -> None:
        self.pending += 1

    def answered(self, response: bytes) -> None:
        message = service_pb2.ModelStreamInferResponse.FromString(response)
        final = message.infer_response.parameters.get("triton_final_response")
        if message.error_message or (final is not None and final.bool_param):
            self.pending -= 1
