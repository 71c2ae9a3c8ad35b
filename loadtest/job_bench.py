"""`batchstring job-bench`: does a job's memory stay flat as its file grows?

Runs `batchstring run --input --output` on JSONL files of increasing length (same prompts, short
answers, so the run is about the job, not the model) against one server, sampling the job
process's resident memory, and prints peak memory per file size side by side, with the memory
at 10% of the job and at its end (flat: they match).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from batchstring.server.local import LocalServer

PROMPTS = [f"def task_{i}(items):\n    " for i in range(64)]


def write_file(path: Path, lines: int, max_tokens: int) -> None:
    with path.open("w") as f:
        for i in range(lines):
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
            f.write(json.dumps({"custom_id": f"item-{i:09d}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")


def measure(url: str, source: Path, output: Path, lines: int) -> dict:
    """Runs the job; samples its RSS every 0.2 s. Returns peak, at-10% and final RSS (MiB), and speed."""
    command = [str(Path(sys.executable).parent / "batchstring"), "run", "--url", url, "--input", str(source),
               "--output", str(output)]
    began = time.monotonic()
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process = psutil.Process(job.pid)
    samples: list[tuple[int, float]] = []  # (lines written, RSS MiB)
    while job.poll() is None:
        try:
            rss = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            break
        written = output.stat().st_size if output.exists() else 0
        samples.append((written, rss))
        time.sleep(0.2)
    seconds = time.monotonic() - began
    if job.returncode != 0:
        raise SystemExit(f"the job over {lines} lines failed (exit {job.returncode})")
    size = output.stat().st_size
    early = next((rss for written, rss in samples if written >= size / 10), samples[0][1])
    return {"lines": lines, "seconds": seconds, "items_per_s": lines / seconds, "peak_mib": max(r for _, r in samples),
            "at_10pct_mib": early, "end_mib": samples[-1][1]}


def run(args: argparse.Namespace) -> int:
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchstring-job-bench-") as tmp, LocalServer(config="cpu") as server:
        for lines in args.lines:
            source, output = Path(tmp) / f"in-{lines}.jsonl", Path(tmp) / f"out-{lines}.jsonl"
            write_file(source, lines, args.max_tokens)
            console.print(f"job over {lines} lines ({source.stat().st_size / 2**20:.0f} MiB)...")
            rows.append(measure(server.grpc_url, source, output, lines))
    table = Table(title=f"`batchstring run --input` memory (max_tokens {args.max_tokens})")
    for col in ("lines", "time", "items/s", "RSS at 10%", "RSS at end", "peak RSS"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['lines']:,}", f"{r['seconds']:.0f} s", f"{r['items_per_s']:.0f}",
                      f"{r['at_10pct_mib']:.0f} MiB", f"{r['end_mib']:.0f} MiB", f"{r['peak_mib']:.0f} MiB")
    console.print(table)
    ratio = rows[-1]["peak_mib"] / rows[0]["peak_mib"]
    console.print(f"peak RSS, {rows[-1]['lines']:,} lines vs {rows[0]['lines']:,}: {ratio:.2f}x "
                  f"for {rows[-1]['lines'] / rows[0]['lines']:.0f}x the lines")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lines", type=int, nargs="+", default=[20_000, 200_000], help="file sizes, in lines")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
