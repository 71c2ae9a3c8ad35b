"""Locust smoke run against the session's server: real users, real HTTP, zero failures."""

from __future__ import annotations

import csv
import subprocess

from batchstring.loadtest.run_locust import read_summary
from tests.conftest import BATCHSTRING


def test_locust_smoke_run_has_requests_and_no_failures(server, tmp_path):
    out = tmp_path / "locust"
    result = subprocess.run(
        [*BATCHSTRING, "loadtest", "--http-url", server.http_url, "--duration", "12", "--users", "8",
         "--max-tokens", "8-24", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = read_summary(out / "locust_stats.csv")
    assert summary.requests > 0 and summary.failures == 0
    assert (out / "report.html").stat().st_size > 0
    with (out / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    # every user ran: Triton's generate route, the OpenAI API, and JSON schemas through the OpenAI API
    for kind in ("batchstring[", "openai[", "structured["):
        assert sum(int(r["Request Count"]) for name, r in rows.items() if name.startswith(kind)) > 0, kind
