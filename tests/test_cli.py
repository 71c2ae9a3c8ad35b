"""The `batchstring` command line: run, serve (start, signal, clean stop), clear refusals."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from batchstring.server.local import free_ports
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


def test_serve_starts_prints_one_line_and_stops_cleanly_on_sigterm(model_dir):
    http, grpc, metrics = free_ports()
    proc = subprocess.Popen([*BATCHSTRING, "serve", "--config", "cpu", "--http-port", str(http),
                             "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "llm ready" in line and f"127.0.0.1:{grpc}" in line, line
        stubs = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "triton_python_backend_stub" in " ".join(c.cmdline())]
        assert len(stubs) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert not any(s.is_running() and s.status() != psutil.STATUS_ZOMBIE for s in stubs)
    finally:
        if proc.poll() is None:
            proc.kill()


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
