"""What the docs claim about serving, each checked through a real server so that it would fail
if the claim were false: sampling controls, output tensors, the HTTP routes, cancellation,
admin lock-down, metrics and bounds. References are independent of the path under test: the
uncut text for stop strings, greedy decoding for top_k 1, the in-process engine for invariance.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import grpc
import psutil
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from batchstring.client import AsyncBatchClient, BatchClient
from batchstring.server.stats import metrics
from tests.conftest import FAULT_MARKER, metric_reaches, staggered, start_server
from tests.engine_helpers import alone, engine, varied_prompts

PROMPTS = varied_prompts(8, seed=21)


def finished_by_reason(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("batchstring_requests_finished_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def settle(metrics_url: str, name: str, value: float, timeout: float = 10.0) -> float:
    """Polls until `name` equals `value` (metrics are published twice a second)."""
    deadline = time.monotonic() + timeout
    while (current := metrics(metrics_url).get(name)) != value and time.monotonic() < deadline:
        time.sleep(0.25)
    return current


# ----- sampling controls -------------------------------------------------------------------------


def test_stop_strings_cut_exactly_where_the_uncut_text_first_contains_them(client):
    uncut = client.complete(PROMPTS, max_tokens=40, ignore_eos=True, logprobs=0)
    cases = []
    for prompt, full in zip(PROMPTS, uncut):
        tokens = [e["token"] for e in full.logprobs]
        start = 0
        for token in tokens[3:]:  # a stop that begins inside a token of 3+ characters, and runs past it
            start = full.text.index(token, start) if token else start
            if len(token) >= 3 and start + len(token) < len(full.text):
                cases.append((prompt, full.text, full.text[start + 1: start + len(token) + 1]))
                break
        cases.append((prompt, full.text, full.text[10:13]))
    assert len(cases) >= 12
    for prompt, full, stop in cases:
        got = client.complete([prompt], max_tokens=40, ignore_eos=True, stop=[stop])[0]
        assert got.text == full[: full.index(stop)], (prompt, stop)
        assert got.finish_reason == "stop" and got.completion_tokens <= 40
        streamed = "".join(client.stream(prompt, max_tokens=40, ignore_eos=True, stop=[stop]))
        assert streamed == got.text


def test_stop_strings_that_never_occur_run_to_max_tokens(client):
    got = client.complete(PROMPTS[:3], max_tokens=12, ignore_eos=True, stop=["\x00never\x00", "\x01"])
    assert [g.finish_reason for g in got] == ["length"] * 3 and [g.completion_tokens for g in got] == [12] * 3


def test_top_k_1_and_a_tiny_top_p_are_greedy_whatever_the_seed(client):
    greedy = client.batchstring(PROMPTS, max_tokens=16)
    for seed in (1, 2):
        assert client.batchstring(PROMPTS, max_tokens=16, temperature=1.0, top_k=1, seed=seed) == greedy
        assert client.batchstring(PROMPTS, max_tokens=16, temperature=1.0, top_p=1e-6, seed=seed) == greedy
    sampled = client.batchstring(PROMPTS, max_tokens=16, temperature=1.0, seed=1)
    assert sampled != greedy, "unrestricted sampling at temperature 1 does differ, so the above is a real check"


def test_seeded_sampling_is_reproducible_and_depends_on_the_seed(client):
    runs = [client.batchstring(PROMPTS, max_tokens=16, temperature=0.9, top_p=0.95, seed=s) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_min_tokens_holds_stop_strings_back(client):
    for prompt in PROMPTS[:4]:
        full = client.complete([prompt], max_tokens=40, ignore_eos=True)[0].text
        stop = full[2:4]  # would cut within the first tokens
        early = client.complete([prompt], max_tokens=40, ignore_eos=True, stop=[stop])[0]
        late = client.complete([prompt], max_tokens=40, ignore_eos=True, stop=[stop], min_tokens=12)[0]
        assert early.completion_tokens < 12
        assert late.completion_tokens >= 12 and full.startswith(late.text) and len(late.text) > len(early.text)


# ----- output tensors and the HTTP routes ---------------------------------------------------------


def http_json(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def test_http_generate_returns_prompt_and_completion_by_default_with_counts(server, client, model_dir):
    from batchstring.engine.tokenizer import TextCodec

    codec = TextCodec.from_file(model_dir / "tokenizer.json")
    for prompt in PROMPTS[:3]:
        completion = client.complete([prompt], max_tokens=9, ignore_eos=True)[0]
        body = json.loads(http_json(f"http://{server.http_url}/v2/models/llm/generate",
                                    {"text_input": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True}))
        assert body["text_output"] == prompt + completion.text, "the default includes the prompt"
        assert body["finish_reason"] == "length" and body["num_output_tokens"] == 9
        assert body["num_input_tokens"] == len(codec.encode(prompt)) == completion.prompt_tokens


def test_http_generate_stream_pieces_add_up_to_the_completion(server, client):
    prompt = PROMPTS[0]
    expected = client.complete([prompt], max_tokens=12, stop=["\n\n\n"])[0]
    raw = http_json(f"http://{server.http_url}/v2/models/llm/generate_stream",
                    {"text_input": prompt, "max_tokens": 12, "temperature": 0, "stream": True,
                     "exclude_input_in_output": True, "stop": "\n\n\n"}).decode()  # Triton: no lists here
    events = [json.loads(e[5:]) for e in raw.split("\n\n") if e.startswith("data:")]
    assert len(events) > 2
    assert "".join(e["text_output"] for e in events) == expected.text
    assert events[-1]["finish_reason"] == expected.finish_reason


# ----- cancellation ------------------------------------------------------------------------------


def test_cancelling_the_task_that_iterates_a_stream_stops_it_on_the_server(server):
    """Beside 16 other long requests, as traffic is: their company makes the stream's steps
    batched ones, so it would outlast the server's polls for cancellation (a lone stream of 450
    tokens can end before the poll after its cancellation, leaving nothing to stop)."""
    before = metrics(server.metrics_url).get("batchstring_cancelled_total", 0)

    async def run() -> int:
        async with AsyncBatchClient(server.grpc_url) as aio:
            pieces = 0

            async def consume() -> None:
                nonlocal pieces
                async for _ in aio.stream("def forever():", max_tokens=450, ignore_eos=True):
                    pieces += 1

            others = asyncio.create_task(aio.batchstring([f"def company_{i}():" for i in range(16)], max_tokens=450,
                                                         ignore_eos=True))
            task = asyncio.create_task(consume())
            while pieces < 3:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert all(isinstance(text, str) for text in await others), "the company finishes undisturbed"
            return pieces

    assert asyncio.run(run()) < 450
    assert metric_reaches(server.metrics_url, "batchstring_cancelled_total", before + 1) >= before + 1
    assert settle(server.metrics_url, "batchstring_running_sequences", 0) == 0


def test_cancelling_requests_still_waiting_for_admission_frees_them(server):
    """64 long requests fill every slot of the engine; 8 more wait; cancelling those 8 drops them
    from the waiting list while the 64 keep running."""
    before = metrics(server.metrics_url)

    async def run() -> tuple[float, float]:
        async with AsyncBatchClient(server.grpc_url) as aio:
            busy = asyncio.create_task(aio.batchstring([f"def busy_{i}():" for i in range(64)], max_tokens=450,
                                                       ignore_eos=True))
            await asyncio.to_thread(metric_reaches, server.metrics_url, "batchstring_running_sequences", 64)
            waiting = asyncio.create_task(aio.batchstring([f"def queued_{i}():" for i in range(8)], max_tokens=8))
            seen = await asyncio.to_thread(metric_reaches, server.metrics_url, "batchstring_waiting_sequences", 8)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            dropped = await asyncio.to_thread(metric_reaches, server.metrics_url, "batchstring_cancelled_total",
                                              before.get("batchstring_cancelled_total", 0) + 8)
            still = metrics(server.metrics_url)["batchstring_running_sequences"]
            assert settle(server.metrics_url, "batchstring_waiting_sequences", 0) == 0
            busy.cancel()
            await asyncio.gather(busy, return_exceptions=True)
            return seen, dropped - before.get("batchstring_cancelled_total", 0), still

    seen, dropped, still = asyncio.run(run())
    assert seen >= 8, "the 8 were waiting"
    assert dropped >= 8 and still == 64, "they were dropped while the others kept running"
    assert settle(server.metrics_url, "batchstring_running_sequences", 0) == 0


# ----- lock-down ---------------------------------------------------------------------------------


def test_tritonservers_own_admin_apis_want_the_key_and_refuse_model_control(server):
    """Behind the front door (which does not forward them at all), Triton itself restricts the
    admin protocols to a header key, and has no model control even with the key."""
    argv = psutil.Process(server.process.pid).cmdline()
    key = next(a.split("admin-key=", 1)[1] for a in argv if a.startswith("--grpc-restricted-protocol="))
    with grpc.insecure_channel(server.sockets.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=10)
        assert "restricted" in refused.value.details().lower()
        admin = (("triton-grpc-protocol-admin-key", key),)
        assert [m.name for m in stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), metadata=admin,
                                                     timeout=10).models] == ["llm"]
        with pytest.raises(grpc.RpcError) as no_control:
            stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name="llm"), metadata=admin,
                                       timeout=10)
        assert "not allowed" in no_control.value.details().lower()
    assert server.model_ready()


# ----- metrics and bounds ------------------------------------------------------------------------


def test_every_readme_metric_moves_as_the_workload_says(server, client):
    url = server.metrics_url
    # Work an earlier test left running would finish during this one: start from an idle engine,
    # and from a snapshot published after it went idle (twice a second).
    assert settle(url, "batchstring_running_sequences", 0) == 0
    time.sleep(0.6)
    before, reasons = metrics(url), finished_by_reason(url)
    peak: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for name, value in metrics(url).items():
                peak[name] = max(peak.get(name, 0.0), value)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        lengths = client.complete([f"def metric_{i}():" for i in range(80)], max_tokens=40, ignore_eos=True)
        full = lengths[0].text
        stopped = client.complete(["def metric_0():"], max_tokens=40, ignore_eos=True, stop=[full[5:8]])
        poisoned = client.batchstring(["def poisoned():" + FAULT_MARKER], max_tokens=4, return_exceptions=True)
        with BatchClient(server.grpc_url) as c:  # items past their deadline (each needs > 1 s): dropped, "abort"
            c.batchstring([f"def late_{i}():" for i in range(8)], max_tokens=450, ignore_eos=True, timeout=0.6,
                          speculative=False, return_exceptions=True)
        metric_reaches(url, "batchstring_cancelled_total", before.get("batchstring_cancelled_total", 0) + 1)
        time.sleep(0.6)
    finally:
        stop.set()
        watcher.join()
    after, reasons_after = metrics(url), finished_by_reason(url)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    moved = {reason: reasons_after.get(reason, 0) - reasons.get(reason, 0) for reason in reasons_after}
    # A late item ends by its deadline ("abort") unless the machine is fast enough to finish it first.
    late_finished = moved["length"] - 80
    assert 0 <= late_finished < 8 and 1 <= moved["abort"] <= 8 - late_finished, moved
    assert moved["stop"] == 1 and moved["error"] == 1, moved
    assert stopped[0].finish_reason == "stop" and not isinstance(poisoned[0], str)
    assert delta("batchstring_generated_tokens_total") >= 80 * 40
    assert delta("batchstring_prompt_tokens_total") >= sum(c.prompt_tokens for c in lengths)
    assert delta("batchstring_failures_isolated_total") == 1 and delta("batchstring_oom_events_total") >= 1
    assert delta("batchstring_cancelled_total") >= 1
    steps, prefill = delta("batchstring_steps_total"), delta("batchstring_prefill_steps_total")
    assert steps >= 40 and 1 <= prefill < steps
    assert delta("batchstring_step_sequences_total") / steps > 4, "80 strings shared steps"
    for gauge in ("batchstring_running_sequences", "batchstring_kv_cache_utilization", "batchstring_step_batch_size"):
        assert peak[gauge] > 0, f"{gauge} rose under load"
    assert peak["batchstring_running_sequences"] <= 64 and peak["batchstring_kv_cache_utilization"] <= 1
    assert settle(url, "batchstring_running_sequences", 0) == 0 and after["batchstring_waiting_sequences"] == 0


def test_ten_thousand_strings_never_exceed_max_in_flight(server):
    items = [f"x{i} = " for i in range(10_000)]
    peak = 0
    with BatchClient(server.grpc_url, max_in_flight=128) as c:
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, sum(conn.outstanding for conn in c._aio.connections))
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            outputs = c.batchstring(items, max_tokens=1)
        finally:
            done.set()
            watcher.join()
    assert len(outputs) == 10_000 and all(isinstance(o, str) for o in outputs)
    assert 64 <= peak <= 128, f"at most max_in_flight at once, and the bound was reached: peak {peak}"


def test_stop_string_limits_are_enforced_with_clear_errors(client):
    for stop, fragment in ((["s"] * 17, "at most 16"), (["x" * 129], "at most 128"), ([""], "non-empty")):
        result = client.batchstring(["def f():"], max_tokens=4, stop=stop, return_exceptions=True)[0]
        assert not isinstance(result, str) and "stop" in str(result) and fragment in str(result), (stop, result)


# ----- batch invariance beyond the default configuration -----------------------------------------


@pytest.fixture(scope="module")
def torchscript_small_cache(request, model_dir):
    """TorchScript, with a KV cache of 4 full contexts: a crowd of 40 must preempt."""
    return start_server(request, "torchscript-preempt", config="cpu",
                        params={"runtime": "torchscript", "kv_cache_tokens": "2048"})


def test_torchscript_under_preemption_gives_each_string_its_solo_tokens(torchscript_small_cache, model_dir):
    prompts = varied_prompts(40, seed=5)
    reference_engine = engine(model_dir, runtime="torchscript")
    expected = [reference_engine.codec.decode(ids) for ids in alone(reference_engine, prompts)]
    url = torchscript_small_cache.metrics_url
    before = metrics(url).get("batchstring_preemptions_total", 0)
    outputs = staggered(torchscript_small_cache.grpc_url, prompts, max_tokens=24)
    assert metric_reaches(url, "batchstring_preemptions_total", before + 1) > before, "the small cache preempted"
    assert [i for i, (a, b) in enumerate(zip(outputs, expected)) if a != b] == []


def test_static_scheduling_through_triton_gives_each_string_its_solo_tokens(request, model_dir):
    static = start_server(request, "static", config="cpu", params={"scheduling": "static"})
    prompts = varied_prompts(24, seed=6)
    plain = engine(model_dir)
    expected = [plain.codec.decode(ids) for ids in alone(plain, prompts)]
    assert staggered(static.grpc_url, prompts, max_tokens=24) == expected
