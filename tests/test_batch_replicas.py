"""The Batch API behind a balancer: two replicas sharing one PostgreSQL store.

A real PostgreSQL server (the machine's initdb and pg_ctl, loopback, trust) and two real
batchstring servers (tritonserver and the front door each) that keep their batches and files in
it, behind one address (a round-robin TCP balancer started here, one connection per call, as a
Kubernetes Service balances). Every call of the official `openai` SDK goes through that address,
so consecutive calls land on different replicas. The replica whose runner holds a chunk is
SIGKILLed mid-batch; the other takes its chunks over once their leases lapse and finishes the
batch, every custom_id answered exactly once and equal to a direct completion of its prompt.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import openai
import psycopg
import pytest

from batchstring.client import BatchClient
from batchstring.frontdoor.batch_api.store import open_store
from batchstring.frontdoor.gateway.auth import ENV
from batchstring.loadtest.balancer import RoundRobin
from batchstring.loadtest.postgres import PostgresServer
from tests.conftest import start_server
from tests.test_batches import _wait

KEY_A, KEY_B = "sk-replica-a-0123456789", "sk-replica-b-0123456789"
LEASE = "3"


@pytest.fixture(scope="module")
def postgres():
    with PostgresServer() as server:
        yield server


@pytest.fixture
def own_database(postgres) -> str:
    """A database of its own on the shared server, for the store's tests: the replicas' runners
    (alive for the whole module) claim and finish whatever batch they find in theirs."""
    name = f"stores_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres.url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    parts = urlsplit(postgres.url)
    return urlunsplit(parts._replace(path=f"/{name}"))


@pytest.fixture(scope="module")
def replicas(request, model_dir, postgres, tmp_path_factory):
    previous = os.environ.get(ENV)
    os.environ[ENV] = f"{KEY_A},{KEY_B}"
    try:
        servers = [start_server(request, f"replica-{i}", config="cpu", data_dir=tmp_path_factory.mktemp(f"replica-{i}"),
                                front_door_options=("--batch-store", postgres.url, "--batch-lease-seconds", LEASE,
                                                    "--batch-chunk-lines", "20"))
                   for i in range(2)]
    finally:
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous
    balancer = RoundRobin([(s.host, s.ports.http) for s in servers]).start()
    request.addfinalizer(balancer.stop)
    return servers, balancer


def _sdk(balancer: RoundRobin, key: str = KEY_A) -> openai.OpenAI:
    """A new connection per call (`Connection: close`), so that the balancer spreads consecutive calls."""
    return openai.OpenAI(base_url=f"http://{balancer.address}/v1", api_key=key, max_retries=3,
                         default_headers={"Connection": "close"})


def _prompts(count: int) -> list[str]:
    return [f"def replica_task_{i}(rows):\n    " for i in range(count)]


def _lines(prompts: list[str], max_tokens: int) -> bytes:
    return "".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                               "body": {"model": "llm", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                                        "ignore_eos": True}}) + "\n" for i, p in enumerate(prompts)).encode()


def _holders(url: str, batch_id: str) -> set[str]:
    with psycopg.connect(url) as db:
        rows = db.execute("SELECT owner FROM chunks WHERE batch_id = %s AND owner IS NOT NULL AND done = 0",
                          (batch_id,)).fetchall()
    return {row[0] for row in rows}


def test_every_batch_api_call_works_through_the_balancer_and_a_killed_replicas_work_is_finished(replicas, postgres):
    servers, balancer = replicas
    sdk = _sdk(balancer)
    prompts = _prompts(120)
    uploaded = sdk.files.create(file=("input.jsonl", _lines(prompts, 24)), purpose="batch")
    assert sdk.files.retrieve(uploaded.id).bytes == len(_lines(prompts, 24))  # a file stored by one, read by another
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    seen = {sdk.batches.retrieve(batch.id).id for _ in range(4)}
    assert seen == {batch.id} and len(balancer.served) == 2, "calls reached both replicas, each knew the batch"
    _wait(sdk, batch.id, until=lambda b: b.request_counts.completed >= 25)
    holders = set()
    deadline = time.monotonic() + 30
    while not holders and time.monotonic() < deadline:
        holders = _holders(postgres.url, batch.id)
        time.sleep(0.05)
    victim = next(s for s in servers if any(f"-{s.front.pid}-" in h for h in holders))
    victim.stop(grace=0)  # SIGKILL: tritonserver's and the front door's process groups
    done = _wait(sdk, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (120, 120, 0)
    lines = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
    assert sorted(int(line["custom_id"]) for line in lines) == list(range(120)), "each line answered exactly once"
    survivor = next(s for s in servers if s is not victim)
    with BatchClient(survivor.grpc_url, api_key=KEY_A) as client:
        expected = client.batchstring(prompts, max_tokens=24, ignore_eos=True)
    assert all(line["response"]["body"]["choices"][0]["text"] == expected[int(line["custom_id"])] for line in lines)
    other = _sdk(balancer, KEY_B)
    for call in (lambda: other.batches.retrieve(batch.id), lambda: other.files.retrieve(uploaded.id),
                 lambda: other.files.content(done.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_two_stores_on_one_database_lease_each_chunk_to_one_and_end_a_batch_once(own_database, tmp_path):
    """The store's promises without servers: a chunk is leased to one replica at a time, a lapsed
    lease passes to another, an answer is recorded once, and a batch ends once."""
    first, second = (open_store(own_database, tmp_path / name) for name in ("a", "b"))
    source = tmp_path / "input.jsonl"
    source.write_bytes(_lines(_prompts(4), 2))
    file_id = first.add_file("tenant", "input.jsonl", "batch", source)["id"]
    batch = second.add_batch("tenant", "/v1/completions", file_id, "24h", 86400, None)
    assert first.claim_validation("A", 5)["id"] == batch["id"] and second.claim_validation("B", 5) is None
    assert not second.start(batch["id"], "B", 4, [(1, 0, 2), (3, 200, 2)]), "only the validation's holder starts it"
    assert first.start(batch["id"], "A", 4, [(1, 0, 2), (3, 200, 2)])
    mine, theirs = first.claim_chunk("A", 0.5), second.claim_chunk("B", 0.5)
    assert {mine.chunk, theirs.chunk} == {0, 1} and first.claim_chunk("A", 0.5) is None
    time.sleep(0.6)  # A's lease lapses without a renewal
    assert second.claim_chunk("B", 5).chunk in (0, 1) and first.renew("A", 5, [(mine.batch_id, mine.chunk)]) == {}
    assert first.record(batch["id"], [(1, True, '"a"'), (2, True, '"a"')]) == 2
    assert second.record(batch["id"], [(1, True, '"b"'), (3, True, '"b"'), (4, False, '"b"')]) == 2
    first.db.execute("UPDATE chunks SET done = 1, owner = NULL")
    assert first.finalizable() == [(batch["id"], "completed")]
    assert second.finish(batch["id"], "completed") and not first.finish(batch["id"], "completed")
    row = first.batch_row(batch["id"])
    assert (row["status"], row["completed"], row["failed"]) == ("completed", 3, 1)
    with first.open_file(row["output_file_id"]) as f:
        assert f.read().decode().splitlines() == ['"a"', '"a"', '"b"']
    assert first.record(batch["id"], [(5, True, "{}")]) == 0, "an ended batch takes no answer"
    assert Path(tmp_path / "a" / "files").exists() is False, "contents live in the database, not on a replica"


def test_a_store_url_with_a_password_stays_off_the_command_line(monkeypatch):
    from batchstring.frontdoor.batch_api.store import STORE_ENV, store_url

    with pytest.raises(SystemExit, match=f"carries a password.*{STORE_ENV}"):
        store_url("postgresql://batchstring:hunter2@db:5432/batchstring")
    assert store_url("postgresql://batchstring@db:5432/batchstring") == "postgresql://batchstring@db:5432/batchstring"
    monkeypatch.setenv(STORE_ENV, "postgresql://batchstring:from-a-secret@db/batchstring")
    assert store_url(None).endswith("from-a-secret@db/batchstring"), "the environment may carry one"
    monkeypatch.delenv(STORE_ENV)
    assert store_url(None) is None, "no URL: SQLite in the data directory"


def test_a_replica_stopped_in_order_hands_its_chunks_over_at_once(own_database, tmp_path):
    first, second = (open_store(own_database, tmp_path / name) for name in ("a", "b"))
    source = tmp_path / "input.jsonl"
    source.write_bytes(_lines(_prompts(4), 2))
    batch = first.add_batch("tenant", "/v1/completions", first.add_file("tenant", "in.jsonl", "batch", source)["id"],
                            "24h", 86400, None)
    assert first.claim_validation("A", 60)["id"] == batch["id"]
    assert first.start(batch["id"], "A", 4, [(1, 0, 2), (3, 200, 2)])
    held = first.claim_chunk("A", 60)
    assert second.claim_chunk("B", 60).chunk != held.chunk and second.claim_chunk("B", 60) is None
    first.release("A")  # what a SIGTERM, a scale-down or a rolling update does through BatchRunner.close
    assert second.claim_chunk("B", 60) == held, "taken over at once, not after the 60 s lease"
