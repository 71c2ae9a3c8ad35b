"""Starts, probes and stops one local server: tritonserver on loopback-only internal ports, and the
front door (frontdoor/) that owns the public ports and bounds every request before Triton sees it.

Lifecycle: nothing outlives this process. Each child gets a parent-death signal (SIGKILL from the
kernel when this process ends, however it ends: SIGKILL and the OOM killer included) and the model
process exits by itself when its tritonserver is gone (model.py). A stop drains the front door
first, then stops tritonserver, which then has no connection and no request to wait for.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from batchstring.client.defaults import MODEL
from batchstring.export.layout import MODEL_VERSION_DIR, missing_artifacts
from batchstring.server.repository import ConfigEdit, load_config, parameters, write_overlay
from batchstring.server.triton import (
    DEFAULT_REPOSITORY,
    TLS,
    Ports,
    ServerCommand,
    Sockets,
    TritonInstall,
)

STUB_NAME = "triton_python_backend_stub"
DRAIN_SECONDS = 5.0  # the front door's default (frontdoor/gateway/main.py)
STOP_SECONDS = 3.0  # what a drained front door needs to close and exit
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
# Triton's Python backend makes this directory when it loads and removes it only in an orderly
# exit, which `stop` skips (tritonserver is killed: it holds nothing by then). The path is fixed in
# the backend (`/tmp`, whatever TMPDIR says); ours is the one that appeared while it started (one
# another server made meanwhile may be taken for ours: only an empty one is removed, and an empty
# one is used only for execution environments, which this model has none of).
BACKEND_SCRATCH = (Path("/tmp"), "python_env_*")
# The kernel sends the parent-death signal when the *thread* that forked the child ends, not the
# process: every child is forked from this one thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchstring-spawner")


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
    drain_seconds: float = DRAIN_SECONDS  # on stop, how long admitted requests may run on
    process: subprocess.Popen | None = field(default=None, init=False)
    front: subprocess.Popen | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.config not in ("cpu", "gpu"):
            raise ValueError(f"config must be 'cpu' or 'gpu'; got {self.config!r}")
        self.ports = self.ports or Ports(*free_ports())
        self._workdir = Path(tempfile.mkdtemp(prefix="batchstring-server-"))
        self.sockets = Sockets(self._workdir / "triton")  # tritonserver's own endpoints, private
        self._backend_scratch: set[Path] = set()
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
                "--data-dir", str(self.data_dir or self._workdir / "data"),
                "--drain-seconds", str(self.drain_seconds), *self.front_door_options]
        if self.tls:
            argv += ["--tls-cert", str(self.tls.cert), "--tls-key", str(self.tls.key)]
        for flag, param in (("--adapters", "adapters"), ("--adapter-dir", "adapter_dir")):  # /v1 names them
            if self.params.get(param):
                argv += [flag, self.params[param]]
        for flag, value in (("--max-body-bytes", self.max_body_bytes), ("--max-message-bytes", self.max_message_bytes)):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    def start(self) -> LocalServer:
        config = load_config(self.repository, "cpu" if self.config == "cpu" else None)
        runtime = self.params.get("runtime") or parameters(config).get("runtime")
        missing = missing_artifacts(self.repository / MODEL / MODEL_VERSION_DIR.name, runtime)
        if missing:
            raise ServerError(f"model files missing from the repository ({', '.join(missing)}) for runtime "
                              f"{runtime}; run `batchstring export` first (a quantized export holds model.onnx "
                              "only: serve it with runtime onnxruntime)")
        install = TritonInstall.find()
        self.clear_leftovers()
        self.sockets.prepare()
        before = _backend_scratch()
        self.process = self._spawn(self.command(install).argv(install.binary),
                                   {**install.environment(), **self.environment})
        _terminate(self.front, 5)  # the front door watches this tritonserver's process: a new one for it
        self.start_front_door()
        try:
            self.wait_ready()
        except ServerError:
            self._backend_scratch |= _backend_scratch() - before
            self.stop(grace=0)  # the error carries the log tail; leave no process behind
            raise
        self._backend_scratch |= _backend_scratch() - before
        return self

    def start_front_door(self) -> None:
        self.front = self._spawn(self.front_door_command(), dict(os.environ))

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            return _SPAWNER.submit(subprocess.Popen, argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=_die_with(os.getpid())).result()

    def clear_leftovers(self, wait: float = 5.0) -> None:
        """Restart hygiene: a model process of an earlier tritonserver on this repository that is
        still alive holds its memory (on a GPU, device memory that `kv_cache_tokens: auto` would
        size the new cache around) and may hold its files. Say so, give it `wait` s, then kill it."""
        left = leftover_stubs((self.repository, self._workdir))
        if not left:
            return
        print(f"batchstring: the model process of a tritonserver that is gone still runs (pid "
              f"{', '.join(str(p.pid) for p in left)}) and holds its memory; waiting up to {wait:g} s for it "
              "to exit, then killing it, before a new server sizes its cache", file=sys.stderr, flush=True)
        _, alive = psutil.wait_procs(left, timeout=wait)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)

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

    def stop(self, grace: float = STOP_SECONDS) -> None:
        """The front door first: on SIGTERM it drains (readiness off, new requests refused with a
        retryable UNAVAILABLE, admitted ones finish within `drain_seconds`), closes its
        connections to Triton and exits; `grace` s more, then SIGKILL (`grace=0`: at once, for a
        dead model, where nothing would finish). Then tritonserver and its model process, as a
        process group, with SIGKILL: they hold no request and no connection any more, and keep
        nothing worth saving (the cache is rebuilt at start), while Triton's own orderly exit
        takes 2.4-2.8 s here (a 1 s wait inside the Python backend's unload, then a 1 s poll)."""
        front, self.front = self.front, None
        _terminate(front, self.drain_seconds + grace if grace > 0 else 0)
        proc, self.process = self.process, None
        _terminate(proc, 0)
        for left in self._backend_scratch:  # empty unless a model used an execution environment
            with contextlib.suppress(OSError):
                left.rmdir()
        self._backend_scratch.clear()

    def restart_front_door(self) -> None:
        _terminate(self.front, 5)
        self.start_front_door()

    def restart(self, grace: float = STOP_SECONDS) -> None:
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


def _backend_scratch() -> set[Path]:
    directory, pattern = BACKEND_SCRATCH
    return set(directory.glob(pattern))


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


def _die_with(parent: int):
    """A preexec function: the child gets SIGKILL when `parent` ends (or at once, if it already has)."""
    def arm() -> None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def leftover_stubs(places: tuple[Path, ...]) -> list[psutil.Process]:
    """Model processes whose tritonserver is gone (their parent is no longer the one that started
    them) and whose model lies under one of `places`."""
    prefixes = tuple(str(p) for p in places)
    found = []
    for proc in psutil.process_iter(["cmdline", "ppid", "status"]):
        argv = proc.info["cmdline"] or []
        if (len(argv) > 5 and argv[0].endswith(STUB_NAME) and argv[1].startswith(prefixes) and argv[5].isdigit()
                and int(argv[5]) != proc.info["ppid"] and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(proc)
    return found


def _is_stub(proc: psutil.Process) -> bool:
    try:
        return STUB_NAME in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
