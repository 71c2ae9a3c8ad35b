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

from batchstring.client.connection import CallStreams, Connection
from batchstring.client.defaults import API_KEY_ENV, DEFAULT_MAX_TOKENS, DEFAULT_URL, MAX_INPUT_BYTES, MAX_MESSAGE_BYTES
from batchstring.client.errors import (
    BatchError,
    BatchstringError,
    DeadlineExceeded,
    InvalidArgument,
    TooLarge,
)
from batchstring.client.protocol import Completion, GenerationOptions, Piece, build_request, encode_text
from batchstring.client.retry import RetryPolicy

HEALTH_PROBE_SECONDS = 2.0
DISCOVERY_SECONDS = 30.0


def _urls(url: str | Sequence[str]) -> list[str]:
    urls = [url] if isinstance(url, str) else list(url)
    urls = [u.strip() for part in urls for u in part.split(",") if u.strip()]
    if not urls:
        raise InvalidArgument("at least one server URL (host:port) is required")
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
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        api_key: str | None = None,
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self._api_key = api_key or os.environ.get(API_KEY_ENV) or None
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
        self._closing: set[asyncio.Task] = set()  # streams of finished calls, ending gracefully
        self.resent = 0  # items sent again after a retryable failure (a restart, a full queue)

    async def __aenter__(self) -> AsyncBatchClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._prober:
            self._prober.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.connections), return_exceptions=True)

    async def ready(self) -> bool:
        """True if at least one server has the model ready."""
        return any(await asyncio.gather(*(c.model_ready() for c in self.connections)))

    # ----- the batch API -----------------------------------------------------------------------

    async def batchstring(self, inputs: Sequence[str], **options) -> list[str | BaseException]:
        """Completions for `inputs`, in order: their text. Greedy by default (temperature 0).

        Takes `complete`'s options; with `return_exceptions`, a failed item is its exception.
        """
        results = await self.complete(inputs, **{**options, "return_exceptions": True})
        texts = [r.text if isinstance(r, Completion) else r for r in results]
        if not options.get("return_exceptions") and any(isinstance(r, BaseException) for r in texts):
            raise BatchError(texts)
        return texts

    async def complete(
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
        min_tokens: int | None = None,
        logprobs: int | None = None,
        timeout: float | None = None,
        return_exceptions: bool = False,
        priority: int | None = None,
        cache_salt: str | None = None,
        adapter: str | None = None,
        **sampling,
    ) -> list[Completion | BaseException]:
        """Each input's `Completion` (text, finish reason, token counts, log-probabilities), in order.

        `sampling` takes the rest of GenerationOptions: min_p, presence_penalty, frequency_penalty,
        repetition_penalty, logit_bias, one structured-output constraint (json_schema,
        json_object, regex, choice, grammar) that every completion of the call will match, and
        speculative (False: no speculative decoding for these requests).

        `timeout` bounds the whole call, retries included (default: the retry policy's deadline).
        `priority` is the Triton queue level (protocol.INTERACTIVE, the default, or protocol.BATCH,
        served only when no interactive request waits); `cache_salt` keeps the call's cached
        prefixes apart from those of requests with another salt. `adapter` names a LoRA adapter the
        server serves (`batchstring serve --lora NAME=DIR`); None: the base model.
        """
        if isinstance(inputs, str):
            raise InvalidArgument("batchstring takes a list of strings, not a single string")
        encoded = [encode_text(text) for text in inputs]  # InvalidArgument before anything is sent
        if not encoded:
            return []
        options = _options(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           stop=stop, ignore_eos=ignore_eos, min_tokens=min_tokens, logprobs=logprobs, **sampling)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else self.retry.deadline)
        streams = CallStreams()
        wire = {"priority": priority, "cache_salt": cache_salt, "adapter": adapter}
        try:
            results = await asyncio.gather(*(self._complete(text, options, deadline, streams, wire)
                                             for text in encoded),
                                           return_exceptions=True)
            for r in results:
                if isinstance(r, asyncio.CancelledError):
                    raise r
        except asyncio.CancelledError:
            await streams.close(cancel=True)  # the server stops generating this call's items
            raise
        # Items that ended in an error (a deadline) may still run on the server: cancelling the call's
        # streams stops them. The call's answer need not wait for the streams to end.
        task = asyncio.create_task(streams.close(cancel=any(isinstance(r, BaseException) for r in results)))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        if not return_exceptions and any(isinstance(r, BaseException) for r in results):
            raise BatchError(results)
        return results

    async def stream(self, prompt: str, **options) -> AsyncIterator[str]:
        """Yields text pieces as they are generated; takes `stream_pieces`' options."""
        async for piece in self.stream_pieces(prompt, **options):
            if piece.text:
                yield piece.text

    async def stream_pieces(self, prompt: str, *, max_tokens: int | None = DEFAULT_MAX_TOKENS,
                            temperature: float | None = 0.0, timeout: float | None = None,
                            priority: int | None = None, cache_salt: str | None = None,
                            adapter: str | None = None, **sampling) -> AsyncIterator[Piece]:
        """Yields the responses as they are generated; the last says how the generation ended and
        counts its tokens. Closing it (or cancelling the task that iterates it) cancels the request
        on the server, which frees its cache.

        `timeout` bounds the whole generation (default: the retry policy's deadline); the stream
        holds one of the client's in-flight slots; if it breaks before the first piece (a server
        restart, a full queue) it is retried like a `batchstring` item.
        """
        text = encode_text(prompt)
        options = _options(max_tokens=max_tokens, temperature=temperature, **sampling)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else self.retry.deadline)
        attempt, started = 0, False
        while True:
            attempt += 1
            async with self._slots:
                conn = self._pick()
                stream = conn.open_stream()
                finished = False
                try:
                    pieces = stream.request(self._request(text, options, stream=True, deadline=deadline,
                                                          priority=priority, cache_salt=cache_salt,
                                                          adapter=adapter))
                    while True:
                        # A deadline per piece, not a timeout around the yields: those would cancel
                        # whatever the consumer awaits between two pieces. Not wait_for: on Python
                        # 3.11 it drops a cancellation that arrives as a piece does.
                        try:
                            async with asyncio.timeout_at(deadline):
                                piece = await anext(pieces)
                        except StopAsyncIteration:
                            break
                        _raise_for(piece)
                        started = started or bool(piece.text)
                        yield piece
                    finished = True
                    return
                except TimeoutError:
                    raise DeadlineExceeded(f"the stream did not end before its deadline ({attempt} attempts)") from None
                except BatchstringError as exc:
                    if started or not exc.retryable or attempt >= self.retry.max_attempts:
                        raise
                    delay = self._next_delay(conn, exc, attempt, deadline)
                finally:
                    conn.outstanding -= 1
                    await stream.close(cancel=not finished)
            await asyncio.sleep(delay)

    # ----- one item ----------------------------------------------------------------------------

    async def _complete(self, text: bytes, options: GenerationOptions, deadline: float,
                        streams: CallStreams, wire: dict) -> Completion:
        loop = asyncio.get_running_loop()
        attempt = 0
        while True:
            attempt += 1
            if deadline - loop.time() <= 0:
                raise DeadlineExceeded(f"no result before the deadline ({attempt - 1} attempts)")
            try:
                async with asyncio.timeout_at(deadline), self._slots:
                    conn = self._pick()  # chosen when the item is sent, not when the call began
                    try:
                        request = self._request(text, options, stream=False, deadline=deadline, **wire)
                        pieces = [p async for p in streams.on(conn).request(request)]
                    finally:
                        conn.outstanding -= 1
                for piece in pieces:
                    _raise_for(piece)
                return Completion.join(pieces)
            except TimeoutError:
                raise DeadlineExceeded(f"no result before the deadline (attempt {attempt} timed out)") from None
            except BatchstringError as exc:
                if not exc.retryable or attempt >= self.retry.max_attempts:
                    raise
                delay = self._next_delay(conn, exc, attempt, deadline)
            await asyncio.sleep(delay)
            self.resent += 1

    def _request(self, text: bytes, options: GenerationOptions, stream: bool, deadline: float,
                 priority: int | None = None, cache_salt: str | None = None, adapter: str | None = None):
        """The request for one attempt, carrying what is left of the deadline (the server drops the
        work once nobody can read it); refused here if the server would refuse its size."""
        remaining = deadline - asyncio.get_running_loop().time()
        request = build_request(self._new_id(), text, options, stream=stream,
                                timeout_us=max(1, int(remaining * 1e6)), priority=priority, cache_salt=cache_salt,
                                adapter=adapter)
        size = request.ByteSize()
        if size > self.max_message_bytes:
            raise TooLarge(f"the request is {size} bytes; this client sends at most {self.max_message_bytes} bytes per "
                           f"request (max_message_bytes; the shipped model takes text_input up to {MAX_INPUT_BYTES} "
                           "bytes, a long-context model's front door more: raise max_message_bytes to match it)")
        return request

    def _next_delay(self, conn: Connection, exc: BatchstringError, attempt: int, deadline: float) -> float:
        # Any "not now" (a broken stream, a full queue, a draining server): the next attempt prefers
        # another server for a moment, if there is one.
        conn.mark_down(self.retry.initial_backoff)
        delay = self.retry.backoff(attempt)
        if asyncio.get_running_loop().time() + delay >= deadline:
            raise DeadlineExceeded(f"deadline reached while retrying; last error: {exc}") from exc
        return delay

    def _refresh_endpoints(self) -> None:
        """(Re)builds the server list; connections to servers that are still listed are kept."""
        wanted = discover(self._urls) if self._discover else dict.fromkeys(self._urls)
        kept = [c for c in self.connections if c.url in wanted]
        for gone in set(self.connections) - set(kept):
            asyncio.get_running_loop().create_task(gone.close())
        known = {c.url for c in kept}
        added = [Connection(u, self._credentials, wanted[u], self._api_key) for u in wanted if u not in known]
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


def _options(**values) -> GenerationOptions:
    """GenerationOptions from keyword arguments; an unknown one is the caller's mistake, said so."""
    known = set(GenerationOptions.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise InvalidArgument(f"unknown option(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
    for key in ("stop", "choice"):
        if values.get(key) is not None and not isinstance(values[key], str):
            values[key] = tuple(values[key])
    return GenerationOptions(**values)


def _raise_for(piece: Piece) -> None:
    if piece.error is not None:
        raise piece.error
