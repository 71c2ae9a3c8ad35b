"""`AsyncBatchClient`: the asyncio client. The sync `BatchClient` runs one of these on a thread."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc

from client.connection import Connection
from client.errors import BatchError, DeadlineExceeded, ItemError, StreamBroken, is_retryable_message
from client.protocol import GenerationOptions, Piece, build_request, encode_text
from client.retry import RetryPolicy

DEFAULT_URL = "localhost:8001"
DEFAULT_MAX_TOKENS = 64
HEALTH_PROBE_SECONDS = 2.0
DISCOVERY_SECONDS = 30.0


def _urls(url: str | Sequence[str]) -> list[str]:
    urls = [url] if isinstance(url, str) else list(url)
    urls = [u.strip() for part in urls for u in part.split(",") if u.strip()]
    if not urls:
        raise ValueError("at least one server URL (host:port) is required")
    return urls


def discover(urls: list[str]) -> dict[str, str]:
    """Every address a name resolves to (a Kubernetes headless Service lists each ready pod).

    Returns {"address:port": host}; the host is kept to verify TLS certificates by name.
    """
    found = {}
    for url in urls:
        host, _, port = url.rpartition(":")
        for *_, sockaddr in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM):
            address = sockaddr[0]
            found[f"[{address}]:{port}" if ":" in address else f"{address}:{port}"] = host
    return found


class AsyncBatchClient:
    """Sends each string as its own Triton request over one shared gRPC stream per server.

    Safe to share between tasks. With several URLs, each item goes to the ready server with the
    fewest items outstanding from this client (gRPC connections are long-lived, so spreading
    happens here rather than in a connection-level load balancer). With `discover=True` each URL's
    host name is resolved to all its addresses (one server each), again every 30 s.
    """

    def __init__(
        self,
        url: str | Sequence[str] = DEFAULT_URL,
        *,
        max_in_flight: int = 256,
        retry: RetryPolicy | None = None,
        tls: bool = False,
        root_certificates: str | Path | None = None,
        discover: bool = False,
    ) -> None:
        self._credentials = None
        if tls or root_certificates:
            root = Path(root_certificates).read_bytes() if root_certificates else None
            self._credentials = grpc.ssl_channel_credentials(root_certificates=root)
        self._urls = _urls(url)
        self._discover = discover
        self.connections: list[Connection] = []
        self._refresh_endpoints()
        self.retry = retry or RetryPolicy()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}-{uuid.uuid4().hex[:8]}"
        self._prober: asyncio.Task | None = None

    async def __aenter__(self) -> AsyncBatchClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._prober:
            self._prober.cancel()
        await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)

    async def ready(self) -> bool:
        """True if at least one server has the model ready."""
        return any(await asyncio.gather(*(c.model_ready() for c in self.connections)))

    # ----- the batch API -----------------------------------------------------------------------

    async def batchstring(
        self,
        inputs: Sequence[str],
        *,
        max_tokens: int | None = DEFAULT_MAX_TOKENS,
        temperature: float | None = 0.0,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[str | BaseException]:
        """Completions for `inputs`, in order. Greedy by default (temperature 0).

        `timeout` bounds the whole call, retries included (default: the retry policy's deadline).
        """
        if isinstance(inputs, str):
            raise TypeError("batchstring takes a list of strings, not a single string")
        encoded = [encode_text(text) for text in inputs]  # TypeError/ValueError before anything is sent
        if not encoded:
            return []
        options = GenerationOptions(max_tokens, temperature, top_p, top_k, seed,
                                    tuple(stop) if stop is not None else None, ignore_eos)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else self.retry.deadline)
        results = await asyncio.gather(*(self._complete(text, options, deadline) for text in encoded),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
        if not return_exceptions and any(isinstance(r, BaseException) for r in results):
            raise BatchError(results)
        return results

    async def stream(self, prompt: str, *, max_tokens: int | None = DEFAULT_MAX_TOKENS,
                     temperature: float | None = 0.0, **sampling) -> AsyncIterator[str]:
        """Yields text pieces as they are generated. Closing it (or cancelling the task that
        iterates it) cancels the request on the server, which frees its cache slot."""
        text = encode_text(prompt)
        options = GenerationOptions(max_tokens=max_tokens, temperature=temperature, **sampling)
        conn = self._pick()
        stream = conn.private_stream()
        finished = False
        try:
            async for piece in stream.request(build_request(self._new_id(), text, options, stream=True)):
                _raise_for(piece)
                if piece.text:
                    yield piece.text
            finished = True
        finally:
            conn.outstanding -= 1
            await stream.close(cancel=not finished)

    # ----- one item ----------------------------------------------------------------------------

    async def _complete(self, text: bytes, options: GenerationOptions, deadline: float) -> str:
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise DeadlineExceeded(f"no result before the deadline ({attempt - 1} attempts)")
            conn = self._pick()
            try:
                return await asyncio.wait_for(self._attempt(conn, text, options, remaining), remaining)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"no result before the deadline (attempt {attempt} timed out)") from None
            except ItemError as exc:
                if not exc.retryable or attempt >= self.retry.max_attempts:
                    raise
                if isinstance(exc, StreamBroken):
                    conn.mark_down(self.retry.initial_backoff)
                delay = self.retry.backoff(attempt)
                if loop.time() + delay >= deadline:
                    raise DeadlineExceeded(f"deadline reached while retrying; last error: {exc}") from exc
            finally:
                conn.outstanding -= 1
            await asyncio.sleep(delay)

    async def _attempt(self, conn: Connection, text: bytes, options: GenerationOptions, remaining: float) -> str:
        async with self._slots:
            request = build_request(self._new_id(), text, options, stream=False, queue_timeout_us=int(remaining * 1e6))
            pieces = [p async for p in conn.shared_stream().request(request)]
        for piece in pieces:
            _raise_for(piece)
        return "".join(p.text for p in pieces)

    def _refresh_endpoints(self) -> None:
        """(Re)builds the server list; connections to servers that are still listed are kept."""
        wanted = discover(self._urls) if self._discover else dict.fromkeys(self._urls)
        kept = [c for c in self.connections if c.url in wanted]
        for gone in set(self.connections) - set(kept):
            asyncio.get_running_loop().create_task(gone.close())
        known = {c.url for c in kept}
        added = [Connection(u, self._credentials, wanted[u]) for u in wanted if u not in known]
        self.connections = kept + added

    def _pick(self) -> Connection:
        if self._prober is None and (len(self.connections) > 1 or self._discover):
            self._prober = asyncio.create_task(self._probe())
        healthy = [c for c in self.connections if c.healthy] or self.connections
        conn = min(healthy, key=lambda c: c.outstanding)
        conn.outstanding += 1  # counted from the choice, so a burst of picks spreads out
        return conn

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def _probe(self) -> None:
        """Marks servers whose model is not ready as down, so new items skip them; rediscovers."""
        last_discovery = asyncio.get_running_loop().time()
        while True:
            connections = list(self.connections)
            ready = await asyncio.gather(*(c.model_ready() for c in connections))
            for conn, ok in zip(connections, ready):
                if not ok:
                    conn.mark_down(HEALTH_PROBE_SECONDS * 1.5)
            await asyncio.sleep(HEALTH_PROBE_SECONDS)
            if self._discover and asyncio.get_running_loop().time() - last_discovery > DISCOVERY_SECONDS:
                with contextlib.suppress(OSError):  # keep the current list if DNS is down
                    self._refresh_endpoints()
                last_discovery = asyncio.get_running_loop().time()


def _raise_for(piece: Piece) -> None:
    if piece.error:
        raise ItemError(piece.error, retryable=is_retryable_message(piece.error))
