"""Starts, probes and stops one local server: tritonserver on loopback-only internal ports, and the
front door (frontdoor/) that owns the public ports and bounds every request before Triton sees it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from batchstring.client.defaults import MODEL
from batchstring.export.layout import MODEL_VERSION_DIR, missing_artifacts
from batchstring.server.repository import ConfigEdit, write_overlay
from batchstring.server.triton import (
    DEFAULT_REPOSITORY,
    EXIT_TIMEOUT_SECS,
    TLS,
    Ports,
    ServerCommand,
    Sockets,
    TritonInstall,
)

STUB_NAME = "triton_python_backend_stub"


class ServerError(RuntimeError):
    pass


def free_ports(count: int = 3) -> list[int]:
    """Ports the OS says are free now (held open together so they are distinct)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalServer:
    """tritonserver and its front door as child processes. `config` is "cpu" or "gpu";
    `params`/`edit` make an overlay; `ports` and `host` are the front door's (public) ones."""

    config: str = "cpu"
    ports: Ports | None = None
    host: str = "127.0.0.1"
    repository: Path = DEFAULT_REPOSITORY
    params: dict[str, str] = field(default_factory=dict)
    edit: ConfigEdit | None = None
    tls: TLS | None = None
    ready_timeout: float = 180.0
    log_path: Path | None = None
    max_body_bytes: int | None = None  # front door limits (None: its defaults)
    max_message_bytes: int | None = None
    front_door_options: tuple[str, ...] = ()  # more `python -m batchstring.frontdoor` flags (OpenAI API, API keys)
    environment: dict[str, str] = field(default_factory=dict)  # more variables for tritonserver's environment
    data_dir: Path | None = None  # the Batch API's store (None: one under the temporary work directory)
    process: subprocess.Popen | None = field(default=None, init=False)
    front: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.config not in ("cpu", "gpu"):
            raise ValueError(f"config must be 'cpu' or 'gpu'; got {self.config!r}")
        self.ports = self.ports or Ports(*free_ports())
        self._workdir = Path(tempfile.mkdtemp(prefix="batchstring-server-"))
        self.sockets = Sockets(self._workdir / "triton")  # tritonserver's own endpoints, private
        self.log_path = self.log_path or self._workdir / "batchstring.server.log"

    # ----- addresses ---------------------------------------------------------------------------

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.ports.metrics}/metrics"


    # ----- lifecycle ---------------------------------------------------------------------------

    def command(self, install: TritonInstall) -> ServerCommand:
        config_name = "cpu" if self.config == "cpu" else None
        repository = self.repository
        if self.params or self.edit:
            overlay = self._workdir / "repository"
            if not overlay.exists():
                write_overlay(overlay, self.repository, config_name, self.params, self.edit)
            repository, config_name = overlay, None
        return ServerCommand(repository=repository, backend_dir=install.make_backend_dir(self._workdir),
                             sockets=self.sockets, config_name=config_name)

    def front_door_command(self) -> list[str]:
        argv = [sys.executable, "-m", "batchstring.frontdoor", "--host", self.host, "--http-port", str(self.ports.http),
                "--grpc-port", str(self.ports.grpc), "--metrics-port", str(self.ports.metrics),
                "--triton-http", str(self.sockets.http), "--triton-grpc", self.sockets.grpc_target,
                "--triton-metrics", str(self.sockets.metrics), "--triton-pid", str(self.process.pid),
                "--model-dir", str(self.repository / MODEL / MODEL_VERSION_DIR.name),
                "--data-dir", str(self.data_dir or self._workdir / "data"), *self.front_door_options]
        if self.tls:
            argv += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-message-bytes", self.max_message_bytes)):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def start(self) -> LocalServer:
        missing = missing_artifacts(self.repository / MODEL / MODEL_VERSION_DIR.name)
        if missing:
            raise ServerError(f"model files missing from the repository ({', '.join(missing)}); "
                              "run `batchstring export` first")
        install = TritonInstall.find()
        self.sockets.prepare()
        self.process = self._spawn(self.command(install).argv(install.binary),
                                   {**install.environment(), **self.environment})
        _terminate(self.front, 5)  # the front door watches this tritonserver's process: a new one for it
        self.start_front_door()
        try:
            self.wait_ready()
        except ServerError:
            self.stop(grace=0)  # the error carries the log tail; leave no process behind
            raise
        return self

    def start_front_door(self) -> None:
        self.front = self._spawn(self.front_door_command(), dict(os.environ))

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}")
            if self.front.poll() is not None:
                raise ServerError(f"the front door exited with code {self.front.returncode}:\n{self.log_tail()}")
            if self.model_ready():
                return
            time.sleep(0.2)
        raise ServerError(f"model not ready after {self.ready_timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, grace: float = EXIT_TIMEOUT_SECS + 5) -> None:
        """SIGTERM (Triton drains in-flight requests, their responses still flow through the front
        door), then SIGKILL each process group after `grace` s; the front door goes last."""
        proc, self.process = self.process, None
        _terminate(proc, grace)
        front, self.front = self.front, None
        _terminate(front, min(grace, 5))

    def restart_front_door(self) -> None:
        _terminate(self.front, 5)
        self.start_front_door()

    def restart(self, grace: float = EXIT_TIMEOUT_SECS + 5) -> None:
        self.stop(grace)
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- probes ------------------------------------------------------------------------------

    def model_ready(self, timeout: float = 1.0) -> bool:
        """`/v2/models/llm/ready`: unlike `/v2/health/ready` it goes false when the model is down."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/models/{MODEL}/ready", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stub_processes(self) -> list[psutil.Process]:
        """The Python backend's stub processes (one per model instance)."""
        if self.process is None:
            return []
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if _is_stub(c)]

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _terminate(proc: subprocess.Popen | None, grace: float) -> None:
    if proc is None:
        return
    if proc.poll() is None and grace > 0:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stubs share the group; none may outlive the server
    proc.wait()


def _is_stub(proc: psutil.Process) -> bool:
    try:
        return STUB_NAME in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
