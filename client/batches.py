"""`batchstring batches`: the server's OpenAI Batch API for people without the `openai` SDK.

`submit` uploads a JSONL file (the OpenAI batch format, as `batchstring run --input` reads) and
creates a batch that the server runs on its own: the terminal may close, the server may restart.
`status` shows its progress, `wait` follows it to the end, `download` fetches the output (and
error) file, `cancel` stops it keeping what is answered, `list` shows this key's batches.
Standard library only (urllib), so the client distribution gains no dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from batchstring.client.defaults import API_KEY_ENV

DEFAULT_HTTP_URL = "http://localhost:8000"
ENDED = ("completed", "failed", "cancelled", "expired")
CHUNK = 1 << 20


class ApiFailure(RuntimeError):
    pass


class BatchApi:
    """The few calls the subcommands make, over HTTP, with the key from the environment."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.base = url.rstrip("/").removesuffix("/v1") + "/v1"
        self.api_key = api_key or os.environ.get(API_KEY_ENV)
        self.timeout = timeout

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self._send(method, path, data, {"Content-Type": "application/json"}))

    def upload(self, path: Path) -> dict:
        """POST /v1/files, streamed: the file is never read into memory whole."""
        boundary = uuid.uuid4().hex
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
                "Content-Type: application/jsonl\r\n\r\n").encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        size = len(head) + path.stat().st_size + len(tail)
        headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(size)}
        return json.loads(self._send("POST", "/files", _parts(head, path, tail), headers))

    def download(self, file_id: str, target: Path) -> int:
        request = self._request("GET", f"/files/{file_id}/content")
        size = 0
        with self._open(request) as response, target.open("wb") as out:
            while chunk := response.read(CHUNK):
                out.write(chunk)
                size += len(chunk)
        return size

    def _request(self, method: str, path: str, data=None, headers: dict | None = None) -> urllib.request.Request:
        headers = dict(headers or {})
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.base + path, data=data, headers=headers, method=method)

    def _send(self, method: str, path: str, data, headers: dict) -> bytes:
        with self._open(self._request(method, path, data, headers)) as response:
            return response.read()

    def _open(self, request: urllib.request.Request):
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise ApiFailure(f"{exc.code}: {_message(exc.read())}") from None
        except urllib.error.URLError as exc:
            raise ApiFailure(f"cannot reach {self.base} ({exc.reason}); is the server running with its OpenAI "
                             "API on?") from None


def _parts(head: bytes, path: Path, tail: bytes) -> Iterator[bytes]:
    yield head
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk
    yield tail


def _message(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:500]


# ----- the subcommands ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_HTTP_URL, help="the server's HTTP address (default: %(default)s)")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    submit = sub.add_parser("submit", help="upload a JSONL file and start a batch over it")
    submit.add_argument("input", type=Path, help="JSONL in the OpenAI batch format")
    submit.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    submit.add_argument("--completion-window", default="24h", help="e.g. 24h or 30m (default: %(default)s)")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="then follow it to the end, as `wait`")
    for name, text in (("status", "show a batch's progress"), ("wait", "follow a batch to its end"),
                       ("cancel", "stop a batch, keeping the lines already answered")):
        sub.add_parser(name, help=text).add_argument("batch_id")
    download = sub.add_parser("download", help="save a batch's output (and error) file")
    download.add_argument("batch_id")
    download.add_argument("--output", type=Path, required=True, help="where the answers go (JSONL)")
    download.add_argument("--errors", type=Path, help="where the failed lines go (default: OUTPUT.errors.jsonl)")
    listing = sub.add_parser("list", help="this key's batches, newest first")
    listing.add_argument("--limit", type=int, default=20)


def run(args: argparse.Namespace) -> int:
    api = BatchApi(args.url)
    try:
        return ACTIONS[args.action](api, args)
    except ApiFailure as exc:
        print(f"batchstring batches {args.action}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the batch runs on, on the server
        print(f"\nbatchstring batches: stopped following; the batch runs on: batchstring batches status "
              f"{getattr(args, 'batch_id', '')}", file=sys.stderr)
        return 130


def _submit(api: BatchApi, args: argparse.Namespace) -> int:
    if not args.input.is_file():
        raise ApiFailure(f"no such file: {args.input}")
    metadata = dict(item.partition("=")[::2] for item in args.metadata)
    uploaded = api.upload(args.input)
    batch = api.call("POST", "/batches", {"input_file_id": uploaded["id"], "endpoint": args.endpoint,
                                          "completion_window": args.completion_window, "metadata": metadata or None})
    print(batch["id"])
    if args.wait:
        args.batch_id = batch["id"]
        return _wait(api, args)
    return 0


def _status(api: BatchApi, args: argparse.Namespace) -> int:
    batch = api.call("GET", f"/batches/{args.batch_id}")
    print(_line(batch))
    return 0


def _wait(api: BatchApi, args: argparse.Namespace) -> int:
    batch = api.call("GET", f"/batches/{args.batch_id}")
    bar = tqdm(total=batch["request_counts"]["total"] or None, unit="line", desc=batch["id"][:18],
               dynamic_ncols=True, file=sys.stderr)
    while batch["status"] not in ENDED:
        time.sleep(1.0)
        batch = api.call("GET", f"/batches/{args.batch_id}")
        counts = batch["request_counts"]
        bar.total = counts["total"] or bar.total
        bar.update(counts["completed"] + counts["failed"] - bar.n)
        bar.set_postfix_str(f"{batch['status']}, {counts['failed']} failed", refresh=True)
    bar.close()
    print(_line(batch))
    return 0 if batch["status"] == "completed" else 1


def _download(api: BatchApi, args: argparse.Namespace) -> int:
    batch = api.call("GET", f"/batches/{args.batch_id}")
    if batch["status"] not in ENDED:
        raise ApiFailure(f"{args.batch_id} is {batch['status']}; its files exist once it has ended "
                         "(batchstring batches wait)")
    errors = args.errors or args.output.with_name(args.output.name + ".errors.jsonl")
    for file_id, target in ((batch["output_file_id"], args.output), (batch["error_file_id"], errors)):
        if file_id:
            print(f"{target}: {api.download(file_id, target)} bytes", file=sys.stderr)
    return 0


def _cancel(api: BatchApi, args: argparse.Namespace) -> int:
    print(_line(api.call("POST", f"/batches/{args.batch_id}/cancel")))
    return 0


def _list(api: BatchApi, args: argparse.Namespace) -> int:
    for batch in api.call("GET", f"/batches?limit={args.limit}")["data"]:
        print(_line(batch))
    return 0


def _line(batch: dict) -> str:
    counts = batch["request_counts"]
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(batch["created_at"]))
    files = "".join(f" {name}={batch[name]}" for name in ("output_file_id", "error_file_id") if batch.get(name))
    errors = "".join(f"\n  {e['message']}" for e in (batch.get("errors") or {}).get("data", []))
    return (f"{batch['id']} {batch['status']} {counts['completed']}/{counts['total']} done, {counts['failed']} failed"
            f" (created {created}){files}{errors}")


ACTIONS = {"submit": _submit, "status": _status, "wait": _wait, "download": _download, "cancel": _cancel,
           "list": _list}
