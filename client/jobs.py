"""`batchstring run --input FILE --output FILE`: a file of prompts completed as a resumable job.

Input: JSONL in the OpenAI batch format (`{"custom_id", "method": "POST", "url": "/v1/completions",
"body": {"prompt", "max_tokens", ...}}`), or plain text, one prompt per line, whose line number is
its id. Output: JSONL in the OpenAI batch output format, one line per input, written and flushed
as each item completes (so in completion order, not input order).

Bounded: the input is read lazily, at most `max_in_flight` items are outstanding, and what the
job remembers about ids is 8 bytes per line (a hash), so a file of millions of lines runs in
memory that does not depend on the prompts. Resumable: the same command after an interruption
(Ctrl-C, SIGKILL, a server restart) skips every id already in the output, after cutting off a
last line left unfinished by a kill; each id ends up in the output exactly once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from batchstring.client import openai_format as fmt
from batchstring.client.aio import AsyncBatchClient
from batchstring.client.errors import BatchstringError
from batchstring.client.protocol import Completion

URL = "/v1/completions"
SHOWN_MALFORMED = 20


@dataclass(frozen=True)
class Item:
    line: int
    custom_id: str
    prompt: str
    options: dict


class Malformed(ValueError):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line


def id_hash(custom_id: str) -> int:
    """8 bytes per id: what the job keeps to skip done ids and find duplicates (collisions are
    ~1e-8 likely at a million ids)."""
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little") >> 1


def is_jsonl(path: Path) -> bool:
    """JSONL if the name says so, or if the first line is a JSON object with a custom_id."""
    if path.suffix in (".jsonl", ".json"):
        return True
    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.readline()
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and "custom_id" in obj


def read_items(path: Path, defaults: dict, jsonl: bool) -> Iterator[Item | Malformed]:
    """The file's items, lazily, each one or the reason its line is malformed."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield Malformed(number, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not jsonl:
                yield Item(number, str(number), text, defaults)
            elif text.strip():
                try:
                    yield _parse_line(number, text, defaults)
                except Malformed as exc:
                    yield exc


def envelope(number: int, raw: str | bytes, url: str, *, implicit: bool = True) -> tuple[str, dict]:
    """A line of OpenAI's batch input format: its custom_id and request body, or Malformed naming the
    line. `implicit`: a line without method and url means POST `url` (a convenience of file jobs;
    the Batch API, as OpenAI's, wants them stated)."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise Malformed(number, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise Malformed(number, "not a JSON object")
    custom_id, body = obj.get("custom_id"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        raise Malformed(number, "custom_id must be a non-empty string")
    method, target = obj.get("method", "POST" if implicit else None), obj.get("url", url if implicit else None)
    if method != "POST" or target != url:
        raise Malformed(number, f"method and url must be POST {url} (got {obj.get('method')} {obj.get('url')})")
    if not isinstance(body, dict):
        raise Malformed(number, "body must be a JSON object (the request body)")
    return custom_id, body


def _parse_line(number: int, text: str, defaults: dict) -> Item:
    custom_id, body = envelope(number, text, URL)
    if not isinstance(body.get("prompt"), str):
        raise Malformed(number, "body must be an object whose prompt is a string (one prompt per line)")
    if body.get("echo"):
        raise Malformed(number, "body.echo is not supported by jobs (allowed: false)")
    try:
        return Item(number, custom_id, body["prompt"], {**defaults, **fmt.sampling_options(body)})
    except fmt.BodyError as exc:
        raise Malformed(number, f"body.{exc}") from None


# ----- the output file -----------------------------------------------------------------------


def done_ids(output: Path, retry_failed: bool) -> np.ndarray:
    """Sorted hashes of the ids already in `output`, after repairing it: a last line without its
    newline (a kill in the middle of a write) is cut off; with `retry_failed`, failed items'
    lines are dropped so that they run again."""
    if not output.exists():
        return np.empty(0, dtype=np.int64)
    _cut_partial_line(output)
    hashes = []
    kept = output.with_name(output.name + ".resume") if retry_failed else None
    with output.open("rb") as f, (kept.open("wb") if kept else open(os.devnull, "wb")) as keep:
        for number, raw in enumerate(f, start=1):
            try:
                line = json.loads(raw)
                custom_id, ok = line["custom_id"], line["response"]["status_code"] == 200
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"batchstring run: {output} line {number} is not an output line of this job; "
                                 "give another --output, or repair the file") from None
            if retry_failed and not ok:
                continue
            keep.write(raw)
            hashes.append(id_hash(custom_id))
    if kept:
        os.replace(kept, output)
    return np.sort(np.array(hashes, dtype=np.int64))


def _cut_partial_line(path: Path) -> None:
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        end = size
        while end > 0:  # back to the last newline, in blocks
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


def output_line(item: Item, result: Completion | BaseException, model: str, chat: bool = False) -> dict:
    """One line of the OpenAI batch output format; `chat`: the answer in the chat completion shape."""
    request_id = f"batch_req_{uuid.uuid4().hex}"
    if isinstance(result, Completion):
        response = {"status_code": 200, "request_id": request_id, "body": fmt.completion(model, [result], chat)}
    else:
        status, code, message = fmt.failure(result)
        response = {"status_code": status, "request_id": request_id, "body": fmt.error_body(status, message, code=code)}
    return {"id": request_id, "custom_id": item.custom_id, "response": response, "error": None}


# ----- the job ---------------------------------------------------------------------------------


@dataclass
class Summary:
    total: int = 0
    skipped: int = 0  # already in the output
    ok: int = 0
    failed: Counter = field(default_factory=Counter)  # by status code and code
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    malformed: int = 0

    def record(self, result: Completion | BaseException) -> None:
        if isinstance(result, Completion):
            self.ok += 1
            self.prompt_tokens += result.prompt_tokens
            self.completion_tokens += result.completion_tokens
        else:
            status, code, _ = fmt.failure(result)
            self.failed[f"{status} {code}"] += 1

    def lines(self) -> list[str]:
        done = self.ok + sum(self.failed.values())
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        out = [f"items: {self.total} ({self.skipped} already done, {done} run now, {self.malformed} malformed "
               "lines skipped)",
               f"ok: {self.ok}   failed: {sum(self.failed.values())}"
               + "".join(f"\n  {n} x {reason}" for reason, n in self.failed.most_common()),
               f"tokens: {self.prompt_tokens} prompt, {self.completion_tokens} completion "
               f"({rate:.0f} completion tokens/s)   time: {self.seconds:.1f} s"]
        return out


def check_file(path: Path, defaults: dict, jsonl: bool) -> tuple[int, list[Malformed]]:
    """One pass before the job: how many items, and which lines are malformed (including each
    repeat of an earlier line's custom_id). Memory: 16 bytes per line."""
    hashes = np.empty(1 << 16, dtype=np.int64)
    lines = np.empty(1 << 16, dtype=np.int64)
    count, malformed = 0, []
    for entry in read_items(path, defaults, jsonl):
        if isinstance(entry, Malformed):
            malformed.append(entry)
            continue
        if count == len(hashes):
            hashes, lines = np.resize(hashes, 2 * count), np.resize(lines, 2 * count)
        hashes[count], lines[count] = id_hash(entry.custom_id), entry.line
        count += 1
    order = np.argsort(hashes[:count], kind="stable")
    sorted_hashes = hashes[:count][order]
    repeats = np.nonzero(sorted_hashes[1:] == sorted_hashes[:-1])[0]
    for i in repeats:
        malformed.append(Malformed(int(lines[order[i + 1]]), f"custom_id repeats line {int(lines[order[i]])}'s"))
    return count - len(repeats), sorted(malformed, key=lambda m: m.line)


async def run_job(client: AsyncBatchClient, source: Path, output: Path, defaults: dict, *, jsonl: bool,
                  skip_malformed: bool, retry_failed: bool, max_in_flight: int, model: str = "llm",
                  timeout: float | None = None) -> Summary:
    total, malformed = check_file(source, defaults, jsonl)
    if malformed and not skip_malformed:
        shown = "\n".join(f"  {m}" for m in malformed[:SHOWN_MALFORMED])
        more = f"\n  ... and {len(malformed) - SHOWN_MALFORMED} more" if len(malformed) > SHOWN_MALFORMED else ""
        raise SystemExit(f"batchstring run: {source} has {len(malformed)} malformed line(s); nothing was run:\n"
                         f"{shown}{more}\nfix them, or pass --skip-malformed to run the rest")
    done = done_ids(output, retry_failed)
    bad_lines = {m.line for m in malformed}
    summary = Summary(total=total, malformed=len(malformed))
    started = time.monotonic()
    slots = asyncio.Semaphore(max_in_flight)
    pending: set[asyncio.Task] = set()
    bar = tqdm(total=total, unit="item", desc="batchstring run", dynamic_ncols=True, file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 10.0)
    with output.open("a", encoding="utf-8") as out:
        async def one(item: Item) -> None:
            try:
                results = await client.complete([item.prompt], **item.options, timeout=timeout,
                                                return_exceptions=True)
                result = results[0]
            except BatchstringError as exc:  # refused before sending (bad text or options)
                result = exc
            finally:
                slots.release()
            out.write(json.dumps(output_line(item, result, model), ensure_ascii=False) + "\n")
            out.flush()  # a kill loses at most the line being written, which a rerun repairs
            summary.record(result)
            bar.update(1)
            elapsed = time.monotonic() - started
            bar.set_postfix_str(f"{summary.completion_tokens / elapsed:.0f} tok/s", refresh=False)

        try:
            for entry in read_items(source, defaults, jsonl):
                if isinstance(entry, Malformed) or entry.line in bad_lines:
                    continue
                if _contains(done, id_hash(entry.custom_id)):
                    summary.skipped += 1
                    bar.update(1)
                    continue
                await slots.acquire()
                task = asyncio.create_task(one(entry))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            bar.close()
            out.flush()
            os.fsync(out.fileno())
    summary.seconds = time.monotonic() - started
    return summary


def _contains(sorted_hashes: np.ndarray, value: int) -> bool:
    i = np.searchsorted(sorted_hashes, value)
    return bool(i < len(sorted_hashes) and sorted_hashes[i] == value)
