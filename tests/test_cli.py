"""The `batchstring` command line: run, serve's clear refusals. (Serve's start, stop and what it
leaves behind: tests/test_lifecycle.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.conftest import BATCHSTRING


def test_run_prints_completions(server, client):
    expected = client.batchstring(["def ", "import os\n"], max_tokens=8)
    out = subprocess.run([*BATCHSTRING, "run", "--url", server.grpc_url, "--max-tokens", "8", "--json",
                          "def ", "import os\n"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == expected
    plain = subprocess.run([*BATCHSTRING, "run", "--url", server.grpc_url, "--max-tokens", "8", "def "],
                           capture_output=True, text=True, timeout=60)
    assert plain.returncode == 0 and ("def " + expected[0]) in plain.stdout


def test_run_reports_item_errors_and_exits_nonzero(server):
    out = subprocess.run([*BATCHSTRING, "run", "--url", server.grpc_url, "--max-tokens", "9999", "def "],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert "max_tokens" in out.stdout + out.stderr


def test_serve_without_exported_files_says_to_export(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(Path("model_repository"), repo,
                    ignore=shutil.ignore_patterns("*.onnx", "*.pt", "runtime.json", "tokenizer.json"))
    out = subprocess.run([*BATCHSTRING, "serve", "--repository", str(repo)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "batchstring export" in out.stderr


def test_serve_refuses_an_unknown_parameter(model_dir):
    out = subprocess.run([*BATCHSTRING, "serve", "--param", "max_num_sequences=4"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "unknown parameter" in out.stderr and "max_num_seqs" in out.stderr


def test_serve_refuses_a_negative_drain_deadline():
    out = subprocess.run([*BATCHSTRING, "serve", "--drain-seconds", "-1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "--drain-seconds must be 0 or more; got -1" in out.stderr


def test_peer_bench_caches_prompts_on_both_sides_or_neither(tmp_path):
    """peer-bench replays its prompts (first calls, repeats), which llama-server is told not to
    cache: our server's prefix cache is off too, and its metrics say it reused nothing; with
    `--prefix-caching` it reuses them (the count is real); the engine parameter alone, which
    would cache on one side only, is refused."""
    def bench(*extra: str) -> dict:
        out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run = subprocess.run([*BATCHSTRING, "peer-bench", "--systems", "batchstring", "--callers", "1",
                              "--prompts", "3", "--max-tokens", "4", "--repeats", "2", "--out", str(out), *extra],
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
        return json.loads((out / "peer.json").read_text())["meta"]

    off, on = bench(), bench("--prefix-caching")
    assert (off["prefix_caching"], off["our_prefix_cache"]["prompt_tokens_reused"]) == (False, 0)
    assert on["prefix_caching"] and on["our_prefix_cache"]["prompt_tokens_reused"] > 0
    assert "--prefix-caching" in on["command"] and "--prefix-caching" not in off["command"]
    refused = subprocess.run([*BATCHSTRING, "peer-bench", "--systems", "batchstring", "--param",
                              "enable_prefix_caching=true", "--out", str(tmp_path / "refused")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--prefix-caching" in refused.stderr
