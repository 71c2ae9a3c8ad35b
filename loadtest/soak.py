"""`batchstring soak`: minutes of saturating load with faults injected, and an audit of every item.

A supervised local server (as `batchstring serve` runs it) takes batchstring calls from many
threads sharing one client, while its model process is killed every `--kill-every` seconds, 5% of
calls carry the engine's fault marker (an injected out-of-memory step), and every `--break-every`
seconds the engine is broken on purpose (its loop raises, a step stalls, or the device fails
every step, in turn) and a 4 MB body is sent to each HTTP route. Every item is
checked against its reference output (greedy, computed on the healthy server first): it must be
exactly right, or an explicit error (the poisoned items, or a deadline). Anything else is counted
as lost, duplicated, misordered or wrong, and the command fails.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from batchstring.client import BatchClient, BatchstringError, DeadlineExceeded
from batchstring.server.local import LocalServer
from batchstring.server.supervisor import Supervisor

MARKER = "<<soak-poison>>"
POOL = [f"def task_{i}(self, value):\n    " for i in range(64)]
MAX_TOKENS = 16


def server_memory(server: LocalServer) -> int:
    """Resident bytes of tritonserver and its model process."""
    if server.process is None:
        return 0
    try:
        root = psutil.Process(server.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


def audit(items: list[str], outputs: list, ref: dict[str, str], tally: Counter) -> None:
    tally["calls"] += 1
    tally["items"] += len(items)
    if len(outputs) < len(items):
        tally["lost"] += len(items) - len(outputs)
    if len(outputs) > len(items):
        tally["duplicated"] += len(outputs) - len(items)
    for position, (item, out) in enumerate(zip(items, outputs)):
        if MARKER in item:
            tally["isolated failures" if isinstance(out, BatchstringError) else "wrong"] += 1
        elif isinstance(out, DeadlineExceeded):
            tally["deadline"] += 1
        elif isinstance(out, BatchstringError) and out.retryable:
            tally["retryable errors"] += 1  # sent again until the call's deadline, and still not answered
        elif isinstance(out, BaseException):
            tally["unexpected errors"] += 1
        elif out == ref[item]:
            tally["ok"] += 1
        elif out in (ref[other] for i, other in enumerate(items) if i != position):
            tally["misordered"] += 1
        else:
            tally["wrong"] += 1


def isolation(args: argparse.Namespace) -> int:
    """The other callers' output tokens/s in the 20 s before and the 20 s after one request fails
    alone (an injected out-of-memory error inside a 16-item call)."""
    console = Console()
    window = args.window
    with LocalServer(config="cpu", params={"fault_marker": MARKER}) as server, BatchClient(server.grpc_url) as client:
        client.batchstring(POOL[:16], max_tokens=MAX_TOKENS)  # warm
        done: list[tuple[float, int]] = []
        start = time.monotonic()
        failure_at = start + window

        def caller(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < failure_at + window:
                items = rng.sample(POOL, 4)
                client.batchstring(items, max_tokens=32, ignore_eos=True)
                done.append((time.monotonic(), 32 * len(items)))

        with ThreadPoolExecutor(args.callers) as pool:
            calls = [pool.submit(caller, k) for k in range(args.callers)]
            time.sleep(max(0.0, failure_at - time.monotonic()))
            poisoned = [*POOL[:15], POOL[15] + MARKER]
            outcome = client.batchstring(poisoned, max_tokens=32, ignore_eos=True, return_exceptions=True)
            for call in calls:
                call.result()
    before = sum(n for t, n in done if start + 1 <= t < failure_at) / (window - 1)
    after = sum(n for t, n in done if failure_at <= t < failure_at + window) / window
    failed = [i for i, o in enumerate(outcome) if isinstance(o, BaseException)]
    table = Table(title=f"an isolated failure: {args.callers} callers, 4 strings x 32 tokens per call")
    for col in ("window", "other callers' output tok/s"):
        table.add_column(col, justify="right")
    table.add_row(f"{window - 1:.0f} s before", f"{before:.0f}")
    table.add_row(f"{window:.0f} s after", f"{after:.0f}")
    table.add_row("after / before", f"{after / before:.2f}x")
    console.print(table)
    console.print(f"the 16-item call: items {failed} failed ({outcome[failed[0]] if failed else 'none'}); "
                  f"the other 15 completed")
    return 0 if failed == [15] and after >= 0.9 * before else 1


def run(args: argparse.Namespace) -> int:
    if args.isolation:
        return isolation(args)
    console = Console()
    server = LocalServer(config="cpu", params={"fault_marker": MARKER, "stall_seconds": "5"}).start()
    stop = threading.Event()
    supervisor = Supervisor(server, interval=0.5, report=lambda line: console.print(f"[dim]{line}[/]"))
    watcher = threading.Thread(target=supervisor.run, args=(stop,), daemon=True)
    watcher.start()
    tally: Counter = Counter()
    latencies: list[float] = []
    try:
        with BatchClient(server.grpc_url) as client:
            ref = dict(zip(POOL, client.batchstring(POOL, max_tokens=MAX_TOKENS)))
            memory_start = server_memory(server)
            deadline = time.monotonic() + args.minutes * 60
            kills = threading.Thread(target=_kill_stubs, args=(server, args.kill_every, deadline, stop, tally),
                                     daemon=True)
            kills.start()
            breaks = threading.Thread(target=_break_engine, args=(server, args.break_every, deadline, stop, tally),
                                      daemon=True)
            breaks.start()
            memory: list[int] = []
            sampler = threading.Thread(target=_sample_memory, args=(server, deadline, stop, memory), daemon=True)
            sampler.start()

            def caller(seed: int) -> None:
                rng = random.Random(seed)
                while time.monotonic() < deadline:
                    items = rng.sample(POOL, rng.randint(1, 8))
                    if rng.random() < 0.05:
                        items[0] += MARKER
                    began = time.monotonic()
                    outputs = client.batchstring(items, max_tokens=MAX_TOKENS, timeout=90, return_exceptions=True)
                    latencies.append(time.monotonic() - began)
                    audit(items, outputs, ref, tally)

            with ThreadPoolExecutor(args.callers) as pool:
                list(pool.map(caller, range(args.callers)))
            memory.append(server_memory(server))
    finally:
        stop.set()
        watcher.join()
        server.close()
    return report(console, tally, latencies, [memory_start, *memory], supervisor.restarts, args)


def _break_engine(server: LocalServer, every: float, deadline: float, stop: threading.Event, tally: Counter) -> None:
    import urllib.error
    import urllib.request

    from batchstring.client import RetryPolicy

    kinds = ("loop", "stall", "device")
    n = 0
    while every > 0 and not stop.wait(every) and time.monotonic() < deadline - every / 2:
        for route in ("generate", "generate_stream", "infer"):
            try:
                urllib.request.urlopen(f"http://{server.http_url}/v2/models/llm/{route}", data=b"x" * (4 << 20),
                                       timeout=30)
            except urllib.error.HTTPError as exc:
                tally["oversized bodies refused (413)" if exc.code == 413 else "oversized bodies: other status"] += 1
            except OSError:
                tally["oversized bodies: no answer"] += 1
        with BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=1)) as once:
            out = once.batchstring([f"x = 1 # {MARKER}:{kinds[n % 3]}"], max_tokens=4, timeout=30,
                                   return_exceptions=True)[0]
        tally["engine breaks (retryable error)" if isinstance(out, BatchstringError) and out.retryable
              else "engine breaks (other outcome)"] += 1
        n += 1


def _sample_memory(server: LocalServer, deadline: float, stop: threading.Event, memory: list[int]) -> None:
    while not stop.wait(30) and time.monotonic() < deadline:
        memory.append(server_memory(server))


def _kill_stubs(server: LocalServer, every: float, deadline: float, stop: threading.Event, tally: Counter) -> None:
    if every <= 0:
        return
    while not stop.wait(every) and time.monotonic() < deadline - every / 2:
        stubs = server.stub_processes()
        if stubs:
            stubs[0].kill()
            tally["model process kills"] += 1


def report(console, tally, latencies, memory: list[int], restarts, args) -> int:
    kills = f"model process killed every {args.kill_every:.0f} s" if args.kill_every > 0 else "no kills"
    table = Table(title=f"soak: {args.minutes} min, {args.callers} callers, {kills}, 5% of calls poisoned")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key in ("calls", "items", "ok", "isolated failures", "retryable errors", "deadline", "lost", "duplicated",
                "misordered", "wrong", "unexpected errors", "model process kills", "engine breaks (retryable error)",
                "engine breaks (other outcome)", "oversized bodies refused (413)", "oversized bodies: other status",
                "oversized bodies: no answer"):
        table.add_row(key, str(tally.get(key, 0)))
    table.add_row("server restarts by the supervisor", str(restarts))
    table.add_row("p99 call latency", f"{np.percentile(latencies, 99):.2f} s" if latencies else "—")
    table.add_row("server memory at start / end", f"{memory[0] / 2**20:.0f} / {memory[-1] / 2**20:.0f} MiB")
    table.add_row("server memory every 30 s (MiB)", " ".join(f"{m / 2**20:.0f}" for m in memory))
    console.print(table)
    bad = sum(tally.get(k, 0) for k in ("lost", "duplicated", "misordered", "wrong", "unexpected errors",
                                        "engine breaks (other outcome)", "oversized bodies: other status",
                                        "oversized bodies: no answer"))
    return 1 if bad else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--break-every", type=float, default=90.0,
                   help="seconds between deliberate engine failures and oversized bodies (0: none)")
    p.add_argument("--isolation", action="store_true",
                   help="instead: the other callers' throughput before and after one isolated failure")
    p.add_argument("--window", type=float, default=20.0, help="seconds before and after, with --isolation")
    p.add_argument("--callers", type=int, default=16, help="concurrent calling threads")
    p.add_argument("--kill-every", type=float, default=60.0,
                   help="seconds between model-process kills (0: none, to watch memory over one long run)")
