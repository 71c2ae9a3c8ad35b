"""`batchstring batch-bench`: does a running batch leave interactive callers alone, and use the rest?

One server, side by side in one run:
1. interactive alone: `callers` closed-loop callers (each sends its next request when the last
   one answers) for `seconds`: latency p50/p99 and completion tokens/s;
2. the batch alone (`lines` lines through /v1/files and /v1/batches), and the same file through
   `batchstring run --input` (the client-side job) for reference: lines/s and tokens/s;
3. both at once: the callers again while a batch of the same file runs; their latency and
   tokens/s, and the batch's lines/s while they call.
Prints the ratios (with batch / alone) that the Batch API promises to keep small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from batchstring.client import AsyncBatchClient, Completion
from batchstring.client.batches import ENDED, BatchApi
from batchstring.client.jobs import run_job
from batchstring.server.local import LocalServer

INTERACTIVE = [f"# request {i}\ndef summarize(records):\n    " for i in range(16)]


def write_file(path: Path, lines: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": "llm", "prompt": f"def batch_task_{i}(rows):\n    ", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


async def interactive(url: str, callers: int, seconds: float, max_tokens: int) -> dict:
    """Closed-loop callers for `seconds`: per-request latency and completion tokens/s."""
    latencies, tokens = [], 0
    stop = time.monotonic() + seconds
    async with AsyncBatchClient(url) as client:
        async def caller(index: int) -> None:
            nonlocal tokens
            while time.monotonic() < stop:
                began = time.monotonic()
                result = (await client.complete([INTERACTIVE[index % len(INTERACTIVE)]], max_tokens=max_tokens,
                                                ignore_eos=True))[0]
                latencies.append(time.monotonic() - began)
                tokens += result.completion_tokens if isinstance(result, Completion) else 0

        began = time.monotonic()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.monotonic() - began
    return {"p50_s": float(np.percentile(latencies, 50)), "p99_s": float(np.percentile(latencies, 99)),
            "tokens_per_s": tokens / elapsed, "requests": len(latencies)}


def submit(api: BatchApi, source: Path) -> str:
    uploaded = api.upload(source)
    return api.call("POST", "/batches", {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
                                         "completion_window": "24h"})["id"]


def answered(api: BatchApi, batch_id: str) -> tuple[str, int]:
    batch = api.call("GET", f"/batches/{batch_id}")
    return batch["status"], batch["request_counts"]["completed"] + batch["request_counts"]["failed"]


def wait_for(api: BatchApi, batch_id: str, done=lambda status, count: status in ENDED) -> tuple[float, int]:
    while True:
        status, count = answered(api, batch_id)
        if done(status, count):
            return time.monotonic(), count
        time.sleep(0.2)


def batch_alone(api: BatchApi, source: Path, lines: int) -> float:
    """Lines/s of a batch from creation to its end (validation and finalizing included)."""
    began = time.monotonic()
    ended, _ = wait_for(api, submit(api, source))
    return lines / (ended - began)


def job_alone(url: str, source: Path, output: Path, lines: int, in_flight: int) -> float:
    async def job():
        async with AsyncBatchClient(url, max_in_flight=in_flight) as client:
            return await run_job(client, source, output, {}, jsonl=True, skip_malformed=False, retry_failed=False,
                                 max_in_flight=in_flight)

    return lines / asyncio.run(job()).seconds


def shared(api: BatchApi, url: str, source: Path, args: argparse.Namespace) -> tuple[dict, float]:
    """The callers while a batch runs; the batch's lines/s over the same window."""
    batch_id = submit(api, source)
    _, start = wait_for(api, batch_id, lambda status, count: count > 0 or status in ENDED)
    began = time.monotonic()
    calls = asyncio.run(interactive(url, args.callers, args.seconds, args.max_tokens))
    window = time.monotonic() - began
    status, end = answered(api, batch_id)
    if status in ENDED:
        Console().print("[yellow]the batch ended before the callers did: use more --lines for a fair share[/]")
    else:
        api.call("POST", f"/batches/{batch_id}/cancel")
    return calls, (end - start) / window


def run(args: argparse.Namespace) -> int:
    console = Console()
    with tempfile.TemporaryDirectory(prefix="batchstring-batch-bench-") as tmp, \
            LocalServer(config=args.config, data_dir=Path(tmp) / "data") as server:
        source = Path(tmp) / "batch.jsonl"
        write_file(source, args.lines, args.max_tokens)
        api = BatchApi(f"http://{server.http_url}")
        console.print(f"interactive alone: {args.callers} callers, {args.seconds:g} s ...")
        alone = asyncio.run(interactive(server.grpc_url, args.callers, args.seconds, args.max_tokens))
        console.print(f"batch alone: {args.lines} lines ...")
        batch_rate = batch_alone(api, source, args.lines)
        console.print("the same file through `batchstring run --input` ...")
        job_rate = job_alone(server.grpc_url, source, Path(tmp) / "job-out.jsonl", args.lines, args.job_in_flight)
        console.print("interactive callers while a batch runs ...")
        with_batch, shared_rate = shared(api, server.grpc_url, source, args)
    table = Table(title=f"Batch API beside interactive traffic ({args.config}, {args.lines} lines, "
                        f"max_tokens {args.max_tokens}, {args.callers} interactive callers)")
    for col in ("", "alone", "with a batch running", "ratio"):
        table.add_column(col, justify="right")
    table.add_row("interactive p50", f"{alone['p50_s']:.3f} s", f"{with_batch['p50_s']:.3f} s",
                  f"{with_batch['p50_s'] / alone['p50_s']:.2f}x")
    table.add_row("interactive p99", f"{alone['p99_s']:.3f} s", f"{with_batch['p99_s']:.3f} s",
                  f"{with_batch['p99_s'] / alone['p99_s']:.2f}x")
    table.add_row("interactive tokens/s", f"{alone['tokens_per_s']:.0f}", f"{with_batch['tokens_per_s']:.0f}",
                  f"{with_batch['tokens_per_s'] / alone['tokens_per_s']:.2f}x")
    table.add_row("batch lines/s", f"{batch_rate:.1f}", f"{shared_rate:.1f}", f"{shared_rate / batch_rate:.2f}x")
    table.add_row("batch tokens/s", f"{batch_rate * args.max_tokens:.0f}", f"{shared_rate * args.max_tokens:.0f}",
                  f"{shared_rate / batch_rate:.2f}x")
    table.add_row("`run --input` lines/s", f"{job_rate:.1f}", "", f"batch / run: {batch_rate / job_rate:.2f}x")
    console.print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"alone": alone, "with_batch": with_batch, "batch_lines_per_s": batch_rate,
                                        "batch_shared_lines_per_s": shared_rate, "job_lines_per_s": job_rate,
                                        "args": {k: str(v) for k, v in vars(args).items() if k != "func"}},
                                       indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--lines", type=int, default=1000, help="batch size in lines (the issue's figure: 20000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer, batch and interactive alike")
    p.add_argument("--callers", type=int, default=4, help="interactive closed-loop callers")
    p.add_argument("--seconds", type=float, default=15.0, help="how long the callers call, alone and with a batch")
    p.add_argument("--job-in-flight", type=int, default=256, help="`batchstring run --input`'s --max-in-flight")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
