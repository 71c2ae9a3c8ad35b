"""Process lifecycle against real servers: a stop drains and takes seconds, and nothing outlives
the process that started it, whatever kills it (issue: stop in seconds, leave nothing behind).

The image's entrypoint gets the same checks in tests/test_deploy.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.error
import urllib.request

import psutil
import pytest

from batchstring.client import AsyncBatchClient, BatchClient
from batchstring.server.local import LocalServer
from batchstring.server.stats import metrics
from tests.conftest import (
    GONE_BOUND,
    STOP_BOUND,
    alive,
    assert_kill_leaves_nothing,
    gone_within,
    kinds,
    serve,
    start_server,
    stop,
    temporary_files,
)

MAX_TOKENS = 64


def test_idle_sigterm_stops_serve_within_3_seconds_and_leaves_nothing(model_dir, tmp_path):
    before = temporary_files()
    proc, ports, banner = serve(tmp_path)
    try:
        assert "llm ready" in banner and f"127.0.0.1:{ports[1]}" in banner, banner
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert set(kinds(processes)) == {"front door", "tritonserver", "model"}
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        took = time.monotonic() - signalled
        assert took <= STOP_BOUND, f"an idle stop took {took:.1f} s"
        assert alive(processes) == []
        assert "batchstring: stopped in" in proc.stdout.read()
        assert temporary_files() - before == set(), "no directory left in /tmp"
    finally:
        stop(proc)


@pytest.mark.parametrize("drain", [6.0, 0.0], ids=["admitted-finish", "cut-at-deadline"])
def test_sigterm_under_load_loses_nothing_with_a_second_server(request, model_dir, tmp_path, drain):
    """One `batchstring` call across two servers; one is stopped mid-call. Its admitted requests
    finish (or, with no time to drain, are cut and sent again), new ones are refused as
    retryable and go to the other server: every item comes back once, equal to the other
    server's answer."""
    other = start_server(request, "lifecycle-other", config="cpu")
    proc, ports, banner = serve(tmp_path, f"--drain-seconds={drain:g}")
    prompts = [f"def drain_{i}(items):" for i in range(160)]  # more than both engines run at once
    with BatchClient(other.grpc_url) as client:
        expected = client.batchstring(prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    metrics_url = f"http://127.0.0.1:{ports[2]}/metrics"

    async def call_and_stop() -> tuple[list[str], float, int]:
        # Few items in flight at a time: the call keeps sending new ones while the server drains.
        async with AsyncBatchClient([f"127.0.0.1:{ports[1]}", other.grpc_url], max_in_flight=16) as client:
            call = asyncio.create_task(client.batchstring(prompts, max_tokens=MAX_TOKENS, ignore_eos=True))
            busy = {}
            # the server to stop is busy with the call (generating, requests running), most of it unsent
            while busy.get("batchstring_generated_tokens_total", 0) < MAX_TOKENS or \
                    not busy.get("batchstring_running_sequences", 0):
                await asyncio.sleep(0.1)
                busy = await asyncio.to_thread(metrics, metrics_url)
            assert not call.done(), "the call ended before the stop: make it longer"
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)

            def stop_time() -> float:
                proc.wait()
                return time.monotonic() - signalled

            results, took = await asyncio.gather(call, asyncio.to_thread(stop_time))
            return results, took, client.resent

    try:
        assert "llm ready" in banner, banner
        results, took, resent = asyncio.run(call_and_stop())
        assert proc.returncode == 0
        assert results == expected, "every item once, each equal to what the other server answers"
        assert took <= drain + STOP_BOUND, f"a busy stop took {took:.1f} s (drain deadline {drain:g} s)"
        log = (tmp_path / "serve.log").read_text()
        admitted = int(re.search(r"draining: .*; (\d+) admitted requests", log)[1])
        assert admitted > 0, "the stopped server had requests in flight"
        assert resent > 0, "requests refused (or cut) while it drained were sent again"
        drained = re.search(r"frontdoor: drained in .*", log)[0]
        assert ("cut at the deadline" in drained) == (drain == 0), drained
        print(f"busy stop: {took:.1f} s, {admitted} requests admitted at SIGTERM, {resent} sent again;",
              re.search(r"frontdoor: drained.*", log)[0])
    finally:
        stop(proc)


def test_a_draining_server_is_unready_refuses_new_work_and_finishes_what_it_admitted(model_dir, tmp_path):
    proc, ports, banner = serve(tmp_path, "--drain-seconds=60")
    http = f"http://127.0.0.1:{ports[0]}"
    prompts = [f"def admitted_{i}():" for i in range(48)]

    def refused(path: str, body: bytes | None = None) -> tuple[int, str]:
        with pytest.raises(urllib.error.HTTPError) as refusal:
            urllib.request.urlopen(urllib.request.Request(http + path, data=body), timeout=10)
        return refusal.value.code, refusal.value.read().decode()

    async def admit_then_stop() -> tuple[list, dict, float, float]:
        async with AsyncBatchClient(f"127.0.0.1:{ports[1]}") as client:
            call = asyncio.create_task(client.complete(prompts, max_tokens=400, ignore_eos=True))
            generated = 0.0
            while generated < 2 * len(prompts):  # every request admitted and running
                await asyncio.sleep(0.1)
                generated = (await asyncio.to_thread(metrics, f"http://127.0.0.1:{ports[2]}/metrics")).get(
                    "batchstring_generated_tokens_total", 0)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            seen = {"http ready": await asyncio.to_thread(refused, "/v2/models/llm/ready"),
                    "http generate": await asyncio.to_thread(refused, "/v2/models/llm/generate",
                                                             b'{"text_input": "late", "max_tokens": 4}'),
                    "live": urllib.request.urlopen(http + "/v2/health/live", timeout=10).status,
                    "grpc ready": await client.ready(), "call done": call.done()}
            results = await call
            finished = time.monotonic() - signalled
            await asyncio.to_thread(proc.wait, 60)
            return results, seen, finished, time.monotonic() - signalled

    try:
        assert "llm ready" in banner, banner
        results, seen, finished, took = asyncio.run(admit_then_stop())
        assert proc.returncode == 0
        assert not seen["call done"], "the admitted requests were still running while it drained"
        assert seen["http ready"][0] == 503 and seen["grpc ready"] is False, "readiness off at once"
        status, body = seen["http generate"]
        assert status == 503 and "UNAVAILABLE: the server is shutting down" in body, "new requests: retryable"
        assert seen["live"] == 200
        assert [(r.finish_reason, r.completion_tokens) for r in results] == [("length", 400)] * len(prompts)
        assert took <= finished + STOP_BOUND, f"stopped {took - finished:.1f} s after its last request finished"
    finally:
        stop(proc)


def test_sigkill_of_serve_leaves_no_process_and_frees_its_ports(model_dir, tmp_path):
    proc, ports, banner = serve(tmp_path)
    try:
        assert "llm ready" in banner, banner
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert set(kinds(processes)) == {"front door", "tritonserver", "model"}
        assert_kill_leaves_nothing(proc, processes, ports, "supervisor")
    finally:
        stop(proc)


def test_sigkill_of_tritonserver_ends_its_model_process_within_5_seconds(model_dir):
    """Not reaped on purpose: a dead tritonserver that its parent has not waited for yet is what
    the stub's own check (`kill(parent, 0)`) cannot tell from a live one."""
    server = LocalServer(config="cpu").start()
    try:
        model = server.stub_processes()
        assert len(model) == 1
        os.kill(server.process.pid, signal.SIGKILL)
        assert gone_within(model, GONE_BOUND) == []
    finally:
        server.close()


def test_a_restart_says_so_and_ends_an_old_model_process_before_starting(model_dir, capfd):
    """A model process that survived its tritonserver (here: stopped, with its watch) would hold
    its memory while the new server sizes its cache: the start waits for it, then kills it."""
    # An overlay (any parameter) puts the model under this server's own directory, where no other
    # server's start looks for leftovers.
    server = LocalServer(config="cpu", params={"threads": "0"}).start()
    try:
        model = server.stub_processes()[0]
        for proc in (model, *model.children()):
            proc.suspend()
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait()
        assert alive([model]) == [model]
        server.start()
        assert alive([model]) == []
        said = capfd.readouterr().err
        assert f"the model process of a tritonserver that is gone still runs (pid {model.pid})" in said
        assert server.model_ready()
    finally:
        server.close()
