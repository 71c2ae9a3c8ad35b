"""End to end through a real tritonserver: client -> gRPC -> dynamic batcher -> model.py -> engine."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from batchstring.client import (
    AsyncBatchClient,
    BatchClient,
    BatchError,
    BatchstringError,
    DeadlineExceeded,
    InvalidArgument,
)
from batchstring.server.stats import batch_stats, metrics
from tests.conftest import FAULT_MARKER, metric_reaches, staggered, start_server
from tests.engine_helpers import alone, engine, varied_prompts


@pytest.fixture(scope="module")
def prompts():
    return varied_prompts(50, seed=3)


@pytest.fixture(scope="module")
def hf_reference(model_dir, prompts):
    """The eager Hugging Face model generating each prompt alone (greedy, 16 tokens, EOS stops)."""
    import torch
    from transformers import AutoModelForCausalLM

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.layout import DEFAULT_MODEL_DIR

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    codec = TextCodec.from_file(model_dir / "tokenizer.json")
    texts = []
    for prompt in prompts:
        ids = codec.encode(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
        texts.append(codec.decode(out[0, len(ids):].tolist()))
    return texts


def test_fifty_strings_come_back_in_order_and_equal_the_eager_model(client, prompts, hf_reference):
    outputs = client.batchstring(prompts, max_tokens=16)
    assert len(outputs) == 50
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, hf_reference)) if a != b]
    assert not mismatched, f"items {mismatched} differ from the eager model"


def test_dynamic_batching_forms_real_batches(server, client):
    before = batch_stats(server.grpc_url)
    barrier = threading.Barrier(32)

    def caller(i: int) -> str:
        barrier.wait()
        return client.batchstring([f"def f{i}(x):"], max_tokens=8)[0]

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = batch_stats(server.grpc_url) - before
    assert stats.requests == 32
    assert stats.average_batch > 1, f"Triton ran {stats.executions} executions for 32 requests"


def test_batch_invariance_through_triton(model_dir, server):
    prompts = varied_prompts(40, seed=5)
    reference = alone(engine(model_dir), prompts)
    codec_engine = engine(model_dir)
    expected = [codec_engine.codec.decode(ids) for ids in reference]
    outputs = staggered(server.grpc_url, prompts, max_tokens=24)
    assert [i for i, (a, b) in enumerate(zip(outputs, expected)) if a != b] == []


def test_one_poisoned_request_among_sixteen_fails_alone(client, prompts, hf_reference):
    items = [*prompts[:15], prompts[15] + FAULT_MARKER]
    results = client.batchstring(items, max_tokens=16, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(results[15], BatchstringError)
    assert "out of memory" in str(results[15]) and not results[15].retryable
    assert results[:15] == hf_reference[:15]


def test_batch_error_carries_every_items_outcome(client):
    with pytest.raises(BatchError) as info:
        client.batchstring(["def a():", "x" + FAULT_MARKER, "def b():"], max_tokens=4)
    err = info.value
    assert list(err.errors) == [1]
    assert isinstance(err.results[0], str) and isinstance(err.results[2], str)


def test_streamed_pieces_concatenate_to_the_non_streamed_output(client, prompts):
    for prompt in prompts[:6]:
        pieces = list(client.stream(prompt, max_tokens=24))
        assert len(pieces) > 1
        assert "".join(pieces) == client.batchstring([prompt], max_tokens=24)[0]


def test_one_client_shared_by_sixteen_threads(client, prompts):
    pool = prompts[:20]
    expected = dict(zip(pool, client.batchstring(pool, max_tokens=8)))
    failures: list[str] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for _ in range(20):
            mine = [pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 4)), replace=False)]
            got = client.batchstring(mine, max_tokens=8)
            if got != [expected[p] for p in mine]:
                failures.append(f"thread {t}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_client_side_checks_happen_before_anything_is_sent():
    with BatchClient("127.0.0.1:9") as c:  # nothing listens there
        assert c.batchstring([]) == []
        with pytest.raises(InvalidArgument, match="must be str"):
            c.batchstring(["ok", 3])
        with pytest.raises(InvalidArgument, match="list of strings"):
            c.batchstring("not a list")
        with pytest.raises(InvalidArgument, match="lone surrogates"):
            c.batchstring(["bad \ud800"])


def test_timeout_surfaces_as_a_clear_deadline_error(client):
    with pytest.raises(BatchError) as info:
        client.batchstring(["def slow():"] * 4, max_tokens=480, ignore_eos=True, speculative=False, timeout=0.05)
    assert all(isinstance(e, DeadlineExceeded) for e in info.value.errors.values())
    assert "deadline" in str(info.value)


def test_engine_metrics_are_exported(server, client):
    client.batchstring(["def metric():"], max_tokens=4)
    metric_reaches(server.metrics_url, "batchstring_generated_tokens_total", 4)
    m = metrics(server.metrics_url)
    for name in ("batchstring_generated_tokens_total", "batchstring_steps_total",
                 "batchstring_step_sequences_total", "batchstring_kv_cache_utilization",
                 "batchstring_running_sequences", "batchstring_preemptions_total",
                 "batchstring_failures_isolated_total", "batchstring_requests_finished_total"):
        assert name in m, name
    assert m["batchstring_generated_tokens_total"] >= 4
    assert m["nv_inference_request_success"] >= 1  # Triton's own metrics sit beside ours


@pytest.fixture(scope="module")
def torchscript_server(request, model_dir):
    return start_server(request, "torchscript", config="cpu", params={"runtime": "torchscript"})


def test_torchscript_runtime_serves_the_same_completions(torchscript_server, client, prompts):
    with BatchClient(torchscript_server.grpc_url) as ts:
        assert ts.batchstring(prompts[:10], max_tokens=16) == client.batchstring(prompts[:10], max_tokens=16)


def test_a_seeded_sampled_request_is_the_same_alone_and_among_forty_others_through_triton(model_dir, server):
    from batchstring.engine.sampling_params import SamplingParams

    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 4321}
    prompt = "def parse_header(line):\n"
    eng = engine(model_dir)
    seq = eng.make_sequence(prompt, SamplingParams(max_tokens=24, ignore_eos=True, **sampling), lambda o: None)
    eng.generate([seq])
    expected = eng.codec.decode(seq.output_ids)
    crowd = varied_prompts(40, seed=9)

    async def run() -> tuple[str, str]:
        async with AsyncBatchClient(server.grpc_url) as aio:
            alone = (await aio.batchstring([prompt], max_tokens=24, ignore_eos=True, **sampling))[0]

            async def other(i: int, text: str) -> str:
                await asyncio.sleep(0.005 * (i % 8))
                return (await aio.batchstring([text], max_tokens=32, temperature=0.9, seed=i))[0]

            async def seeded() -> str:
                await asyncio.sleep(0.02)  # joins while the crowd is running
                return (await aio.batchstring([prompt], max_tokens=24, ignore_eos=True, **sampling))[0]

            *_, among = await asyncio.gather(*(other(i, t) for i, t in enumerate(crowd)), seeded())
            return alone, among

    before = metrics(server.metrics_url)
    alone, among = asyncio.run(run())
    time.sleep(0.6)  # metrics are published twice a second
    after = metrics(server.metrics_url)
    assert alone == among == expected
    steps = after["batchstring_steps_total"] - before["batchstring_steps_total"]
    seqs = after["batchstring_step_sequences_total"] - before["batchstring_step_sequences_total"]
    assert seqs / steps > 4, "the crowd must really have shared steps"


def test_shared_prefixes_through_triton_reuse_the_cache_and_give_the_reference_tokens(model_dir, server, client):
    from tests.test_engine import shared_prefix_and_long_prompts

    prompts = shared_prefix_and_long_prompts()
    plain = engine(model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    expected = [plain.codec.decode(ids) for ids in alone(plain, prompts)]
    before = metrics(server.metrics_url)
    outputs = client.batchstring(prompts, max_tokens=24, ignore_eos=True)
    hits = metric_reaches(server.metrics_url, "batchstring_prefix_cache_hits_total",
                          before.get("batchstring_prefix_cache_hits_total", 0) + 30 * 200)
    after = metrics(server.metrics_url)
    assert [i for i, (a, b) in enumerate(zip(outputs, expected)) if a != b] == []
    queries = after["batchstring_prefix_cache_queries_total"] - before.get("batchstring_prefix_cache_queries_total", 0)
    hit_rate = (hits - before.get("batchstring_prefix_cache_hits_total", 0)) / queries
    assert hit_rate > 0.4, f"the shared instruction should be computed once; hit rate {hit_rate:.2f}"
    assert after["batchstring_prefix_cache_blocks"] > 0
