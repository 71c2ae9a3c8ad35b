"""A round-robin TCP balancer in a background thread: what a Kubernetes Service or a compose
network puts in front of replicas, for tests and benchmarks.

Each accepted connection goes to the next backend in turn, to the one after it if that one does
not answer (a dead replica). Connection-level, as a Service is: a client that keeps one
connection alive talks to one replica, so clients that should spread open one per call.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import Counter


class RoundRobin:
    def __init__(self, backends: list[tuple[str, int]], host: str = "127.0.0.1") -> None:
        self.backends, self.host = backends, host
        self.port = 0
        self.served: Counter = Counter()  # connections per backend
        self._next = itertools.cycle(range(len(backends)))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="round-robin", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> RoundRobin:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _close(self) -> None:
        """Stops accepting and ends the connections still open."""
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, self.host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(len(self.backends)):
            backend = self.backends[next(self._next)]
            try:
                up_reader, up_writer = await asyncio.open_connection(*backend)
            except OSError:
                continue
            self.served[backend] += 1
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)
            return
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()
