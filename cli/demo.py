"""`batchstring demo`: the whole path in one command, on free local ports.

Starts tritonserver, lets several concurrent callers send their lists of prompts through one
shared client, prints what came back, then shows what Triton did with them (batches formed,
queue time) and what the engine did (step batch sizes), and stops the server.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from batchstring.client import BatchClient
from batchstring.server.local import LocalServer
from batchstring.server.stats import batch_stats, metrics

CALLERS = {
    "caller 1": ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self):", "for i in range("],
    "caller 2": ["def read_file(path):\n", "try:\n    import json\nexcept", "if __name__ ==", "return "],
    "caller 3": ["    def __repr__(self):\n", "@property\ndef name(self):", "with open(", "raise ValueError("],
    "caller 4": ["from collections import", "def parse_args(argv):\n", "while True:\n", "# Copyright"],
}
MAX_TOKENS = 32
# Sampled, but seeded (same output every run): a 4 M-parameter model decoded greedily tends to
# repeat itself, which says nothing about batching and makes a poor first impression.
SAMPLING = {"max_tokens": MAX_TOKENS, "temperature": 0.6, "top_k": 40, "seed": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu")


def run(args: argparse.Namespace) -> int:
    console = Console()
    with console.status(f"starting tritonserver ({args.config}) on free loopback ports..."):
        server = LocalServer(config=args.config).start()
    try:
        console.print(f"server ready: gRPC {server.grpc_url}, HTTP {server.http_url}")
        before, metrics_before = batch_stats(server.grpc_url), metrics(server.metrics_url)
        with BatchClient(server.grpc_url) as client, ThreadPoolExecutor(len(CALLERS)) as pool:
            futures = {name: pool.submit(client.batchstring, prompts, **SAMPLING) for name, prompts in CALLERS.items()}
            results = {name: f.result() for name, f in futures.items()}
        show_completions(console, results)
        show_server_work(console, batch_stats(server.grpc_url) - before, published_metrics(server, metrics_before),
                         metrics_before)
    finally:
        with console.status("stopping the server..."):
            server.close()
    return 0


def published_metrics(server: LocalServer, before: dict[str, float]) -> dict[str, float]:
    """The engine publishes its counters twice a second: wait for this run's to appear."""
    deadline = time.monotonic() + 3
    while True:
        now = metrics(server.metrics_url)
        name = "batchstring_generated_tokens_total"
        if now.get(name, 0) > before.get(name, 0) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def show_completions(console: Console, results: dict[str, list[str]]) -> None:
    table = Table(title=f"{sum(map(len, results.values()))} prompts from {len(results)} concurrent callers "
                        f"(max {MAX_TOKENS} tokens, temperature 0.6, top_k 40, seed 0)", show_lines=True)
    table.add_column("caller", style="dim")
    table.add_column("prompt", style="cyan")
    table.add_column("completion")
    for name, completions in results.items():
        for prompt, completion in zip(CALLERS[name], completions):
            table.add_row(name, prompt, completion)
    console.print(table)


def show_server_work(console: Console, stats, after: dict[str, float], before: dict[str, float]) -> None:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("batchstring_steps_total")
    table = Table(title="what the server did")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("requests (one per string)", f"{stats.requests}")
    table.add_row("Triton executions (batches formed)", f"{stats.executions}")
    table.add_row("average Triton batch size", f"{stats.average_batch:.2f}")
    table.add_row("average queue time in Triton", f"{stats.average_queue_ms:.2f} ms")
    table.add_row("engine steps (prefill + decode)", f"{steps:.0f}")
    if steps:
        table.add_row("average sequences per engine step", f"{delta('batchstring_step_sequences_total') / steps:.2f}")
    table.add_row("tokens generated", f"{delta('batchstring_generated_tokens_total'):.0f}")
    console.print(table)
