"""`batchstring loadtest` (`make loadtest`): Locust headless against a local server, bounded.

Uses the server already listening on --http-url if its model is ready; otherwise starts one on
free loopback ports and stops it afterwards. Locust runs in its own process (it monkey-patches
the standard library on import), writing CSV files and an HTML report into the results folder.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from batchstring.server.local import LocalServer

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class Summary:
    requests: int
    failures: int
    median_ms: float
    p99_ms: float
    requests_per_s: float


def model_ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http_url}/v2/models/llm/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_locust(http_url: str, out_dir: Path, duration: int, users: int, extra: list[str]) -> Summary:
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", f"http://{http_url}",
               "-u", str(users), "-r", str(max(1, users // 2)), "-t", f"{duration}s", "--stop-timeout", "30",
               "--csv", str(out_dir / "locust"), "--html", str(out_dir / "report.html"), "--only-summary",
               "--exit-code-on-error", "0", *extra]
    subprocess.run(command, check=True)
    return read_summary(out_dir / "locust_stats.csv")


def read_summary(stats_csv: Path) -> Summary:
    with stats_csv.open() as f:
        rows = [r for r in csv.DictReader(f) if r["Name"].startswith("batchstring[")]
    requests = sum(int(r["Request Count"]) for r in rows)
    failures = sum(int(r["Failure Count"]) for r in rows)
    weight = max(requests, 1)
    return Summary(requests, failures,
                   sum(float(r["Median Response Time"]) * int(r["Request Count"]) for r in rows) / weight,
                   max((float(r["99%"]) for r in rows if r["99%"] not in ("", "N/A")), default=0.0),
                   sum(float(r["Requests/s"]) for r in rows))


def run(args: argparse.Namespace) -> int:
    out_dir = args.out or Path("results") / time.strftime("locust-%Y%m%d-%H%M%S")
    server = None
    http_url = args.http_url
    if not model_ready(http_url):
        print(f"no ready server at {http_url}; starting one on free loopback ports", flush=True)
        server = LocalServer(config="cpu").start()
        http_url = server.http_url
    try:
        extra = ["--list-size", args.list_size, "--max-tokens", args.max_tokens, "--prompts", args.prompts]
        extra += ["--stream"] if args.stream else []
        summary = run_locust(http_url, out_dir, args.duration, args.users, extra)
    finally:
        if server:
            server.close()
    print(f"batchstring calls: {summary.requests}, failures: {summary.failures}, "
          f"{summary.requests_per_s:.2f} calls/s, median {summary.median_ms:.0f} ms, p99 {summary.p99_ms:.0f} ms")
    print(f"CSV and HTML report in {out_dir}/")
    return 1 if summary.failures else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http-url", default="127.0.0.1:8000", help="server to test; started if not ready")
    p.add_argument("--duration", type=int, default=60, help="seconds of load")
    p.add_argument("--users", type=int, default=32, help="concurrent virtual callers")
    p.add_argument("--list-size", default="1-8")
    p.add_argument("--max-tokens", default="16-64")
    p.add_argument("--prompts", default="stdlib")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--out", type=Path, help="results folder (default: results/locust-<time>)")
