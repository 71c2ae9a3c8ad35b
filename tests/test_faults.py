"""Fault injection through real servers: kills, OOM, overload, cancellation, TLS.

Every load here checks each item against its reference (greedy output from the same server while
healthy): a result is either exactly right or an explicit error, never wrong, missing or repeated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from batchstring.client import BatchClient, BatchError, BatchstringError, DeadlineExceeded, RetryPolicy, Unavailable
from batchstring.server.local import LocalServer
from batchstring.server.stats import metrics
from batchstring.server.supervisor import Supervisor
from batchstring.server.triton import TLS
from tests.conftest import FAULT_MARKER, metric_reaches, start_server

POOL = [f"def handler_{i}(request):\n    " for i in range(24)]
MAX_TOKENS = 12


def reference(url: str) -> dict[str, str]:
    with BatchClient(url) as c:
        return dict(zip(POOL, c.batchstring(POOL, max_tokens=MAX_TOKENS)))


def load(url: str, calls: int, concurrency: int, retry: RetryPolicy | None = None, timeout: float | None = None,
         poison_every: int = 0) -> list[tuple[list[str], list]]:
    """`calls` batchstring calls of 1-4 strings from `concurrency` threads sharing one client."""
    def one(n: int) -> tuple[list[str], list]:
        items = [POOL[(n * 7 + k) % len(POOL)] for k in range(1 + n % 4)]
        if poison_every and n % poison_every == 0:
            items[0] += FAULT_MARKER
        return items, client.batchstring(items, max_tokens=MAX_TOKENS, timeout=timeout, return_exceptions=True)

    with BatchClient(url, retry=retry) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(calls)))


def load_across(url: str, chaos, seconds: float = 14.0, concurrency: int = 12) -> tuple[list, int]:
    """Calls from `concurrency` threads for `seconds`, while `chaos()` runs after 1 s; every item has
    a 25 s deadline (recovery and a retry fit well inside it). Returns the outcomes and how many
    items the client had to send again."""
    until = time.monotonic() + seconds

    def caller(k: int) -> list[tuple[list[str], list]]:
        out, n = [], k
        while time.monotonic() < until:
            items = [POOL[(n * 7 + i) % len(POOL)] for i in range(1 + n % 4)]
            out.append((items, client.batchstring(items, max_tokens=MAX_TOKENS, timeout=25, return_exceptions=True)))
            n += concurrency
        return out

    with BatchClient(url, retry=RetryPolicy(max_attempts=40, max_backoff=1.0, deadline=25)) as client, \
            ThreadPoolExecutor(concurrency + 1) as pool:
        calls = [pool.submit(caller, k) for k in range(concurrency)]
        time.sleep(1.0)
        pool.submit(chaos).result()
        results = [r for c in calls for r in c.result()]
        return results, client.resent


def check(results, ref: dict[str, str]) -> dict[str, int]:
    """Counts outcomes; fails on any wrong, missing or duplicated item."""
    counts = {"ok": 0, "deadline": 0, "isolated": 0}
    for items, outputs in results:
        assert len(outputs) == len(items), "an item was lost or duplicated"
        for item, out in zip(items, outputs):
            if FAULT_MARKER in item:
                assert isinstance(out, BatchstringError) and "out of memory" in str(out)
                counts["isolated"] += 1
            elif isinstance(out, DeadlineExceeded):
                counts["deadline"] += 1
            else:
                assert out == ref[item], f"wrong result for {item!r}: {out!r}"
                counts["ok"] += 1
    return counts


@pytest.fixture
def fresh_server(request, model_dir):
    return start_server(request, "fault", config="cpu", params={"fault_marker": FAULT_MARKER})


def test_server_killed_and_restarted_during_load_loses_nothing(fresh_server):
    ref = reference(fresh_server.grpc_url)

    def kill_and_restart() -> None:
        os.killpg(fresh_server.process.pid, signal.SIGKILL)
        fresh_server.process.wait()
        time.sleep(1.0)
        fresh_server.start()  # same public ports

    results, resent = load_across(fresh_server.grpc_url, kill_and_restart)
    counts = check(results, ref)
    assert counts["deadline"] == 0, "recovery and retry fit well inside every item's deadline"
    assert resent > 0, "items in flight at the kill were sent again"
    assert counts["ok"] == sum(len(items) for items, _ in results), "and answered once, correctly"


def test_a_job_over_a_file_loses_nothing_when_the_server_restarts(fresh_server, tmp_path):
    ref = reference(fresh_server.grpc_url)
    source, output = tmp_path / "jobs.txt", tmp_path / "out.jsonl"
    source.write_text("".join(POOL[i % len(POOL)].replace("\n    ", " ") + "\n" for i in range(3000)))
    job = subprocess.Popen([str(Path(sys.executable).parent / "batchstring"), "run", "--url", fresh_server.grpc_url,
                            "--input", str(source), "--output", str(output), "--max-tokens", str(MAX_TOKENS)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while not output.exists() or output.stat().st_size < 50_000:
        time.sleep(0.05)
    os.killpg(fresh_server.process.pid, signal.SIGKILL)  # the whole server, mid-job
    fresh_server.process.wait()
    time.sleep(1.0)
    fresh_server.start()
    assert job.wait(timeout=300) == 0, job.stderr.read()
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(int(line["custom_id"]) for line in lines) == list(range(1, 3001)), "every line once"
    with BatchClient(fresh_server.grpc_url) as c:
        expected = dict(zip(ref, c.batchstring([p.replace("\n    ", " ") for p in ref], max_tokens=MAX_TOKENS)))
    for line in lines:
        prompt = POOL[(int(line["custom_id"]) - 1) % len(POOL)]
        assert line["response"]["body"]["choices"][0]["text"] == expected[prompt]


def test_stub_killed_supervisor_recovers_within_30_seconds_and_loses_nothing(fresh_server):
    ref = reference(fresh_server.grpc_url)
    stop = threading.Event()
    events: list[tuple[float, str]] = []
    supervisor = Supervisor(fresh_server, interval=0.5, report=lambda line: events.append((time.monotonic(), line)))
    watcher = threading.Thread(target=supervisor.run, args=(stop,))
    watcher.start()
    killed_at: list[float] = []

    def kill_stub() -> None:
        stub = fresh_server.stub_processes()[0]
        killed_at.append(time.monotonic())
        stub.kill()

    try:
        results, resent = load_across(fresh_server.grpc_url, kill_stub)
    finally:
        stop.set()
        watcher.join()
    assert supervisor.restarts == 1, events
    back = next(t for t, line in events if "serving again" in line)
    assert back - killed_at[0] <= 30, f"service back after {back - killed_at[0]:.1f} s"
    counts = check(results, ref)
    assert counts["deadline"] == 0 and resent > 0
    assert counts["ok"] == sum(len(items) for items, _ in results)


def test_injected_oom_under_load_fails_only_the_poisoned(fresh_server):
    ref = reference(fresh_server.grpc_url)
    results = load(fresh_server.grpc_url, calls=60, concurrency=12, poison_every=5)
    counts = check(results, ref)
    assert counts["isolated"] == 12 and counts["deadline"] == 0
    assert metric_reaches(fresh_server.metrics_url, "batchstring_failures_isolated_total", 12) >= 12


@pytest.fixture
def tiny_queue_server(request, model_dir):
    """An engine of 2 sequences with room for 2 waiting, and a Triton queue of 4."""
    def edit(config) -> None:
        config.max_batch_size = 2
        del config.dynamic_batching.preferred_batch_size[:]
        config.dynamic_batching.default_queue_policy.max_queue_size = 4

    return start_server(request, "tiny-queue", config="cpu", edit=edit,
                        params={"max_num_seqs": "2", "max_waiting_seqs": "2"})


def test_full_queue_is_refused_fast_and_retried_with_backoff(tiny_queue_server):
    url = tiny_queue_server.grpc_url
    with BatchClient(url, retry=RetryPolicy(max_attempts=1)) as c, ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(lambda i: c.batchstring([POOL[i % 24]], max_tokens=40, ignore_eos=True,
                                                         return_exceptions=True)[0], range(32)))
    rejected = [o for o in outcomes if isinstance(o, BatchstringError)]
    assert all(isinstance(e, Unavailable) for e in rejected), rejected
    assert rejected, "a burst of 32 into 2 running + 2 waiting + 4 queued must overflow the queue"
    assert all("exceeds maximum queue size" in str(e).lower() and e.retryable for e in rejected)
    results = load(url, calls=40, concurrency=32, retry=RetryPolicy(max_attempts=20, max_backoff=1.0), timeout=120)
    ref = reference(url)
    counts = check(results, ref)
    assert counts["deadline"] == 0, "with backoff every call completes"
    assert tiny_queue_server.model_ready()


def test_a_stream_cancelled_among_busy_streams_stops_and_frees_its_slot(server):
    """Cancellation must be noticed while other streams keep the model busy sending their pieces
    (a responder that asked only when it had nothing to send never asked under load): one stream
    cancelled after two pieces stops early and is counted, and its batch-mates run to their last token."""
    mates, tokens = 16, 400
    started = threading.Semaphore(0)

    def mate(c: BatchClient, i: int) -> str:
        pieces = c.stream(f"def busy_{i}(items):", max_tokens=tokens, ignore_eos=True)
        first = next(pieces)
        started.release()
        return first + "".join(pieces)

    with BatchClient(server.grpc_url) as c, ThreadPoolExecutor(mates) as pool:
        before = metrics(server.metrics_url)
        busy = [pool.submit(mate, c, i) for i in range(mates)]
        for _ in range(mates):
            assert started.acquire(timeout=60), "a batch-mate never started streaming"
        pieces = c.stream("def long_running():", max_tokens=tokens, ignore_eos=True)
        assert next(pieces) and next(pieces)
        pieces.close()  # the client cancels mid-stream
        cancelled = before.get("batchstring_cancelled_total", 0) + 1
        # generous: on two busy cores the counter is published after the engine's next steps
        assert metric_reaches(server.metrics_url, "batchstring_cancelled_total", cancelled, timeout=30) == cancelled
        assert all(future.result(timeout=120) for future in busy)
    time.sleep(0.6)
    after = metrics(server.metrics_url)
    assert after["batchstring_running_sequences"] == 0 and after["batchstring_kv_cache_utilization"] == 0
    generated = after["batchstring_generated_tokens_total"] - before["batchstring_generated_tokens_total"]
    assert generated - mates * tokens < tokens, "the cancelled stream ran to its last token"
    assert after["batchstring_cancelled_total"] == cancelled, "a batch-mate was cancelled too"


def test_tls_serves_grpc_with_a_self_signed_certificate(tmp_path, model_dir):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with LocalServer(config="cpu", tls=TLS(cert, key)) as server:
        with BatchClient(server.grpc_url, root_certificates=cert) as secure:
            assert secure.batchstring(["def tls():"], max_tokens=4)[0]
        plain = BatchClient(server.grpc_url, retry=RetryPolicy(max_attempts=2, deadline=5))
        with plain, pytest.raises(BatchError):
            plain.batchstring(["def plain():"], max_tokens=4)
