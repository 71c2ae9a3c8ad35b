"""`batchstring batch-bench`: does a running batch leave interactive callers alone, and use the rest?

One server, side by side in one run:
1. the batch alone (`lines` lines through /v1/files and /v1/batches), and the same file through
   `batchstring run --input` (the client-side job) for reference: lines/s and tokens/s;
2. interactive alone: `callers` closed-loop callers (each sends its next request when the last
   one answers) for `seconds`: latency p50/p99 and completion tokens/s;
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from batchstring.client import AsyncBatchClient, Completion
from batchstring.client.batches import ENDED, BatchApi
from batchstring.client.jobs import run_job
from batchstring.frontdoor.batch_api.share import DEFAULT_SHARE
from batchstring.server.local import LocalServer

INTERACTIVE = [f"# request {i}\ndef summarize(records):\n    " for i in range(16)]


def write_file(path: Path, lines: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": "llm", "prompt": f"def batch_task_{i}(rows):\n    ", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


@dataclass
class Calls:
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: Calls) -> None:
        self.latencies += other.latencies
        self.tokens += other.tokens
        self.seconds += other.seconds

    def figures(self) -> dict:
        return {"p50_s": float(np.percentile(self.latencies, 50)), "p99_s": float(np.percentile(self.latencies, 99)),
                "tokens_per_s": self.tokens / self.seconds, "requests": len(self.latencies)}


async def interactive(url: str, callers: int, seconds: float, max_tokens: int) -> Calls:
    """Closed-loop callers for `seconds`: each request's latency, and the tokens they got."""
    calls = Calls()
    stop = time.monotonic() + seconds
    async with AsyncBatchClient(url) as client:
        async def caller(index: int) -> None:
            while time.monotonic() < stop:
                began = time.monotonic()
                result = (await client.complete([INTERACTIVE[index % len(INTERACTIVE)]], max_tokens=max_tokens,
                                                ignore_eos=True))[0]
                calls.latencies.append(time.monotonic() - began)
                calls.tokens += result.completion_tokens if isinstance(result, Completion) else 0

        began = time.monotonic()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        calls.seconds = time.monotonic() - began
    return calls


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


def shared(api: BatchApi, url: str, source: Path, args: argparse.Namespace) -> tuple[Calls, int]:
    """The callers while a batch runs, and the lines the batch answered meanwhile; the batch is
    then cancelled and waited for, so that the next window starts with an idle engine."""
    batch_id = submit(api, source)
    _, start = wait_for(api, batch_id, lambda status, count: count > 0 or status in ENDED)
    calls = asyncio.run(interactive(url, args.callers, args.seconds, args.max_tokens))
    status, end = answered(api, batch_id)
    if status in ENDED:
        Console().print("[yellow]the batch ended before the callers did: use more --lines for a fair share[/]")
    else:
        api.call("POST", f"/batches/{batch_id}/cancel")
        wait_for(api, batch_id)
    return calls, end - start


def run(args: argparse.Namespace) -> int:
    """Each measurement `rounds` times, the two sides of each comparison taking turns, so that
    both see the same machine (a shared one drifts)."""
    console = Console()
    batch_rates, job_rates, shared_lines = [], [], 0
    alone, with_batch = Calls(), Calls()
    with tempfile.TemporaryDirectory(prefix="batchstring-batch-bench-") as tmp, \
            LocalServer(config=args.config, data_dir=Path(tmp) / "data",
                        front_door_options=("--batch-interactive-share", str(args.share))) as server:
        source = Path(tmp) / "batch.jsonl"
        write_file(source, args.lines, args.max_tokens)
        api = BatchApi(f"http://{server.http_url}")
        for round_ in range(1, args.rounds + 1):
            console.print(f"round {round_}/{args.rounds}: the batch alone, then `batchstring run --input` "
                          f"({args.lines} lines each) ...")
            batch_rates.append(batch_alone(api, source, args.lines))
            job_rates.append(job_alone(server.grpc_url, source, Path(tmp) / f"job-{round_}.jsonl", args.lines,
                                       args.job_in_flight))
        for round_ in range(1, args.rounds + 1):
            console.print(f"round {round_}/{args.rounds}: {args.callers} interactive callers alone, then beside a "
                          f"batch ({args.seconds:g} s each) ...")
            alone.add(asyncio.run(interactive(server.grpc_url, args.callers, args.seconds, args.max_tokens)))
            calls, lines = shared(api, server.grpc_url, source, args)
            with_batch.add(calls)
            shared_lines += lines
    figures = {"alone": alone.figures(), "with_batch": with_batch.figures(),
               "batch_lines_per_s": float(np.median(batch_rates)), "job_lines_per_s": float(np.median(job_rates)),
               "batch_shared_lines_per_s": shared_lines / with_batch.seconds}
    console.print(table(figures, args))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**figures, "args": {k: str(v) for k, v in vars(args).items() if k != "func"}},
                                       indent=2))
    return 0


def table(f: dict, args: argparse.Namespace) -> Table:
    alone, shared_ = f["alone"], f["with_batch"]
    batch, together, job = f["batch_lines_per_s"], f["batch_shared_lines_per_s"], f["job_lines_per_s"]
    out = Table(title=f"Batch API beside interactive traffic ({args.config}, {args.lines} lines, max_tokens "
                      f"{args.max_tokens}, {args.callers} interactive callers, share {args.share:g}, "
                      f"{args.rounds} rounds)")
    for col in ("", "alone", "with a batch running", "ratio"):
        out.add_column(col, justify="right")
    for name, key in (("interactive p50", "p50_s"), ("interactive p99", "p99_s")):
        out.add_row(name, f"{alone[key]:.3f} s", f"{shared_[key]:.3f} s", f"{shared_[key] / alone[key]:.2f}x")
    out.add_row("interactive tokens/s", f"{alone['tokens_per_s']:.0f}", f"{shared_['tokens_per_s']:.0f}",
                f"{shared_['tokens_per_s'] / alone['tokens_per_s']:.2f}x")
    out.add_row("batch lines/s", f"{batch:.1f}", f"{together:.1f}", f"{together / batch:.2f}x")
    out.add_row("batch tokens/s", f"{batch * args.max_tokens:.0f}", f"{together * args.max_tokens:.0f}",
                f"{together / batch:.2f}x")
    out.add_row("`run --input` lines/s", f"{job:.1f}", "", f"batch / run: {batch / job:.2f}x")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--lines", type=int, default=1000, help="batch size in lines (a large job: 20000)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer, batch and interactive alike")
    p.add_argument("--callers", type=int, default=4, help="interactive closed-loop callers")
    p.add_argument("--seconds", type=float, default=10.0, help="each window of interactive calls, alone and shared")
    p.add_argument("--rounds", type=int, default=3, help="times each comparison is repeated, taking turns")
    p.add_argument("--job-in-flight", type=int, default=256, help="`batchstring run --input`'s --max-in-flight")
    p.add_argument("--share", type=float, default=DEFAULT_SHARE,
                   help="the front door's --batch-interactive-share (default: %(default)s)")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
