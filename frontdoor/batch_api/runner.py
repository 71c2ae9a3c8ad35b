"""Runs batches: validating -> in_progress -> finalizing -> completed (or failed, cancelled, expired).

Every replica sharing a store runs one `BatchRunner`, and none of them owns a batch: a batch is
cut into chunks of requests at validation, and each runner claims chunks under a lease
(frontdoor/batch_api/store.py), renews its leases while it works and runs its chunks' lines on its own
engine, so one batch's lines fan out over every replica's engine, and the database is the only
thing the replicas share. A replica that dies stops renewing: its chunks' leases lapse and the
others take them over, skipping what is recorded. Whichever runner sees that a batch's work has
ended writes its outputs and its final status, once (the store's transaction decides). A
cancellation or a failure reaches the other replicas when they next renew (a third of the lease).

Each line is one request to Triton through the batchstring client, at the batch priority level,
so that Triton's dynamic batcher serves interactive requests first (model config,
`dynamic_batching.priority_levels`). A runner's lines in flight, all chunks together, share one
bound (batch_share.py): the engine's rows while nobody else calls, a share of the interactive
load while somebody does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from batchstring.client import AsyncBatchClient, Completion
from batchstring.client.jobs import Item, Malformed, envelope, output_line
from batchstring.client.protocol import BATCH
from batchstring.frontdoor.batch_api.share import Admission
from batchstring.frontdoor.batch_api.store import BatchStore, Chunk
from batchstring.frontdoor.gateway.tenants import cache_salt
from batchstring.frontdoor.openai_api.routes import ApiError, OpenAIRoutes

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
WINDOW = re.compile(r"([1-9][0-9]*)([mh])")
MAX_WINDOW_SECONDS = 7 * 24 * 3600
SHOWN_ERRORS = 100  # malformed lines listed in the batch's `errors` (all of them are in the error file)
CHUNK_LINES = 256  # requests per chunk: a lease's worth of work, small enough to spread over replicas
LEASE_SECONDS = 15.0  # a lapsed lease is taken over after this long; renewed every third of it
CHUNKS_AT_ONCE = 2  # chunks a runner holds: one running, one so that the engine never waits for a claim


def window_seconds(window: object) -> int:
    """`completion_window` ("24h", as OpenAI; any "<n>h" or "<n>m" up to a week) in seconds."""
    match = WINDOW.fullmatch(window) if isinstance(window, str) else None
    seconds = int(match[1]) * (3600 if match[2] == "h" else 60) if match else 0
    if not 60 <= seconds <= MAX_WINDOW_SECONDS:
        raise ValueError(f"completion_window must be a duration such as '24h' or '30m', from 1m to 168h; "
                         f"got {window!r}")
    return seconds


@dataclass(frozen=True)
class Line:
    item: Item
    chat: bool


def parse_line(routes: OpenAIRoutes, endpoint: str, number: int, raw: bytes) -> Line:
    """One input line as a request (the /v1 routes' own reading of a body), or Malformed."""
    custom_id, body = envelope(number, raw, endpoint, implicit=False)
    chat = endpoint == ENDPOINTS[1]
    try:
        request = routes.parse(body, chat)
    except ApiError as exc:
        raise Malformed(number, f"body: {exc}") from None
    if len(request.prompts) != 1 or request.stream or request.echo:
        raise Malformed(number, "body must ask for one completion of one prompt (a string prompt, n = 1), "
                                "without stream or echo")
    return Line(Item(number, custom_id, request.prompts[0], request.options), chat)


def read_lines(f, first: int = 1, offset: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, bytes) of each non-blank line of an open binary file, read from
    its current position, which is line `first` at byte `offset`."""
    for number, raw in enumerate(f, start=first):
        if raw.strip():
            yield number, offset, raw
        offset += len(raw)


def validate(routes: OpenAIRoutes, endpoint: str, f, max_lines: int,
             chunk_lines: int = CHUNK_LINES) -> tuple[int, list[Malformed], list[tuple[int, int, int]]]:
    """How many requests the file holds, every malformed line (a repeated custom_id is one), and
    its chunks: (first line number, byte offset, requests) for each run of `chunk_lines`."""
    seen: dict[str, int] = {}
    malformed, chunks = [], []
    for number, offset, raw in read_lines(f):
        try:
            line = parse_line(routes, endpoint, number, raw)
        except Malformed as exc:
            malformed.append(exc)
            continue
        first = seen.setdefault(line.item.custom_id, number)
        if first != number:
            malformed.append(Malformed(number, f"custom_id {line.item.custom_id!r} repeats line {first}'s"))
        elif len(seen) % chunk_lines == 1 or chunk_lines == 1:
            chunks.append([number, offset, 1])
        else:
            chunks[-1][2] += 1
    count = len(seen)
    if count > max_lines:
        malformed.append(Malformed(0, f"the file holds {count} requests; at most {max_lines} are allowed per batch"))
    elif count == 0 and not malformed:
        malformed.append(Malformed(0, "the file holds no requests"))
    return count, malformed, [tuple(chunk) for chunk in chunks]


class BatchRunner:
    def __init__(self, store: BatchStore, client: AsyncBatchClient, routes: OpenAIRoutes,
                 admission: Admission | None = None, lease_seconds: float = LEASE_SECONDS,
                 chunk_lines: int = CHUNK_LINES) -> None:
        self.store, self.client, self.routes = store, client, routes
        self.admission = admission or Admission()
        self.lease, self.chunk_lines = lease_seconds, chunk_lines
        self.me = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this runner, in leases
        self.running: dict[tuple[str, int], asyncio.Task] = {}
        self.wake: asyncio.Event | None = None
        self.loop: asyncio.Task | None = None

    async def start(self) -> None:
        """Works from now on on whatever is unfinished; one node first frees the leases a previous
        run of it left (nobody else can hold them)."""
        await self.admission.start()
        if not self.store.shared:
            self.store.release(None)
        self.wake = asyncio.Event()
        self.loop = asyncio.create_task(self._coordinate())

    async def close(self) -> None:
        """Stops where it is and gives its leases up, so that other replicas take over at once."""
        tasks = [t for t in (self.loop, *self.running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # the store may be what is gone
            self.store.release(self.me)
        await self.admission.close()

    def launch(self, batch_id: str | None = None) -> None:
        """Something new to do (a batch created): look now rather than at the next tick."""
        if self.wake is not None:
            self.wake.set()

    def cancel(self, batch_id: str) -> None:
        """cancelling now; cancelled once no replica runs its lines and its outputs are written."""
        self.store.cancel(batch_id)
        self._stop(batch_id)
        self.launch()

    # ----- the loop ----------------------------------------------------------------------------

    async def _coordinate(self) -> None:
        renewed = 0.0
        while True:
            try:
                if time.monotonic() - renewed >= self.lease / 3:
                    self._renew()
                    renewed = time.monotonic()
                await self._validate_one()
                self._claim()
                await self._finalize_ended()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a store that cannot be reached: try again at the next tick
                print(f"frontdoor: batch runner: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=min(1.0, self.lease / 6))

    def _renew(self) -> None:
        """Extends this runner's leases; stops the chunks it lost, and those of batches that were
        cancelled, failed elsewhere or ran out of their window."""
        held = self.store.renew(self.me, self.lease, list(self.running))
        now = time.time()
        for key in list(self.running):
            row = held.get(key)
            if row is None or row["status"] != "in_progress" or row["errors"] is not None or now >= row["expires_at"]:
                self.running.pop(key).cancel()

    def _claim(self) -> None:
        while len(self.running) < CHUNKS_AT_ONCE and not self.admission.paused:
            chunk = self.store.claim_chunk(self.me, self.lease)
            if chunk is None:
                return
            task = asyncio.create_task(self._chunk(chunk))
            self.running[chunk.batch_id, chunk.chunk] = task
            task.add_done_callback(lambda done, chunk=chunk: self._chunk_ended(chunk, done))

    def _stop(self, batch_id: str) -> None:
        for key in [k for k in self.running if k[0] == batch_id]:
            self.running.pop(key).cancel()

    # ----- validating --------------------------------------------------------------------------

    async def _validate_one(self) -> None:
        """in_progress with its request count and chunks, or failed with every malformed line's reason."""
        row = self.store.claim_validation(self.me, self.lease)
        if row is None:
            return
        try:
            with self.store.open_file(row["input_file_id"]) as f:
                total, malformed, chunks = await asyncio.to_thread(validate, self.routes, row["endpoint"], f,
                                                                   self.store.limits.max_lines, self.chunk_lines)
        except FileNotFoundError:
            total, malformed, chunks = 0, [Malformed(0, f"the input file {row['input_file_id']} was deleted")], []
        if malformed:
            errors = [{"code": "invalid_request", "message": str(m), "param": None, "line": m.line or None}
                      for m in malformed]
            self.store.update(row["id"], errors=json.dumps({"object": "list", "data": errors[:SHOWN_ERRORS]}))
            await asyncio.to_thread(self.store.finish, row["id"], "failed",
                                    [{"id": None, "custom_id": None, "response": None, "error": e} for e in errors])
        elif self.store.start(row["id"], self.me, total, chunks):
            self.launch()

    # ----- running a chunk ---------------------------------------------------------------------

    async def _chunk(self, chunk: Chunk) -> None:
        row = self.store.batch_row(chunk.batch_id)
        answered = await asyncio.to_thread(self.store.answered, chunk.batch_id, chunk.first_line, 2**62)
        pending: set[asyncio.Task] = set()
        try:
            for line in await asyncio.to_thread(self._lines, row, chunk, answered):
                await self.admission.acquire()
                task = asyncio.create_task(self._one(row, line))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        finally:  # stopped (lease lost, cancelled, expired, failed): the lines in flight stop on the server too
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _lines(self, row, chunk: Chunk, answered: set[int]) -> list[Line]:
        """The chunk's requests not answered yet (reading the input file from the chunk's start)."""
        lines = []
        with self.store.open_file(row["input_file_id"], chunk.start_offset) as f:
            for count, (number, _, raw) in enumerate(read_lines(f, chunk.first_line, chunk.start_offset)):
                if count == chunk.lines:
                    break
                if number not in answered:
                    lines.append(parse_line(self.routes, row["endpoint"], number, raw))
        return lines

    def _chunk_ended(self, chunk: Chunk, task: asyncio.Task) -> None:
        """Done: the chunk is marked so. Stopped: its lease is given up at once. Broke on its input
        (a line that no longer parses): the batch fails, saying why, on every replica. Broke on
        anything else (the store out of reach): the lease is given up, and the chunk runs again
        later, here or elsewhere, skipping what was recorded."""
        if self.running.get((chunk.batch_id, chunk.chunk)) is task:
            del self.running[chunk.batch_id, chunk.chunk]
        error = None if task.cancelled() else task.exception()
        with contextlib.suppress(Exception):  # the store may be what broke: the lease then lapses
            if task.cancelled() or error is not None:
                if isinstance(error, Malformed):
                    self._fail(chunk.batch_id, error)
                elif error is not None:
                    print(f"frontdoor: chunk {chunk.chunk} of {chunk.batch_id} stopped: {type(error).__name__}: "
                          f"{error}; it runs again later", file=sys.stderr, flush=True)
                self.store.release(self.me, chunk)
            else:
                self.store.chunk_done(chunk, self.me)
        self.launch()

    def _fail(self, batch_id: str, error: BaseException) -> None:
        print(f"frontdoor: batch {batch_id} failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        reason = {"code": "server_error", "message": f"the server could not run this batch ({type(error).__name__}: "
                                                    f"{error}); the lines answered before are in its output file",
                  "param": None, "line": None}
        self.store.update(batch_id, errors=json.dumps({"object": "list", "data": [reason]}))
        self._stop(batch_id)

    async def _one(self, row, line: Line) -> None:
        options = {**line.item.options, "cache_salt": cache_salt(row["owner"], line.item.options["cache_salt"])}
        timeout = max(60.0, row["expires_at"] - time.time())
        try:
            result = (await self.client.complete([line.item.prompt], **options, priority=BATCH, timeout=timeout,
                                                 return_exceptions=True))[0]
        except (TypeError, ValueError) as exc:  # refused before sending (text that is not UTF-8)
            result = exc
        finally:
            self.admission.release()
        model = line.item.options.get("adapter") or self.routes.model_name  # the model the line named
        answer = json.dumps(output_line(line.item, result, model, line.chat), ensure_ascii=False)
        good = isinstance(result, Completion)
        await asyncio.to_thread(self.store.record, row["id"], [(line.item.line, good, answer)])

    # ----- ending ------------------------------------------------------------------------------

    async def _finalize_ended(self) -> None:
        """Writes the outputs of every batch whose work has ended (answers; failures and, past the
        window, the lines left unanswered, as OpenAI reports them) and ends it."""
        for batch_id, final in self.store.finalizable():
            if final == "expired":
                await asyncio.to_thread(self._record_expired, self.store.batch_row(batch_id))
            elif final == "completed":
                self.store.set_status(batch_id, "finalizing")
            await asyncio.to_thread(self.store.finish, batch_id, final)

    def _record_expired(self, row) -> None:
        answered = self.store.answered(row["id"])
        error = {"code": "batch_expired", "message": "This request could not be executed before the completion "
                                                     "window expired."}
        with self.store.open_file(row["input_file_id"]) as f:
            expired = [(number, False, json.dumps({"id": None, "custom_id": parse_line(
                self.routes, row["endpoint"], number, raw).item.custom_id, "response": None, "error": error}))
                       for number, _, raw in read_lines(f) if number not in answered]
        self.store.record(row["id"], expired)
