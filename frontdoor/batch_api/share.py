"""How many batch lines may be in flight: the batch's share of the engine.

Triton's priority levels put interactive requests ahead of batch lines *in Triton's queue*, but
a line already in the engine holds its row until it ends, and every row in a step makes the step
slower (on a CPU almost in proportion). So the runner also bounds its lines in flight: the
engine's rows (`max_num_seqs`) while nobody else calls, which keeps the engine full; and, while
interactive requests run, `share` times as many lines as there are interactive requests (at
least one), so that the steps they share stay short.

Interactive requests are counted where they all pass, in the front door (its drain counts every
admitted request, HTTP or gRPC; batch lines go to Triton's socket directly and are not among
them). The highest count of the last second is used: closed-loop callers leave short gaps
between their requests, which must not open the gate to a whole engine of batch lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import deque
from collections.abc import Callable

import aiohttp

from batchstring.client.defaults import MODEL

# Batch lines per interactive request while both run. Measured on the CPU config (docs/client.md, "Interactive
# first"): 0.5 kept the interactive p99 closest to its value alone. On a GPU,
# where a step's time grows far less with its rows, more is cheap: measure with batch-bench --share.
DEFAULT_SHARE = 0.5
SAMPLE_SECONDS = 0.02
MEMORY_SECONDS = 1.0  # interactive load is remembered this long
DEFAULT_ROWS = 64


async def engine_rows(triton_http: str) -> int | None:
    """The engine's `max_num_seqs`, from the model's config in Triton (None until it is loaded)."""
    unix = triton_http.startswith("/")
    base = "http://triton" if unix else f"http://{triton_http}"
    connector = aiohttp.UnixConnector(path=triton_http) if unix else None
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError, TypeError):
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=2)) as session, \
                session.get(f"{base}/v2/models/{MODEL}/config") as response:
            config = json.loads(await response.read())
            return int(config["parameters"]["max_num_seqs"]["string_value"])
    return None


class Admission:
    def __init__(self, share: float = DEFAULT_SHARE, fixed: int | None = None, triton_http: str | None = None,
                 interactive: Callable[[], int] | None = None) -> None:
        self.share, self.fixed, self.triton_http, self.interactive = share, fixed, triton_http, interactive
        self.rows = fixed or DEFAULT_ROWS
        self.limit = self.rows
        self.in_flight = 0
        self.paused = False
        self._room = asyncio.Event()
        self._recent: deque[tuple[float, int]] = deque()
        self._follower: asyncio.Task | None = None

    async def start(self) -> None:
        if self._follower is None and not self.fixed:
            self._follower = asyncio.create_task(self._follow())

    async def close(self) -> None:
        if self._follower:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    async def acquire(self) -> None:
        while self.in_flight >= self.limit:
            self._room.clear()
            await self._room.wait()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._room.set()

    def pause(self) -> None:
        """No new lines (the server is draining): those in flight finish, nothing new starts; the
        next start resumes the batches where they stopped."""
        self.paused = True
        self.limit = 0

    async def settled(self, seconds: float) -> int:
        """Waits up to `seconds` for the lines in flight to end; returns how many are still running."""
        deadline = time.monotonic() + seconds
        while self.in_flight and time.monotonic() < deadline:
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), deadline - time.monotonic())
        return self.in_flight

    def observe(self, interactive: int, now: float) -> None:
        """A new count of interactive requests: the limit for the next lines."""
        if self.paused:
            return
        self._recent.append((now, interactive))
        while self._recent[0][0] < now - MEMORY_SECONDS:
            self._recent.popleft()
        busy = max(count for _, count in self._recent)
        limit = self.rows if busy == 0 else max(1, min(self.rows, math.ceil(self.share * busy)))
        if limit != self.limit:
            self.limit = limit
            self._room.set()

    async def _follow(self) -> None:
        """Sizes the gate from the model's config once it is loaded, then follows the load."""
        while self.triton_http and (rows := await engine_rows(self.triton_http)) is None:
            await asyncio.sleep(1.0)
        if self.triton_http and not self.paused:
            self.rows = self.limit = rows
            self._room.set()
        while self.interactive is not None:
            self.observe(self.interactive(), time.monotonic())
            await asyncio.sleep(SAMPLE_SECONDS)
