"""Shared fixtures: the exported default model, in-process engines, and real tritonservers."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchstring.export.layout import MODEL_VERSION_DIR, missing_artifacts

# The command lines tests run, from this checkout (no install needed for these)
BATCHSTRING = [sys.executable, "-m", "batchstring.cli"]
FRONTDOOR = [sys.executable, "-m", "batchstring.frontdoor"]

LOG_DIR = Path(__file__).parent / "logs"
FAULT_MARKER = "<<poison>>"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The exported default model (`make test` exports it first; exported here if missing)."""
    if missing_artifacts(MODEL_VERSION_DIR):
        from batchstring.export.exporter import export_model

        export_model()
    return MODEL_VERSION_DIR


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item.session.batchstring_failed = True
    return report


def start_server(request: pytest.FixtureRequest, name: str, **kwargs):
    """A LocalServer whose log is kept under tests/logs/ if anything in the session failed."""
    from batchstring.server.local import LocalServer

    server = LocalServer(**kwargs).start()

    def keep_log() -> None:
        if getattr(request.session, "batchstring_failed", False) and server.log_path.exists():
            LOG_DIR.mkdir(exist_ok=True)
            shutil.copyfile(server.log_path, LOG_DIR / f"{name}.log")
        # Nothing is left to drain after the tests; tritonserver can wait out its whole exit timeout
        # for streams that clients cancelled, which only costs the suite time here.
        server.stop(grace=3)
        server.close()

    request.addfinalizer(keep_log)
    return server


def metric_reaches(metrics_url: str, name: str, minimum: float, timeout: float = 10.0) -> float:
    """The engine publishes metrics twice a second: poll until `name` >= minimum (or time out)."""
    import time

    from batchstring.server.stats import metrics

    deadline = time.monotonic() + timeout
    while True:
        value = metrics(metrics_url).get(name, 0.0)
        if value >= minimum or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


def staggered(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt as its own greedy call (EOS ignored), joining the running batch at different
    moments: what batch invariance is checked against."""
    import asyncio

    from batchstring.client import AsyncBatchClient

    async def run() -> list[str]:
        async with AsyncBatchClient(url) as aio:
            async def one(i: int, prompt: str) -> str:
                await asyncio.sleep(0.01 * (i % 10))  # join at different positions
                return (await aio.batchstring([prompt], max_tokens=max_tokens, ignore_eos=True))[0]

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(run())


@pytest.fixture(scope="session")
def server(request, model_dir):
    """The CPU config as shipped, plus the test-only fault marker."""
    return start_server(request, "cpu", config="cpu", params={"fault_marker": FAULT_MARKER})


@pytest.fixture(scope="session")
def client(server) -> Iterator:
    from batchstring.client import BatchClient

    with BatchClient(server.grpc_url) as c:
        yield c
