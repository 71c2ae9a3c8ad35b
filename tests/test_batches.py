"""The OpenAI Batch API, with the official `openai` SDK as the client, through a real server.

Every answered line is compared with what `batchstring()` returns for the same prompt (greedy
decoding is batch-invariant), and every custom_id must appear exactly once, also after the whole
server is SIGKILLed mid-batch and started again on the same data directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from batchstring.client import BatchClient
from batchstring.client.defaults import API_KEY_ENV
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence
from batchstring.frontdoor.batch_api.share import Admission
from batchstring.frontdoor.batch_api.store import open_store
from batchstring.frontdoor.gateway.auth import ENV
from tests.conftest import BATCHSTRING, metric_reaches, start_server

KEY_A, KEY_B = "sk-batch-a-0123456789", "sk-batch-b-0123456789"
MAX_FILE_BYTES = 400_000
HITS = "batchstring_prefix_cache_hits_total"
ENDED = ("completed", "failed", "cancelled", "expired")
TEMPLATE = "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}def answer():\n    return"


# ----- without a server ----------------------------------------------------------------------


def _seq(tokens: list[int], salt: bytes) -> Sequence:
    return Sequence(request_id=uuid.uuid4().hex, prompt_ids=list(tokens), params=SamplingParams(), cache_salt=salt)


@pytest.mark.parametrize(("first", "second", "shared"), [(b"", b"", True), (b"a", b"a", True), (b"a", b"b", False),
                                                         (b"", b"b", False)])
def test_cached_blocks_are_shared_only_under_the_same_salt(first, second, shared):
    blocks = BlockManager(num_blocks=16, block_size=4, max_rows=4, max_tokens_per_seq=32)
    tokens = list(range(100, 113))  # three full blocks and one token
    writer = _seq(tokens, first)
    assert blocks.admit(writer, blocks.lookup(writer), len(tokens))
    writer.num_computed = len(tokens)
    blocks.commit(writer)
    reader = _seq(tokens, second)
    assert len(blocks.lookup(reader)) == (3 if shared else 0)


def test_a_line_recorded_twice_counts_once(tmp_path):
    store = open_store(None, tmp_path)
    row = store.add_batch("owner", "/v1/completions", "file-x", "24h", 86400, None)
    store.record(row["id"], [(1, True, "{}"), (2, False, "{}")])
    store.record(row["id"], [(1, True, '{"again": 1}'), (3, True, "{}")])
    row = store.batch_row(row["id"])
    assert (row["completed"], row["failed"]) == (2, 1)
    assert list(store.results(row["id"], ok=True)) == ["{}", "{}"] and store.answered(row["id"]) == {1, 2, 3}


def test_batch_lines_yield_the_engine_to_interactive_requests_and_take_it_back():
    gate = Admission(share=1.0, fixed=None)
    assert gate.limit == gate.rows == 64  # nobody else calls: the engine's rows
    gate.observe(3, now=100.0)
    assert gate.limit == 3  # as many lines as interactive requests
    gate.observe(0, now=100.5)
    assert gate.limit == 3  # a gap between a caller's requests does not open the gate
    gate.observe(0, now=101.6)
    assert gate.limit == 64
    small = Admission(share=0.25)
    small.observe(2, now=0.0)
    assert small.limit == 1  # at least one line


def test_a_draining_server_starts_no_batch_line_and_waits_for_those_in_flight():
    async def run() -> tuple[bool, int, int]:
        gate = Admission(share=1.0)
        await gate.acquire()
        await gate.acquire()
        gate.pause()
        gate.observe(0, now=1.0)  # an idle engine does not reopen a paused gate
        blocked = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.05)
        still_waiting = not blocked.done()
        asyncio.get_running_loop().call_later(0.05, gate.release)
        left_at_deadline = await gate.settled(0.2)  # one line ended, the other did not
        gate.release()
        left = await gate.settled(1.0)
        blocked.cancel()
        return still_waiting, left_at_deadline, left

    assert asyncio.run(run()) == (True, 1, 0)


# ----- through a real server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(request, model_dir, tmp_path_factory):
    """A server with two API keys, a small upload limit and chunks of 50 requests (a batch of 300
    is six, claimed one after another); its data directory outlives restarts."""
    previous = os.environ.get(ENV)
    os.environ[ENV] = f"{KEY_A},{KEY_B}"  # the front door reads its keys from its environment
    data_dir = tmp_path_factory.mktemp("batch-data")
    template = tmp_path_factory.mktemp("chat") / "template.jinja"
    template.write_text(TEMPLATE)
    try:
        yield start_server(request, "batches", config="cpu", data_dir=data_dir,
                           front_door_options=("--batch-max-file-bytes", str(MAX_FILE_BYTES),
                                               "--chat-template", str(template), "--batch-chunk-lines", "50"))
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous


def _sdk(server, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=key, max_retries=0)


def _lines(prompts: list[str], max_tokens: int, tag: str = "", **body) -> bytes:
    lines = [{"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "llm", "prompt": p, "max_tokens": max_tokens, "temperature": 0, **body}}
             for i, p in enumerate(prompts)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _submit(sdk: openai.OpenAI, content: bytes, **options):
    uploaded = sdk.files.create(file=("input.jsonl", content), purpose="batch")
    return sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h",
                              **options)


def _wait(sdk: openai.OpenAI, batch_id: str, until=lambda b: b.status in ENDED, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if until(batch):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def _output(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()] if file_id else []


def _prompts(count: int) -> list[str]:
    return [f"def handler_{i}(event, context):\n    " for i in range(count)]


def test_a_batch_runs_to_completed_and_each_line_equals_batchstring(keyed):
    sdk = _sdk(keyed)
    prompts = _prompts(24)
    batch = _submit(sdk, _lines(prompts, 12), metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = _wait(sdk, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 24, 0)
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    lines = _output(sdk, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(str(i) for i in range(24))
    with BatchClient(keyed.grpc_url, api_key=KEY_A) as client:
        expected = client.batchstring(prompts, max_tokens=12)
    for line in lines:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["choices"][0]["text"] == expected[int(line["custom_id"])]
        assert body["usage"]["completion_tokens"] == 12
    assert sdk.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_a_chat_batch_answers_in_the_chat_completion_shape(keyed):
    sdk = _sdk(keyed)
    questions = ["Add two numbers.", "Reverse a list."]
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "llm", "messages": [{"role": "user", "content": q}], "max_tokens": 8,
                       "temperature": 0}} for i, q in enumerate(questions)]
    uploaded = sdk.files.create(file=("chat.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = _wait(sdk, batch.id)
    assert done.status == "completed"
    with BatchClient(keyed.grpc_url, api_key=KEY_A) as client:
        expected = client.batchstring([f"# user: {q}\ndef answer():\n    return" for q in questions], max_tokens=8)
    for line in _output(sdk, done.output_file_id):
        body = line["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": expected[int(line["custom_id"][1])]}


def _send_v1(server, key: str, prompt: str) -> None:
    _sdk(server, key).completions.create(model="llm", prompt=prompt, max_tokens=2, temperature=0)


def _send_grpc(server, key: str, prompt: str) -> None:
    from batchstring.client import BatchClient

    with BatchClient(server.grpc_url, api_key=key) as client:
        client.batchstring([prompt], max_tokens=2)


def _send_generate(server, key: str, prompt: str) -> None:
    body = json.dumps({"text_input": prompt, "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body,
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


@pytest.mark.parametrize(("body", "message"), [
    (json.dumps({"text_input": "def f():", "max_tokens": 2, "cache_salt": 5}).encode(), "cache_salt must be a string"),
    (b"text_input=def", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
])
def test_a_generate_body_that_cannot_carry_its_salt_is_refused_not_sent_unsalted(keyed, body, message):
    request = urllib.request.Request(f"http://{keyed.http_url}/v2/models/llm/generate", data=body,
                                     headers={"Authorization": f"Bearer {KEY_A}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 400 and message in refused.value.read().decode()
    _send_generate(keyed, KEY_A, "def still_served():")  # the server answers the next one


@pytest.mark.parametrize("send", [_send_v1, _send_grpc, _send_generate], ids=["v1", "grpc", "v2-generate"])
def test_the_same_prompt_hits_the_prefix_cache_under_one_key_only(keyed, send):
    """Block keys are salted per API key on every route: key B's identical prompt finds none of key
    A's blocks, while key A finds its own."""
    prompt = f"# {uuid.uuid4().hex}\n" + "def total(values):\n    result = 0\n    for v in values:\n" * 4
    before = metric_reaches(keyed.metrics_url, HITS, 0)
    send(keyed, KEY_A, prompt)
    time.sleep(1.5)  # the engine publishes its counters twice a second
    after_a = metric_reaches(keyed.metrics_url, HITS, before)
    send(keyed, KEY_B, prompt)
    time.sleep(1.5)
    assert metric_reaches(keyed.metrics_url, HITS, after_a) == after_a  # no hit for the other key
    send(keyed, KEY_A, prompt)
    assert metric_reaches(keyed.metrics_url, HITS, after_a + 16) >= after_a + 16  # its own blocks are found


def test_another_key_can_neither_see_nor_touch_a_keys_files_and_batches(keyed):
    a, b = _sdk(keyed, KEY_A), _sdk(keyed, KEY_B)
    batch = _submit(a, _lines(_prompts(2), 4))
    done = _wait(a, batch.id)
    for call in (lambda: b.files.retrieve(batch.input_file_id), lambda: b.files.content(done.output_file_id),
                 lambda: b.files.delete(batch.input_file_id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    theirs = {f.id for f in a.files.list()}
    assert batch.input_file_id in theirs and not theirs & {f.id for f in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    with pytest.raises(openai.NotFoundError, match="No such File"):  # the same answer as for no file at all
        b.files.retrieve("file-does-not-exist")


def test_batches_list_newest_first_in_pages(keyed):
    sdk = _sdk(keyed, KEY_B)
    made = [_submit(sdk, _lines(["x = "], 2, tag=f"p{i}-")).id for i in range(3)]
    for batch_id in made:
        _wait(sdk, batch_id)
    first = sdk.batches.list(limit=2)
    assert [x.id for x in first.data] == made[::-1][:2] and first.has_more
    assert [x.id for x in sdk.batches.list(limit=2)][:3] == made[::-1]  # the SDK follows the pages


def test_malformed_lines_fail_the_batch_at_validating_with_their_numbers(keyed):
    sdk = _sdk(keyed)
    good = json.loads(_lines(["a = "], 2).decode())
    content = "\n".join([json.dumps(good), "{not json", json.dumps({**good, "custom_id": ""}),
                         json.dumps({**good, "url": "/v1/embeddings"}), json.dumps(good),
                         json.dumps({**good, "custom_id": "n", "body": {**good["body"], "n": 3}})]).encode()
    batch = _wait(sdk, _submit(sdk, content).id)
    assert batch.status == "failed" and batch.in_progress_at is None and batch.output_file_id is None
    assert [e.line for e in batch.errors.data] == [2, 3, 4, 5, 6]
    errors = [line["error"] for line in _output(sdk, batch.error_file_id)]
    assert [e["line"] for e in errors] == [2, 3, 4, 5, 6]
    assert "not valid JSON" in errors[0]["message"] and "repeats line 1" in errors[3]["message"]
    assert "one completion of one prompt" in errors[4]["message"]


def test_an_oversized_upload_is_refused_before_it_is_stored(keyed):
    sdk = _sdk(keyed)
    files_dir = Path(keyed.data_dir) / "files"
    stored = set(os.listdir(files_dir))
    with pytest.raises(openai.APIStatusError, match=f"at most {MAX_FILE_BYTES} bytes") as refused:
        sdk.files.create(file=("big.jsonl", _lines(["y" * 1000], 2) * 500), purpose="batch")
    assert refused.value.status_code == 413
    assert set(os.listdir(files_dir)) == stored
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        sdk.files.create(file=("x.jsonl", _lines(["x"], 2)), purpose="fine-tune")


def test_cancel_mid_way_keeps_the_answered_lines(keyed):
    sdk = _sdk(keyed)
    batch = _submit(sdk, _lines(_prompts(400), 48, ignore_eos=True))
    _wait(sdk, batch.id, until=lambda b: b.request_counts.completed >= 10)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = _wait(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert 10 <= counts.completed < counts.total == 400
    lines = _output(sdk, done.output_file_id)
    assert len(lines) == counts.completed == len({line["custom_id"] for line in lines})
    with pytest.raises(openai.BadRequestError, match="only a validating or in_progress batch"):
        sdk.batches.cancel(_wait(sdk, _submit(sdk, _lines(["z = "], 2)).id).id)


def test_a_batch_that_breaks_mid_way_fails_saying_why_and_keeps_its_answers(keyed):
    sdk = _sdk(keyed)
    content = _lines(_prompts(300), 32, ignore_eos=True)
    batch = _submit(sdk, content)
    _wait(sdk, batch.id, until=lambda b: b.request_counts.completed >= 5)
    with (Path(keyed.data_dir) / "files" / batch.input_file_id).open("r+b") as f:  # corrupted behind its back
        f.seek(len(content) - 2000)
        f.write(b"x" * 1000)
    done = _wait(sdk, batch.id)
    assert done.status == "failed" and done.failed_at is not None
    assert "could not run this batch" in done.errors.data[0].message
    assert len(_output(sdk, done.output_file_id)) == done.request_counts.completed >= 5


def test_the_cli_submits_waits_downloads_and_lists(keyed, tmp_path):
    source = tmp_path / "input.jsonl"
    source.write_bytes(_lines(_prompts(6), 8))
    env = {**os.environ, API_KEY_ENV: KEY_B}
    cli = [*BATCHSTRING, "batches", "--url", f"http://{keyed.http_url}"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], env=env, capture_output=True, text=True, timeout=120)

    submitted = run("submit", str(source), "--wait", "--metadata", "team=search")
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.splitlines()[0]
    assert "completed 6/6 done, 0 failed" in submitted.stdout
    output = tmp_path / "output.jsonl"
    assert run("download", batch_id, "--output", str(output)).returncode == 0
    assert sorted(json.loads(line)["custom_id"] for line in output.read_text().splitlines()) == list("012345")
    assert not output.with_name("output.jsonl.errors.jsonl").exists()
    assert run("list").stdout.splitlines()[0].startswith(f"{batch_id} completed")
    assert f"{batch_id} completed" in run("status", batch_id).stdout
    refused = run("cancel", batch_id)
    assert refused.returncode == 1 and "only a validating or in_progress batch" in refused.stderr
    unknown = subprocess.run([*cli, "status", batch_id], env={**env, API_KEY_ENV: KEY_A}, capture_output=True,
                             text=True, timeout=60)
    assert unknown.returncode == 1 and "404: No batch found" in unknown.stderr


def test_sigkill_mid_batch_then_restart_completes_each_line_exactly_once(keyed):
    """Runs last in this module: it kills and restarts the module's server."""
    sdk = _sdk(keyed)
    prompts = _prompts(300)
    batch = _submit(sdk, _lines(prompts, 32, ignore_eos=True))
    _wait(sdk, batch.id, until=lambda b: b.request_counts.completed >= 20)
    keyed.stop(grace=0)  # SIGKILL to tritonserver's and the front door's process groups
    with sqlite3.connect(Path(keyed.data_dir) / "batchstring.db") as db:
        answered = db.execute("SELECT completed FROM batches WHERE id = ?", (batch.id,)).fetchone()[0]
    assert 20 <= answered < 300  # killed mid-way
    keyed.start()
    done = _wait(_sdk(keyed), batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (300, 0)
    lines = _output(_sdk(keyed), done.output_file_id)
    assert sorted(int(line["custom_id"]) for line in lines) == list(range(300))
    with BatchClient(keyed.grpc_url, api_key=KEY_A) as client:
        expected = client.batchstring(prompts, max_tokens=32, ignore_eos=True)
    assert all(line["response"]["body"]["choices"][0]["text"] == expected[int(line["custom_id"])] for line in lines)


def test_a_batch_past_its_window_expires_keeping_its_answers(keyed):
    """The window ends while the server is down: on restart the batch expires, the answered lines
    in its output file, the rest in its error file as batch_expired."""
    sdk = _sdk(keyed)
    batch = _submit(sdk, _lines(_prompts(300), 32, ignore_eos=True))
    _wait(sdk, batch.id, until=lambda b: b.request_counts.completed >= 10)
    keyed.stop(grace=0)
    with sqlite3.connect(Path(keyed.data_dir) / "batchstring.db") as db:
        db.execute("UPDATE batches SET expires_at = created_at WHERE id = ?", (batch.id,))
    keyed.start()
    done = _wait(_sdk(keyed), batch.id)
    assert done.status == "expired" and done.expired_at is not None
    answered, expired = _output(sdk, done.output_file_id), _output(sdk, done.error_file_id)
    assert 10 <= len(answered) == done.request_counts.completed < 300
    assert {e["error"]["code"] for e in expired} == {"batch_expired"} and len(expired) == done.request_counts.failed
    assert sorted(int(x["custom_id"]) for x in answered + expired) == list(range(300))
