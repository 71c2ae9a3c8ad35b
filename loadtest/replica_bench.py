"""`batchstring replica-bench`: one large batch on two replicas sharing PostgreSQL, against one.

A private PostgreSQL server (loadtest/postgres.py) and real servers (the CPU config): one
replica with the SQLite store (the single-node default), one replica with the PostgreSQL store,
and two replicas sharing it behind a round-robin balancer (loadtest/balancer.py). Each run
uploads the same `lines`-line batch through the official Batch API and times it from creation to
`completed`, in lines/s; the three runs take turns (`repeats` rounds, medians). On one machine the
replicas share its cores, so two replicas cannot be twice as fast here: what the ratio shows is
what sharing one batch costs (chunk leases, PostgreSQL round trips, two engines splitting two
cores); on two GPU hosts each engine has its own device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

SETUPS = ("one replica, SQLite", "one replica, PostgreSQL", "two replicas, PostgreSQL")


def batch_file(path: Path, lines: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"model": "llm", "prompt": f"def job_{i}(rows):\n    ", "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def _call(base: str, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
    request = urllib.request.Request(base + path, data=body, method=method,
                                     headers={"Content-Type": content_type, "Connection": "close"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def run_batch(base: str, source: Path, poll: float = 1.0) -> tuple[float, dict]:
    """Seconds from the batch's creation to its end, and the batch."""
    boundary = "batchstring-bench"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\n"
            'Content-Disposition: form-data; name="file"; filename="input.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n")
    form = head.encode() + source.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    uploaded = _call(base, "POST", "/v1/files", form, f"multipart/form-data; boundary={boundary}")
    began = time.monotonic()
    batch = _call(base, "POST", "/v1/batches", json.dumps({"input_file_id": uploaded["id"], "endpoint":
                                                          "/v1/completions", "completion_window": "24h"}).encode())
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(poll)
        batch = _call(base, "GET", f"/v1/batches/{batch['id']}")
    return time.monotonic() - began, batch


@contextlib.contextmanager
def setup(name: str, database_url: str, scratch: Path):
    """The servers of one setup, and the base URL its calls go to."""
    from batchstring.loadtest.balancer import RoundRobin
    from batchstring.server.local import LocalServer

    count = 2 if name.startswith("two") else 1
    options = () if "SQLite" in name else ("--batch-store", database_url)
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(LocalServer(config="cpu", data_dir=Path(tempfile.mkdtemp(dir=scratch)),
                                                   front_door_options=options)) for _ in range(count)]
        if count == 1:
            yield f"http://{servers[0].http_url}"
            return
        balancer = RoundRobin([(s.host, s.ports.http) for s in servers]).start()
        stack.callback(balancer.stop)
        yield f"http://{balancer.address}"


def run(args: argparse.Namespace) -> int:
    from batchstring.loadtest.postgres import PostgresServer

    console = Console(width=120)
    seconds: dict[str, list[float]] = {name: [] for name in SETUPS}
    with tempfile.TemporaryDirectory(prefix="batchstring-replica-bench-") as tmp, PostgresServer() as database:
        scratch = Path(tmp)
        source = scratch / "batch.jsonl"
        batch_file(source, args.lines, args.max_tokens)
        bar = tqdm(total=len(SETUPS) * args.repeats, desc=f"{args.lines}-line batches", unit="run")
        for _ in range(args.repeats):
            for name in SETUPS:
                with setup(name, database.url, scratch) as base:
                    elapsed, batch = run_batch(base, source)
                if batch["status"] != "completed" or batch["request_counts"]["completed"] != args.lines:
                    raise SystemExit(f"{name}: the batch ended {batch['status']} with {batch['request_counts']}")
                seconds[name].append(elapsed)
                bar.update()
        bar.close()
    table = Table(title=f"one {args.lines:,}-line batch ({args.max_tokens} tokens a line, greedy), created to "
                        f"completed; {os.cpu_count()} cores shared by every replica (median of {args.repeats})")
    for col in ("setup", "seconds", "lines/s", "vs one replica, SQLite"):
        table.add_column(col, justify="right")
    base = float(np.median(seconds[SETUPS[0]]))
    results = {}
    for name in SETUPS:
        median = float(np.median(seconds[name]))
        results[name] = {"seconds": seconds[name], "lines_per_s": args.lines / median}
        table.add_row(name, f"{median:.1f}", f"{args.lines / median:.0f}", f"{base / median:.2f}x")
    console.print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"lines": args.lines, "max_tokens": args.max_tokens, "runs": results}, indent=2))
        console.print(f"wrote {args.out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the three setups, taking turns")
    p.add_argument("--out", type=Path, default=Path("results/replica-bench.json"))
