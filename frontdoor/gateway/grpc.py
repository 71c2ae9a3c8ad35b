"""The gRPC side: the inference and health methods of Triton's service, forwarded as raw bytes.

Messages are not parsed here: each one is handed to Triton's loopback gRPC server as it came, on
a channel of the same kind (unary, or bidirectional stream for ModelStreamInfer). The gRPC
library refuses a message larger than `max_message_bytes` with RESOURCE_EXHAUSTED before it is
read, so no request can make the server allocate more than that. Cancellation and deadlines pass
through: a client that cancels its stream cancels Triton's, which cancels its requests.

While the front door drains (frontdoor/gateway/health.py `Drain`), every new call but ServerLive is
refused with UNAVAILABLE, and so is every new request on a stream already open (answered on that
stream, under its own id, as Triton answers a request it refuses); the requests already sent run
on, and a stream whose requests outlast the drain is ended with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from batchstring.client.protocol import CACHE_SALT_PARAMETER as CACHE_SALT
from batchstring.frontdoor.gateway import tenants
from batchstring.frontdoor.gateway.auth import ApiKeys
from batchstring.frontdoor.gateway.health import Drain, ModelProcess, StreamRequests
from batchstring.frontdoor.gateway.limits import Limits

SERVICE = "/inference.GRPCInferenceService/"
UNARY = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
         "ModelStatistics", "ModelInfer")
STREAM = ("ModelStreamInfer",)
OPEN = ("ServerLive", "ServerReady", "ModelReady")  # health: probes need no key


READINESS = {"ServerReady": service_pb2.ServerReadyResponse, "ModelReady": service_pb2.ModelReadyResponse}


class Passthrough(grpc.GenericRpcHandler):
    """`model`: the model process to judge Triton's readiness answers by (frontdoor/gateway/health.py): the
    same answer over gRPC as over HTTP."""

    def __init__(self, upstream: str, limits: Limits, keys: ApiKeys | None = None, drain: Drain | None = None,
                 model: ModelProcess | None = None) -> None:
        self.keys = keys or ApiKeys([])
        self.drain = drain or Drain()
        self.model = model or ModelProcess()
        options = [("grpc.max_receive_message_length", 64 * 2**20),
                   ("grpc.max_send_message_length", limits.max_message_bytes)]
        self.channel = grpc.aio.insecure_channel(upstream, options=options)

    def service(self, details: grpc.HandlerCallDetails):
        name = details.method.removeprefix(SERVICE)
        if self.drain.draining and name in UNARY + STREAM and name != "ServerLive":
            return _refuse(name in STREAM, grpc.StatusCode.UNAVAILABLE, Drain.MESSAGE)
        if name in UNARY + STREAM and name not in OPEN and not self.keys.allows(_authorization(details)):
            return _refuse(name in STREAM, grpc.StatusCode.UNAUTHENTICATED, self.keys.REFUSAL)
        salt = self._salter(_authorization(details)) if name in ("ModelInfer", *STREAM) else _unchanged
        if name in READINESS:
            return grpc.unary_unary_rpc_method_handler(self._readiness(details.method, READINESS[name]))
        if name in UNARY:
            return grpc.unary_unary_rpc_method_handler(self._unary(details.method, salt))
        if name in STREAM:
            return grpc.stream_stream_rpc_method_handler(self._stream(details.method, salt))
        return None  # UNIMPLEMENTED: admin APIs (repository, shared memory, trace, logging) are not reachable

    def _salter(self, authorization: str | None) -> Callable[[bytes], bytes]:
        """With API keys on, each inference request gets its tenant's prefix-cache salt (mixed with the
        request's own `cache_salt`), as the /v1 routes do: no key can reuse or time another's cached
        prefixes. Requests are parsed only then; without keys they pass as they came."""
        if not self.keys.enabled:
            return _unchanged
        tenant = tenants.tenant(authorization, self.keys)

        def salted(request: bytes) -> bytes:
            try:
                message = service_pb2.ModelInferRequest.FromString(request)
            except DecodeError:
                return request  # Triton refuses it, as it would have
            own = message.parameters[CACHE_SALT].string_param if CACHE_SALT in message.parameters else None
            message.parameters[CACHE_SALT].string_param = tenants.cache_salt(tenant, own)
            return message.SerializeToString()

        return salted

    def _unary(self, method: str, salt: Callable[[bytes], bytes]):
        call = self.channel.unary_unary(method)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            with self.drain.request():
                try:
                    return await call(salt(request), timeout=context.time_remaining())
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details() or "")

        return handle

    def _readiness(self, method: str, response_type: type):
        forward = self._unary(method, _unchanged)

        async def handle(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            answer = response_type.FromString(await forward(request, context))
            return response_type(ready=self.model.judge(answer.ready)).SerializeToString()

        return handle

    def _stream(self, method: str, salt: Callable[[bytes], bytes]):
        call = self.channel.stream_stream(method)

        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            writing = asyncio.Lock()  # refusals and Triton's responses share the stream

            async def write(message: bytes) -> None:
                async with writing:
                    await context.write(message)

            async def admitted(counted: StreamRequests) -> AsyncIterator[bytes]:
                async for request in requests:
                    if self.drain.draining:
                        await write(_refusal(request))
                        continue
                    counted.sent()
                    yield salt(request)

            cut = False

            def cut_off() -> None:  # the drain deadline passed with requests of this stream unanswered
                nonlocal cut
                cut = True
                upstream.cancel()

            with self.drain.stream(cut_off) as counted:
                upstream = call(admitted(counted), timeout=context.time_remaining())
                try:
                    async for response in upstream:
                        counted.answered(response)
                        await write(response)
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details() or "")
                except asyncio.CancelledError:
                    if not cut:
                        raise  # the client left
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE: the server stopped before "
                                        "these requests finished (drain deadline); send them again")
                finally:
                    upstream.cancel()  # the client left (or the stream ended): Triton's side ends too

        return handle

    async def close(self) -> None:
        await self.channel.close()


def _unchanged(request: bytes) -> bytes:
    return request


def _authorization(details: grpc.HandlerCallDetails) -> str | None:
    return next((value for key, value in details.invocation_metadata or () if key == "authorization"), None)


def _refusal(request: bytes) -> bytes:
    """Triton's answer to a request it refuses on a stream: an error response under its id."""
    try:
        refused = service_pb2.ModelInferRequest.FromString(request)
    except DecodeError:
        refused = service_pb2.ModelInferRequest()  # not a request Triton could read either: no id to answer
    return service_pb2.ModelStreamInferResponse(
        error_message=Drain.MESSAGE,
        infer_response=service_pb2.ModelInferResponse(id=refused.id, model_name=refused.model_name)).SerializeToString()


def _refuse(stream: bool, code: grpc.StatusCode, message: str):
    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    async def streamed(requests, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield b""  # unreachable: makes this an async generator, as stream handlers are

    if stream:
        return grpc.stream_stream_rpc_method_handler(streamed)
    return grpc.unary_unary_rpc_method_handler(unary)


async def serve(host: str, port: int, upstream: str, limits: Limits, credentials: grpc.ServerCredentials | None = None,
                keys: ApiKeys | None = None, drain: Drain | None = None,
                model: ModelProcess | None = None) -> tuple[grpc.aio.Server, Passthrough]:
    handler = Passthrough(upstream, limits, keys, drain, model)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", 64 * 2**20),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ])
    server.add_generic_rpc_handlers((handler,))
    address = f"{host}:{port}"
    if credentials:
        server.add_secure_port(address, credentials)
    else:
        server.add_insecure_port(address)
    await server.start()
    return server, handler
