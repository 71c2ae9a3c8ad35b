"""Shared fixtures: the exported default model, in-process engines, and real tritonservers; and
the suite's last check, that no process a test started is still alive."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from batchstring.export.layout import MODEL_VERSION_DIR, missing_artifacts

# The command lines tests run, from this checkout (no install needed for these)
BATCHSTRING = [sys.executable, "-m", "batchstring.cli"]
FRONTDOOR = [sys.executable, "-m", "batchstring.frontdoor"]

LOG_DIR = Path(__file__).parent / "logs"
FAULT_MARKER = "<<poison>>"
PR_SET_CHILD_SUBREAPER = 36
STOP_BOUND = 3.0  # seconds from SIGTERM to a server's exit, beyond its drain
GONE_BOUND = 5.0  # seconds for every process of a killed parent to end


def pytest_sessionstart(session: pytest.Session) -> None:
    """Makes this process the reaper of every orphan below it: a process a test started stays
    this session's descendant even after its parent died, so the check at the end sees it."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run if a process started during it is still alive (after a short grace), and
    lists and kills what is left, so that nothing outlives the suite."""
    survivors = descendants_after(GONE_BOUND)
    if not survivors:
        return
    lines = [f"{len(survivors)} processes started by the tests are still alive {GONE_BOUND:g} s after the "
             "last test (killed now):"]
    for proc in survivors:
        with contextlib.suppress(psutil.Error):
            lines.append(f"  pid {proc.pid}: {' '.join(proc.cmdline())[:200]}")
            proc.kill()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        print("\n".join(lines), file=sys.stderr)
    else:
        reporter.write("\n")
        reporter.write_sep("=", "processes left behind", red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def kinds(processes: list[psutil.Process]) -> dict[str, psutil.Process]:
    """The server's processes by what they are: front door, tritonserver, model (the stub)."""
    from batchstring.server.local import STUB_NAME

    found = {}
    for proc in processes:
        command = " ".join(proc.cmdline())
        if "batchstring.frontdoor" in command:
            found["front door"] = proc
        elif STUB_NAME in command:
            found["model"] = proc
        elif "tritonserver" in proc.name():
            found["tritonserver"] = proc
    return found


def alive(processes) -> list[psutil.Process]:
    result = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                result.append(proc)
        except psutil.NoSuchProcess:
            continue
    return result


def temporary_files() -> set[Path]:
    """What a server may leave in /tmp: its work directory and the Python backend's scratch one."""
    return {*Path("/tmp").glob("batchstring-server-*"), *Path("/tmp").glob("python_env_*")}


def gone_within(processes, seconds: float) -> list[psutil.Process]:
    """The processes still alive after `seconds` (none, as soon as they are all gone)."""
    deadline = time.monotonic() + seconds
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(processes)


def assert_kill_leaves_nothing(parent, processes: list[psutil.Process], ports: list[int], what: str) -> None:
    """SIGKILL of `parent` (what Docker, Kubernetes and the OOM killer do when their patience ends):
    within GONE_BOUND s none of its processes is alive and its ports can be bound again."""
    import socket

    parent.kill()
    parent.wait()
    left = gone_within(processes, GONE_BOUND)
    assert left == [], f"still alive {GONE_BOUND:g} s after the {what}: {[p.cmdline()[:3] for p in left]}"
    for port in ports:
        with socket.socket() as s:  # as the next server binds it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def descendants_after(grace: float) -> list[psutil.Process]:
    """This process's live descendants once `grace` s have passed or none is left; zombies
    (processes that ended, re-parented here) are reaped on the way."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
                elif proc.ppid() == os.getpid():
                    os.waitpid(proc.pid, os.WNOHANG)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


Recipe = Callable[[Path], list[str]]  # makes an export's inputs in a directory; returns the command that exports them
RECIPES: dict[str, tuple[Recipe, str, dict]] = {}


def export_recipe(name: str, recipe: Recipe, **params) -> None:
    """Registers an export the recipe's module reads (made by the `exports` fixture), needed when a
    selected test of that module runs with `params` among its parameters (none given: any test)."""
    RECIPES[name] = (recipe, recipe.__module__, params)


@pytest.fixture(scope="session")
def exports(request, tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (its directory, the export command's result) for every registered export a selected
    test needs, all made when the first is asked for, two at a time: an export traces in
    single-threaded Python for most of its time, and two tiny families' exports side by side took
    86 s on CI's two cores where one after the other took 131 s (four at once: 207 s)."""
    selected = [(item.module.__name__, item.callspec.params if hasattr(item, "callspec") else {})
                for item in request.session.items]
    wanted = [name for name, (_, module, needs) in RECIPES.items()
              if any(at == module and needs.items() <= params.items() for at, params in selected)]
    roots = {name: tmp_path_factory.mktemp(name) for name in wanted}
    commands = {name: RECIPES[name][0](roots[name]) for name in wanted}
    with ThreadPoolExecutor(max_workers=2) as pool:
        running = {name: pool.submit(subprocess.run, argv, capture_output=True, text=True, timeout=600)
                   for name, argv in commands.items()}
        return {name: (roots[name], done.result()) for name, done in running.items()}


def made(exports: dict, name: str) -> tuple[Path, str]:
    """Export `name`'s directory and what its command printed, once it is known to have succeeded."""
    root, result = exports[name]
    assert result.returncode == 0, result.stdout + result.stderr
    return root, result.stdout


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


def serve(tmp_path: Path, *options: str) -> tuple[subprocess.Popen, list[int], str]:
    """`batchstring serve` on free ports, once it says it is ready: (process, ports, its banner)."""
    from batchstring.server.local import free_ports

    ports = free_ports()
    proc = subprocess.Popen([*BATCHSTRING, "serve", "--config", "cpu", "--log", str(tmp_path / "serve.log"),
                             *(f"--{name}-port={port}" for name, port in zip(("http", "grpc", "metrics"), ports)),
                             *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, ports, proc.stdout.readline()


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
