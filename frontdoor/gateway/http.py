"""The HTTP side: Triton's generate, infer and health routes, forwarded with a bounded body.

While the front door drains (health.py `Drain`) every route but `/v2/health/live` answers 503
with a retryable UNAVAILABLE message and closes its connection; requests already admitted run to
their end.

Bodies are read with a limit (aiohttp's `client_max_size` stops reading at it), so an oversized
request costs the front door at most that much memory and never reaches Triton; it gets 413 with
the limit in the message. Only the routes below are forwarded; anything else is 404 here.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from batchstring.client.defaults import MODEL
from batchstring.frontdoor.gateway import tenants
from batchstring.frontdoor.gateway.auth import ApiKeys
from batchstring.frontdoor.gateway.health import Drain, ModelProcess
from batchstring.frontdoor.gateway.limits import TRITON_HTTP_BYTES, Limits
from batchstring.frontdoor.openai_api.routes import OpenAIRoutes, error_response

GET_ROUTES = ("/v2", "/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}", f"/v2/models/{MODEL}/ready",
              f"/v2/models/{MODEL}/config", f"/v2/models/{MODEL}/stats")
POST_ROUTES = (f"/v2/models/{MODEL}/generate", f"/v2/models/{MODEL}/generate_stream", f"/v2/models/{MODEL}/infer")
FORWARDED_HEADERS = ("Content-Type", "Accept", "Inference-Header-Content-Length", "Content-Encoding")
RETURNED_HEADERS = ("Content-Type", "Inference-Header-Content-Length", "Cache-Control")
OPEN_ROUTES = ("/v2/health/live", "/v2/health/ready", f"/v2/models/{MODEL}/ready")  # probes need no key


def error(status: int, message: str, path: str = "") -> web.Response:
    """Errors in the shape the route's clients read: OpenAI's under /v1, Triton's elsewhere."""
    if path.startswith("/v1/"):
        return error_response(status, message)
    return web.json_response({"error": message}, status=status)


class Upstream:
    """Triton's HTTP server, over a pool of kept-alive connections: `address` is a Unix socket path
    (how `batchstring serve` and the image run it) or host:port. With `triton_pid`, readiness also
    requires the model's stub process to be alive (frontdoor/gateway/health.py `ModelProcess`)."""

    def __init__(self, address: str, triton_pid: int | None = None) -> None:
        self.address = address
        self.model = ModelProcess(triton_pid)
        self.base_url = "http://triton" if address.startswith("/") else f"http://{address}"
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.UnixConnector(path=self.address) if self.address.startswith("/") else None
        self.session = aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))

    async def ready(self) -> bool:
        """The model's readiness (False when Triton cannot be reached or the model process is gone)."""
        if self.model.gone():
            return False
        try:
            async with self.session.get(f"{self.base_url}/v2/models/{MODEL}/ready",
                                        timeout=aiohttp.ClientTimeout(total=2)) as response:
                return self.model.judge(response.status == 200)
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        if self.session:
            await self.session.close()

    async def forward(self, request: web.Request, body: bytes, tenant: str | None = None) -> web.StreamResponse:
        """`tenant`: with API keys on, the caller's; its prefix-cache salt goes into the request."""
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        if request.path.endswith(("/generate", "/generate_stream")):
            headers["Content-Type"] = "application/json"  # Triton parses it as JSON whatever `curl -d` says
            if tenant is not None:
                try:
                    body = tenants.salt_generate_body(body, tenant)
                except ValueError as exc:
                    return error(400, str(exc), request.path)
        try:
            async with self.session.request(request.method, self.base_url + request.path_qs, data=body or None,
                                            headers=headers) as upstream:
                returned = {k: upstream.headers[k] for k in RETURNED_HEADERS if k in upstream.headers}
                if not request.path.endswith("/generate_stream"):
                    return web.Response(status=upstream.status, body=await upstream.read(), headers=returned)
                response = web.StreamResponse(status=upstream.status, headers=returned)
                await response.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except aiohttp.ClientConnectionError as exc:
            return error(503, f"the model server is not reachable ({type(exc).__name__}); it may be restarting: "
                              "retry with backoff")


def make_app(upstream: Upstream, limits: Limits, openai: OpenAIRoutes | None = None,
             keys: ApiKeys | None = None, drain: Drain | None = None) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read() if request.method == "POST" else b""
        if len(body) > TRITON_HTTP_BYTES:  # Triton's own HTTP frontend crashes on bodies of a few MB
            return error(413, f"the request body is {len(body)} bytes; Triton's HTTP routes take at most "
                              f"{TRITON_HTTP_BYTES} bytes: send longer prompts over gRPC or to /v1/completions",
                         request.path)
        tenant = tenants.owner(request, keys) if keys is not None and keys.enabled else None
        return await upstream.forward(request, body, tenant)

    async def readiness(request: web.Request) -> web.StreamResponse:
        response = await upstream.forward(request, b"")
        if response.status == 200 and not upstream.model.judge(True):
            return error(503, "the model process is gone (Triton still reports the model ready); "
                              "the server is being restarted")
        return response

    app = web.Application(client_max_size=limits.max_body_bytes,
                          middlewares=[_errors(limits, openai is not None), _draining(drain or Drain()),
                                       _auth(keys or ApiKeys([]))])
    app.router.add_routes([web.get(path, readiness if path.endswith("ready") else handle) for path in GET_ROUTES])
    app.router.add_routes([web.post(path, handle) for path in POST_ROUTES])
    if openai is not None:
        openai.add_to(app)
    app.on_startup.append(lambda _: upstream.start())
    app.on_cleanup.append(lambda _: upstream.close())
    return app


def make_metrics_app(upstream: Upstream) -> web.Application:
    async def metrics(request: web.Request) -> web.StreamResponse:
        return await upstream.forward(request, b"")

    app = web.Application(client_max_size=1024, middlewares=[_errors(Limits(max_body_bytes=1024))])
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(lambda _: upstream.start())
    app.on_cleanup.append(lambda _: upstream.close())
    return app


def _draining(drain: Drain) -> Callable:
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.path == "/v2/health/live":  # alive while it drains: no reason to kill it
            return await handler(request)
        if drain.draining:
            refused = error(503, Drain.MESSAGE, request.path)
            refused.force_close()  # a kept-alive client connection moves on, to another server
            return refused
        with drain.request():
            return await handler(request)

    return middleware


def _auth(keys: ApiKeys) -> Callable:
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.path in OPEN_ROUTES or keys.allows(request.headers.get("Authorization")):
            return await handler(request)
        return error(401, keys.REFUSAL, request.path)

    return middleware


def _errors(limits: Limits, openai: bool = False) -> Callable:
    gets, posts = list(GET_ROUTES), list(POST_ROUTES)
    if openai:
        gets.append("/v1/models")
        posts += ["/v1/completions", "/v1/chat/completions"]

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return error(413, limits.too_large("the request body", limits.max_body_bytes), path)
        except web.HTTPNotFound:
            return error(404, f"no route {path!r} here; the front door serves GET {', '.join(gets)} "
                              f"and POST {', '.join(posts)}", path)
        except web.HTTPMethodNotAllowed as exc:
            allowed = ", ".join(exc.allowed_methods)
            return error(405, f"{request.method} is not allowed on {path}; use {allowed}", path)

    return middleware
