"""One server endpoint: a gRPC channel, and the bidirectional streams items travel on.

Every item is its own Triton request with its own id; responses come back on a stream in any
order and are routed to the waiting item by that id. A `batchstring` call multiplexes its items
over one stream per server (so cancelling the call cancels exactly its requests on the server),
and a `stream()` has one of its own. When a stream breaks, every item still in flight on it is
told so (and may be re-sent); a new stream is opened on next use.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from batchstring.client.defaults import MODEL
from batchstring.client.errors import BatchstringError, StreamBroken, from_status
from batchstring.client.protocol import Piece, parse_response

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),  # notice a dead peer on an idle connection
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]
_DONE = object()


class _Stream:
    def __init__(self, stub: service_pb2_grpc.GRPCInferenceServiceStub, metadata: tuple = ()) -> None:
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self.call = stub.ModelStreamInfer(self._requests(), metadata=metadata)
        self.closed = False
        self._reader = asyncio.create_task(self._read())

    async def _requests(self):
        while (request := await self._outbox.get()) is not _DONE:
            yield request

    async def _read(self) -> None:
        error: BatchstringError = StreamBroken("stream broken (closed by the server)")
        try:
            async for message in self.call:
                piece = parse_response(message)
                sink = self._sinks.get(piece.request_id)
                if sink is not None:  # else: a late answer to an item that gave up; drop it
                    sink.put_nowait(piece)
        except grpc.aio.AioRpcError as exc:  # what the status means for every item in flight on it
            error = from_status(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            error = StreamBroken("stream broken (cancelled)")
        finally:
            self.closed = True
            self._outbox.put_nowait(_DONE)  # ends the request iterator too
            for request_id, sink in self._sinks.items():
                sink.put_nowait(Piece(request_id, final=True, error=error))

    async def request(self, request: service_pb2.ModelInferRequest) -> AsyncIterator[Piece]:
        """Sends one request and yields its responses until the final one."""
        if self.closed:
            raise StreamBroken("stream already closed")
        sink: asyncio.Queue = asyncio.Queue()
        self._sinks[request.id] = sink
        try:
            self._outbox.put_nowait(request)
            while True:
                piece = await sink.get()
                if isinstance(piece.error, StreamBroken):
                    raise piece.error
                yield piece
                if piece.final:
                    return
        finally:
            self._sinks.pop(request.id, None)

    async def close(self, cancel: bool = False) -> None:
        """Half-closes the stream and lets the server end it; `cancel` aborts it instead.

        Ending streams gracefully matters: a cancelled stream can keep tritonserver's gRPC
        frontend waiting at shutdown, and cancelling means "stop generating" to the server.
        """
        self._outbox.put_nowait(_DONE)
        if not cancel:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reader), timeout=2.0)
        self.call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


class Connection:
    """A server endpoint, its health as this client sees it, and its load (outstanding items)."""

    def __init__(self, url: str, credentials: grpc.ChannelCredentials | None = None,
                 tls_name: str | None = None, api_key: str | None = None) -> None:
        self.url = url
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(url, options=CHANNEL_OPTIONS)
        else:  # tls_name: the certificate's name when `url` is an address found by discovery
            options = CHANNEL_OPTIONS + ([("grpc.ssl_target_name_override", tls_name)] if tls_name else [])
            self.channel = grpc.aio.secure_channel(url, credentials, options=options)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.outstanding = 0
        self.down_until = 0.0

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, seconds: float) -> None:
        self.down_until = time.monotonic() + seconds

    def open_stream(self) -> _Stream:
        return _Stream(self.stub, self.metadata)

    async def model_ready(self, timeout: float = 2.0) -> bool:
        try:
            reply = await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=MODEL), timeout=timeout,
                                               metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return False
        return reply.ready

    async def close(self) -> None:
        await self.channel.close()


class CallStreams:
    """The streams of one `batchstring` call: one per server it sends to, opened on first use and
    re-opened after a break. Closing them gracefully lets the server finish; cancelling them
    cancels every request of the call on the server."""

    def __init__(self) -> None:
        self._streams: dict[Connection, _Stream] = {}

    def on(self, conn: Connection) -> _Stream:
        stream = self._streams.get(conn)
        if stream is None or stream.closed:
            stream = self._streams[conn] = conn.open_stream()
        return stream

    async def close(self, cancel: bool) -> None:
        await asyncio.gather(*(s.close(cancel=cancel) for s in self._streams.values()), return_exceptions=True)
