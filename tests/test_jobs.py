"""`batchstring run --input/--output`: a job over a file, through a real server, killed and resumed.

The reference for every output is the same prompt sent through `batchstring()` on its own:
greedy decoding is batch-invariant, so a job's answers must equal it exactly.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchstring.client.jobs import Item, Malformed, _cut_partial_line, check_file, done_ids, id_hash, output_line
from batchstring.client.protocol import Completion

BATCHSTRING = str(Path(sys.executable).parent / "batchstring")
PROMPTS = [f"def handler_{i}(event):\n    " for i in range(40)]
MAX_TOKENS = 6


def write_jobs(path: Path, n: int) -> None:
    with path.open("w") as f:
        for i in range(n):
            body = {"model": "llm", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0}
            f.write(json.dumps({"custom_id": f"job-{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


def run_cli(server, source: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([BATCHSTRING, "run", "--url", server.grpc_url, "--input", str(source),
                           "--output", str(output), *extra], capture_output=True, text=True, timeout=300)


def read_output(path: Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "no custom_id twice"
    return by_id


def test_a_killed_job_resumes_and_ends_with_every_id_once_and_correct(server, client, tmp_path):
    source, output = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    write_jobs(source, 5000)
    job = subprocess.Popen([BATCHSTRING, "run", "--url", server.grpc_url, "--input", str(source),
                            "--output", str(output)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (not output.exists() or output.stat().st_size < 400_000) and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    written = output.read_bytes().count(b"\n")
    assert 0 < written < 5000, "killed part-way"
    with output.open("ab") as f:  # what a kill in the middle of a write leaves
        f.write(b'{"id": "batch_req_x", "custom_id": "job-')

    resumed = run_cli(server, source, output)
    assert resumed.returncode == 0, resumed.stderr
    assert f"{written} already done" in resumed.stderr
    lines = read_output(output)
    assert sorted(lines) == sorted(f"job-{i}" for i in range(5000))
    reference = dict(zip(PROMPTS, client.batchstring(PROMPTS, max_tokens=MAX_TOKENS)))
    for i in range(5000):
        response = lines[f"job-{i}"]["response"]
        assert response["status_code"] == 200
        choice = response["body"]["choices"][0]
        assert choice["text"] == reference[PROMPTS[i % len(PROMPTS)]], i
        assert choice["finish_reason"] == "length" and response["body"]["usage"]["completion_tokens"] == MAX_TOKENS


def test_malformed_lines_are_named_and_nothing_runs_until_told_to_skip_them(server, tmp_path):
    source, output = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "def f():"}}
    source.write_text("\n".join([
        json.dumps(good),
        "{not json",
        json.dumps({**good, "custom_id": "b", "body": {"prompt": ["two", "prompts"]}}),
        json.dumps({**good, "custom_id": "c", "url": "/v1/embeddings"}),
        json.dumps(good),  # repeats line 1's id
        json.dumps({**good, "custom_id": "d", "body": {"prompt": "x", "max_tokens": 100000}}),  # the server's call
    ]) + "\n")
    refused = run_cli(server, source, output)
    assert refused.returncode != 0 and not output.exists()
    for line, reason in ((2, "not valid JSON"), (3, "prompt is a string"), (4, "/v1/embeddings"),
                         (5, "repeats line 1")):
        assert f"line {line}: " in refused.stderr and reason in refused.stderr, (line, refused.stderr)
    ran = run_cli(server, source, output, "--skip-malformed", "--max-tokens", "4")
    assert ran.returncode == 1, "an item failed (d's max_tokens), so the job says so"
    lines = read_output(output)
    assert set(lines) == {"a", "d"}
    assert lines["a"]["response"]["status_code"] == 200
    failed = lines["d"]["response"]
    assert failed["status_code"] == 400 and "max_tokens" in failed["body"]["error"]["message"]
    assert "1 x 400 invalid_value" in ran.stderr

    rerun = run_cli(server, source, output, "--skip-malformed", "--retry-failed")
    assert "1 already done" in rerun.stderr and set(read_output(output)) == {"a", "d"}


def test_plain_text_lines_are_prompts_and_their_line_numbers_are_ids(server, client, tmp_path):
    source, output = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    source.write_text("\n".join(PROMPTS[:5]).replace("\n    ", " ") + "\n")
    done = run_cli(server, source, output, "--max-tokens", "5")
    assert done.returncode == 0, done.stderr
    lines = read_output(output)
    prompts = source.read_text().splitlines()
    expected = client.batchstring(prompts, max_tokens=5)
    assert {k: v["response"]["body"]["choices"][0]["text"] for k, v in lines.items()} == \
        {str(i + 1): text for i, text in enumerate(expected)}


# ----- the file handling on its own ------------------------------------------------------------


def test_a_partial_last_line_is_cut_back_to_the_last_newline(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n{"c": ' + b"x" * 100_000)
    _cut_partial_line(path)
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    path.write_bytes(b"no newline at all")
    _cut_partial_line(path)
    assert path.read_bytes() == b""


def test_done_ids_keep_successes_and_optionally_drop_failures(tmp_path):
    path = tmp_path / "out.jsonl"
    item = Item(1, "ok-1", "p", {})
    lines = [output_line(item, Completion("t", "stop", 1, 1), "llm"),
             output_line(Item(2, "bad-2", "p", {}), ValueError("no"), "llm")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert set(done_ids(path, retry_failed=False)) == {id_hash("ok-1"), id_hash("bad-2")}
    assert set(done_ids(path, retry_failed=True)) == {id_hash("ok-1")}
    assert [json.loads(x)["custom_id"] for x in path.read_text().splitlines()] == ["ok-1"]
    path.write_text("not an output line\n")
    with pytest.raises(SystemExit, match="line 1 is not an output line"):
        done_ids(path, retry_failed=False)


def test_check_file_counts_items_and_finds_every_repeat(tmp_path):
    path = tmp_path / "in.jsonl"
    ids = ["a", "b", "a", "c", "b", "a"]
    path.write_text("".join(json.dumps({"custom_id": i, "body": {"prompt": "x"}}) + "\n" for i in ids))
    count, malformed = check_file(path, {}, jsonl=True)
    assert count == 3
    assert [(m.line, str(m)) for m in malformed] == [
        (3, "line 3: custom_id repeats line 1's"), (5, "line 5: custom_id repeats line 2's"),
        (6, "line 6: custom_id repeats line 3's")]
    assert all(isinstance(m, Malformed) for m in malformed)
