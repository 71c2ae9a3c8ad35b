"""OpenAI's Batch API: `/v1/files` and `/v1/batches`, as the official `openai` SDK calls them.

Upload a JSONL file (`purpose=batch`), create a batch over it, poll it, download its output
file. Files and batches belong to the API key that created them: another key gets 404, exactly
as for an id that does not exist, and lists only its own. Uploads are streamed to disk under
their own limit (the 1 MiB body limit of the inference routes does not apply), refused before
anything is stored when their declared size is over it or the data volume lacks the room, then
stored where the store keeps file contents (the data directory, or PostgreSQL, which every
replica behind a balancer reads: any replica answers any call).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from batchstring.frontdoor.batch_api.runner import ENDPOINTS, BatchRunner, window_seconds
from batchstring.frontdoor.batch_api.store import MB, BatchStore, batch_object
from batchstring.frontdoor.gateway.auth import ApiKeys
from batchstring.frontdoor.gateway.tenants import owner
from batchstring.frontdoor.openai_api.routes import ApiError, json_body

MULTIPART_OVERHEAD = 64 * 1024  # the form's boundaries and the purpose field, beyond the file itself
CHUNK = 256 * 1024
MAX_METADATA_KEYS = 16  # as OpenAI: 16 pairs, keys up to 64 characters, values up to 512
MAX_LIST = 100


class BatchRoutes:
    def __init__(self, store: BatchStore, runner: BatchRunner, keys: ApiKeys) -> None:
        self.store, self.runner, self.keys = store, runner, keys

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self._api(self.upload))
        app.router.add_get("/v1/files", self._api(self.list_files))
        app.router.add_get("/v1/files/{id}", self._api(self.get_file))
        app.router.add_get("/v1/files/{id}/content", self._api(self.content))
        app.router.add_delete("/v1/files/{id}", self._api(self.delete_file))
        app.router.add_post("/v1/batches", self._api(self.create))
        app.router.add_get("/v1/batches", self._api(self.list_batches))
        app.router.add_get("/v1/batches/{id}", self._api(self.get_batch))
        app.router.add_post("/v1/batches/{id}/cancel", self._api(self.cancel))
        app.on_startup.append(lambda _: self.runner.start())

    @staticmethod
    def _api(handler):
        async def route(request: web.Request) -> web.StreamResponse:
            try:
                return await handler(request)
            except ApiError as exc:
                return exc.response()

        return route

    # ----- files -------------------------------------------------------------------------------

    async def upload(self, request: web.Request) -> web.Response:
        limits = self.store.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_file_bytes + MULTIPART_OVERHEAD:
            raise ApiError(413, f"the upload is {declared} bytes; files are at most {limits.max_file_bytes} bytes "
                                f"({limits.max_file_bytes / MB:g} MB): split it into several batches", "file")
        room = self.store.free_bytes() - limits.min_free_bytes
        if (declared or limits.max_file_bytes) > room:
            raise ApiError(507, f"the server's data volume has {max(room, 0)} bytes to spare for uploads; "
                                "try again later or ask the operator to free space", "file", "insufficient_storage")
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "upload a file as multipart/form-data with the fields file and purpose=batch")
        purpose, filename, written = None, None, None
        try:
            async for part in await request.multipart():
                if part.name == "purpose":
                    purpose = (await part.read_chunk(256)).decode("utf-8", "replace")
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    written = self.store.upload_path()
                    await self._save(part, written)
            if written is None:
                raise ApiError(400, "the form has no file field: send the JSONL file as `file`", "file")
            if purpose != "batch":
                raise ApiError(400, f"purpose must be 'batch' (the only purpose this server stores); got {purpose!r}",
                               "purpose")
            return web.json_response(self.store.add_file(owner(request, self.keys), filename, purpose, written))
        finally:
            if written is not None:
                written.unlink(missing_ok=True)

    async def _save(self, part, written) -> None:
        limit = self.store.limits.max_file_bytes
        size = 0
        with written.open("wb") as f:
            while chunk := await part.read_chunk(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the file is over {limit} bytes ({limit / MB:g} MB), the largest this "
                                        "server accepts: split it into several batches", "file")
                f.write(chunk)

    async def list_files(self, request: web.Request) -> web.Response:
        query = request.query
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc; got {order!r}", "order")
        limit = _limit(query.get("limit"), default=10_000, most=10_000)
        rows = self.store.files(owner(request, self.keys), query.get("purpose"), limit + 1, query.get("after"),
                                order == "asc")
        return web.json_response(_page(rows, limit))

    async def get_file(self, request: web.Request) -> web.Response:
        return web.json_response(self._file(request))

    async def content(self, request: web.Request) -> web.StreamResponse:
        found = self._file(request)
        response = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
        response.content_length = found["bytes"]
        await response.prepare(request)
        with self.store.open_file(found["id"]) as f:  # from a directory or the database, in parts
            while chunk := await asyncio.to_thread(f.read, CHUNK):
                await response.write(chunk)
        await response.write_eof()
        return response

    async def delete_file(self, request: web.Request) -> web.Response:
        found = self._file(request)
        if self.store.in_use(found["id"]):
            raise ApiError(409, f"{found['id']} is the input of a batch still running; cancel the batch first",
                           "file_id")
        self.store.delete_file(owner(request, self.keys), found["id"])
        return web.json_response({"id": found["id"], "object": "file", "deleted": True})

    def _file(self, request: web.Request) -> dict:
        file_id = request.match_info["id"]
        found = self.store.file(owner(request, self.keys), file_id)
        if found is None:
            raise ApiError(404, f"No such File object: {file_id}", "id")
        return found

    # ----- batches -----------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        tenant = owner(request, self.keys)
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS or (endpoint == ENDPOINTS[1] and self.runner.routes.chat is None):
            allowed = ENDPOINTS if self.runner.routes.chat else ENDPOINTS[:1]
            raise ApiError(400, f"endpoint must be one of {', '.join(allowed)}; got {endpoint!r}", "endpoint")
        try:
            seconds = window_seconds(body.get("completion_window", "24h"))
        except ValueError as exc:
            raise ApiError(400, str(exc), "completion_window") from None
        file_id = body.get("input_file_id")
        found = self.store.file(tenant, file_id) if isinstance(file_id, str) else None
        if found is None or found["purpose"] != "batch":
            raise ApiError(404 if found is None else 400, f"input_file_id {file_id!r} is not a file of purpose "
                                                          "batch uploaded with this key (POST /v1/files)",
                           "input_file_id")
        metadata = _metadata(body.get("metadata"))
        active = self.store.active_batches(tenant)
        if active >= self.store.limits.max_active_batches:
            raise ApiError(429, f"this key has {active} unfinished batches, the most allowed at once; wait for one "
                                "to end or cancel one", code="batch_limit_reached")
        row = self.store.add_batch(tenant, endpoint, file_id, body.get("completion_window", "24h"), seconds, metadata)
        self.runner.launch(row["id"])
        return web.json_response(batch_object(row))

    async def get_batch(self, request: web.Request) -> web.Response:
        return web.json_response(batch_object(self._batch(request)))

    async def list_batches(self, request: web.Request) -> web.Response:
        limit = _limit(request.query.get("limit"), default=20, most=MAX_LIST)
        rows = self.store.batches(owner(request, self.keys), limit + 1, request.query.get("after"))
        return web.json_response(_page([batch_object(r) for r in rows], limit))

    async def cancel(self, request: web.Request) -> web.Response:
        row = self._batch(request)
        if row["status"] in ("validating", "in_progress"):
            self.runner.cancel(row["id"])
        elif row["status"] not in ("cancelling", "cancelled"):
            raise ApiError(400, f"{row['id']} is {row['status']}; only a validating or in_progress batch can be "
                                "cancelled", "batch_id")
        return web.json_response(batch_object(self.store.batch_row(row["id"])))

    def _batch(self, request: web.Request):
        batch_id = request.match_info["id"]
        row = self.store.batch_row(batch_id, owner(request, self.keys))
        if row is None:
            raise ApiError(404, f"No batch found with id {batch_id!r}", "batch_id")
        return row


def _metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in metadata.items())):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA_KEYS} string pairs (keys up to "
                            "64 characters, values up to 512)", "metadata")
    return metadata


def _limit(value: str | None, default: int, most: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}; got {value!r}", "limit")
    return int(value)


def _page(rows: list[dict], limit: int) -> dict:
    data = rows[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}
