"""`BatchClient` and `batchstring()`: the blocking API, for scripts and threaded web apps.

One background thread runs an event loop with an `AsyncBatchClient`; every call from any
thread is a coroutine submitted to that loop, so all threads share one stream per server.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future

from batchstring.client.aio import AsyncBatchClient
from batchstring.client.defaults import DEFAULT_MAX_TOKENS, DEFAULT_URL

_END = object()


class BatchClient:
    """Thread-safe blocking client; use as a context manager or call `close()`."""

    def __init__(self, url: str | Sequence[str] = DEFAULT_URL, **options) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="batchstring-client", daemon=True)
        self._thread.start()
        self._aio: AsyncBatchClient = self._call(self._create(url, options))

    @staticmethod
    async def _create(url, options) -> AsyncBatchClient:
        return AsyncBatchClient(url, **options)

    def _submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _call(self, coro):
        future = self._submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def batchstring(self, inputs: Sequence[str], **options) -> list:
        """See `AsyncBatchClient.batchstring`."""
        return self._call(self._aio.batchstring(inputs, **options))

    def complete(self, inputs: Sequence[str], **options) -> list:
        """See `AsyncBatchClient.complete`: each item's text, finish reason and token counts."""
        return self._call(self._aio.complete(inputs, **options))

    def ready(self) -> bool:
        return self._call(self._aio.ready())

    @property
    def resent(self) -> int:
        """Items sent again after a retryable failure, over the client's life."""
        return self._aio.resent

    def stream(self, prompt: str, **options) -> Iterator[str]:
        """Yields text pieces; closing the generator early cancels the request on the server."""
        pieces: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for piece in self._aio.stream(prompt, **options):
                    pieces.put(piece)
                pieces.put(_END)
            except BaseException as exc:  # delivered to the consuming thread
                pieces.put(exc)

        task = self._submit(pump())
        try:
            while (item := pieces.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            task.cancel()

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._aio.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def batchstring(
    inputs: Sequence[str],
    *,
    url: str | Sequence[str] = DEFAULT_URL,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    temperature: float | None = 0.0,
    timeout: float | None = None,
    **options,
) -> list:
    """One-shot convenience: connect, complete `inputs` in order, disconnect.

    For repeated calls keep a `BatchClient` open instead: it reuses its connection.
    """
    with BatchClient(url) as client:
        return client.batchstring(inputs, max_tokens=max_tokens, temperature=temperature, timeout=timeout,
                                  **options)
