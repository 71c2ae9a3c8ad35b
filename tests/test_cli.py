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
