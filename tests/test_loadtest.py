"""The load tools run for real: Locust against the session's server (real users, real HTTP, zero
failures), and the served sweep's servers (what they compute)."""

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


def test_the_served_sweep_computes_every_prompt_it_replays(monkeypatch):
    """`batchstring bench` replays its items (each level those of the levels before, each repeat
    its own) against HF generate and the ceiling, which compute them all: its servers run with
    their prefix cache off and find nothing cached on a second pass, by the server's own count.
    With the cache on (the shipped default) the same pass reuses them, so the count is real."""
    from batchstring.loadtest import bench
    from batchstring.loadtest.workload import mixed

    items = mixed(4, prompt_tokens=(40, 60), max_tokens=(4, 4), seed=3)

    def second_pass_hits() -> float:
        system = bench.Served("continuous", None)
        try:
            for _ in range(2):
                samples, _ = system.measure(items, 2)
                assert len(samples) == len(items)
            return system.extra["prefix_hit_tokens"]
        finally:
            system.close()

    assert second_pass_hits() == 0
    monkeypatch.setattr(bench, "NO_PREFIX_CACHE", {})
    assert second_pass_hits() > 0
