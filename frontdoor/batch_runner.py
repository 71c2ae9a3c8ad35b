"""Runs batches: validating -> in_progress -> finalizing -> completed (or failed, cancelled, expired).

Each line is one request to Triton through the batchstring client, at the batch priority level,
so that Triton's dynamic batcher serves interactive requests first (model config,
`dynamic_batching.priority_levels`). All batches share one bound on lines in flight
(batch_share.py): the engine's rows while nobody else calls, a share of the interactive load
while somebody does.

Each answered line is recorded in the store as it completes; after a restart the runner resumes
every unfinished batch and skips what is recorded, so each line is answered exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchstring.client import AsyncBatchClient, Completion
from batchstring.client.jobs import Item, Malformed, envelope, output_line
from batchstring.client.protocol import BATCH
from batchstring.frontdoor.batch_share import Admission
from batchstring.frontdoor.batch_store import BatchStore
from batchstring.frontdoor.openai_api import ApiError, OpenAIRoutes
from batchstring.frontdoor.tenants import cache_salt

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
WINDOW = re.compile(r"([1-9][0-9]*)([mh])")
MAX_WINDOW_SECONDS = 7 * 24 * 3600
SHOWN_ERRORS = 100  # malformed lines listed in the batch's `errors` (all of them are in the error file)


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


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def validate(routes: OpenAIRoutes, endpoint: str, path: Path, max_lines: int) -> tuple[int, list[Malformed]]:
    """How many requests the file holds, and every malformed line (a repeated custom_id is one)."""
    seen: dict[str, int] = {}
    malformed = []
    for number, raw in read_lines(path):
        try:
            line = parse_line(routes, endpoint, number, raw)
        except Malformed as exc:
            malformed.append(exc)
            continue
        first = seen.setdefault(line.item.custom_id, number)
        if first != number:
            malformed.append(Malformed(number, f"custom_id {line.item.custom_id!r} repeats line {first}'s"))
    count = len(seen)
    if count > max_lines:
        malformed.append(Malformed(0, f"the file holds {count} requests; at most {max_lines} are allowed per batch"))
    elif count == 0 and not malformed:
        malformed.append(Malformed(0, "the file holds no requests"))
    return count, malformed


class BatchRunner:
    def __init__(self, store: BatchStore, client: AsyncBatchClient, routes: OpenAIRoutes,
                 admission: Admission | None = None) -> None:
        self.store, self.client, self.routes = store, client, routes
        self.admission = admission or Admission()
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancels: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        """Resumes every batch a previous run left unfinished."""
        await self.admission.start()
        for batch_id in self.store.unfinished():
            self.launch(batch_id)

    async def close(self) -> None:
        """Stops the running batches where they are; the next start resumes them."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.admission.close()

    def launch(self, batch_id: str) -> None:
        self.cancels[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._run(batch_id))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda done: self._ended(batch_id, done))

    def _ended(self, batch_id: str, task: asyncio.Task) -> None:
        """Forgets a batch's task; one that broke (a bug, a full disk) fails its batch, saying why,
        rather than leaving it in_progress until the next restart."""
        self.tasks.pop(batch_id, None)
        self.cancels.pop(batch_id, None)
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        print(f"frontdoor: batch {batch_id} failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        reason = {"code": "server_error", "message": f"the server could not run this batch ({type(error).__name__}: "
                                                    f"{error}); the lines answered before are in its output file",
                  "param": None, "line": None}
        with contextlib.suppress(Exception):  # the store itself may be what broke
            self.store.update(batch_id, errors=json.dumps({"object": "list", "data": [reason]}))
            self._finalize(self.store.batch_row(batch_id), "failed")

    def cancel(self, batch_id: str) -> None:
        """cancelling now; cancelled once the lines in flight are stopped and the outputs written."""
        self.store.set_status(batch_id, "cancelling")
        if batch_id in self.cancels:
            self.cancels[batch_id].set()
        else:
            self.launch(batch_id)

    # ----- one batch ---------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        if self.store.batch_row(batch_id)["status"] == "validating":
            await self._validate(self.store.batch_row(batch_id))
        if self.store.batch_row(batch_id)["status"] == "in_progress":
            await self._execute(self.store.batch_row(batch_id))
        row = self.store.batch_row(batch_id)
        if row["status"] in ("failed", "completed", "cancelled", "expired"):
            return
        unanswered = row["total"] - row["completed"] - row["failed"]
        if row["status"] == "cancelling":
            final = "cancelled"
        elif unanswered and time.time() >= row["expires_at"]:
            final = "expired"
        else:
            final = "completed"
        if row["status"] != "finalizing":
            self.store.set_status(batch_id, "finalizing")
        self._finalize(row, final)

    async def _validate(self, row) -> None:
        """in_progress with its request count, or failed with every malformed line's reason."""
        path = self.store.path(row["input_file_id"])
        if not path.exists():
            self._fail(row, [Malformed(0, f"the input file {row['input_file_id']} was deleted")])
            return
        total, malformed = await asyncio.to_thread(validate, self.routes, row["endpoint"], path,
                                                   self.store.limits.max_lines)
        if malformed:
            self._fail(row, malformed)
        elif self.store.batch_row(row["id"])["status"] == "validating":  # not cancelled meanwhile
            self.store.set_status(row["id"], "in_progress", total=total)

    def _fail(self, row, malformed: list[Malformed]) -> None:
        """failed at validation: the reasons in `errors` and, one line each, in the error file."""
        errors = [{"code": "invalid_request", "message": str(m), "param": None, "line": m.line or None}
                  for m in malformed]
        written = self.store.upload_path()
        with written.open("w", encoding="utf-8") as f:
            for error in errors:
                f.write(json.dumps({"id": None, "custom_id": None, "response": None, "error": error}) + "\n")
        self.store.update(row["id"], errors=json.dumps({"object": "list", "data": errors[:SHOWN_ERRORS]}))
        self.store.finish(row["id"], row["owner"], "failed", {"error_file_id": written})

    async def _execute(self, row) -> None:
        """Runs the unanswered lines until all are answered, the batch is cancelled, or it expires."""
        feeding = asyncio.create_task(self._feed(row))
        cancelled = asyncio.create_task(self.cancels[row["id"]].wait())
        expiry = asyncio.create_task(asyncio.sleep(max(0.0, row["expires_at"] - time.time())))
        try:
            await asyncio.wait([feeding, cancelled, expiry], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (feeding, cancelled, expiry):
                task.cancel()
            await asyncio.gather(feeding, cancelled, expiry, return_exceptions=True)
        if not feeding.cancelled() and feeding.exception():  # it broke: the batch fails (see _ended)
            raise feeding.exception()

    async def _feed(self, row) -> None:
        answered = self.store.answered(row["id"])
        pending: set[asyncio.Task] = set()
        try:
            for number, raw in read_lines(self.store.path(row["input_file_id"])):
                if number in answered:
                    continue
                line = parse_line(self.routes, row["endpoint"], number, raw)
                await self.admission.acquire()
                task = asyncio.create_task(self._one(row, line))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        finally:  # cancelled or expired: the lines in flight are stopped on the server too
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

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
        answer = json.dumps(output_line(line.item, result, self.routes.model_name, line.chat), ensure_ascii=False)
        self.store.record(row["id"], [(line.item.line, isinstance(result, Completion), answer)])

    def _finalize(self, row, final: str) -> None:
        """Writes the output file (answers) and the error file (failures, and lines the window left
        unanswered, as OpenAI reports them) from the recorded answers, and ends the batch."""
        if final == "expired":
            self._record_expired(row)
        outputs = {}
        for column, ok in (("output_file_id", True), ("error_file_id", False)):
            written = self.store.upload_path()
            count = 0
            with written.open("w", encoding="utf-8") as f:
                for body in self.store.results(row["id"], ok):
                    f.write(body + "\n")
                    count += 1
            if count or column == "output_file_id":
                outputs[column] = written
            else:
                written.unlink()
        self.store.finish(row["id"], row["owner"], final, outputs)

    def _record_expired(self, row) -> None:
        answered = self.store.answered(row["id"])
        error = {"code": "batch_expired", "message": "This request could not be executed before the completion "
                                                     "window expired."}
        expired = [(number, False, json.dumps({"id": None, "custom_id": parse_line(self.routes, row["endpoint"],
                                                                                    number, raw).item.custom_id,
                                               "response": None, "error": error}))
                   for number, raw in read_lines(self.store.path(row["input_file_id"])) if number not in answered]
        self.store.record(row["id"], expired)

