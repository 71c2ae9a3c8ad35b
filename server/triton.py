"""Finds the tritonserver binary shipped in the `nvidia-pytriton` wheel and builds its command line.

The wheel carries a real Triton 2.51 (the server in NGC 24.10) with the Python backend; only the
binary is used, not PyTriton's API. The Python backend wants a directory holding its library,
its utils module and the stub built for the running Python; the wheel keeps one stub per
Python version, so that directory is assembled (as symlinks) for each server we start.
"""

from __future__ import annotations

import os
import secrets
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from batchstring.export.layout import REPO_ROOT

DEFAULT_REPOSITORY = REPO_ROOT / "model_repository"
EXIT_TIMEOUT_SECS = 3  # its own wait on SIGTERM; the front door has drained and closed its connections by then
# Admin APIs a client has no business calling. They are still compiled in, so they are put behind
# a header whose value is a random secret per server: nobody holds it.
RESTRICTED = "model-repository,shared-memory,trace,logging"


class TritonNotFound(RuntimeError):
    pass


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    libs: Path
    backend_lib: Path
    backend_utils: Path
    stub: Path
    caches: Path

    @classmethod
    def find(cls) -> TritonInstall:
        try:
            import pytriton
        except ImportError:
            raise TritonNotFound(
                "tritonserver not found: the `nvidia-pytriton` wheel (which ships it) is not installed; "
                "run `make install` (or `pip install nvidia-pytriton==0.7.0`)"
            ) from None
        root = Path(pytriton.__file__).parent / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(
            binary=root / "bin" / "tritonserver",
            libs=Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs",
            backend_lib=root / "backends" / "python" / "libtriton_python.so",
            backend_utils=root / "backends" / "python" / "triton_python_backend_utils.py",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            caches=root / "caches",
        )
        missing = [str(p) for p in (install.binary, install.backend_lib, install.stub) if not p.exists()]
        if missing:
            raise TritonNotFound(f"incomplete tritonserver install (missing {', '.join(missing)}); "
                                 f"Python {version} may not be supported by nvidia-pytriton 0.7.0")
        return install

    def make_backend_dir(self, where: Path) -> Path:
        python = where / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        for src in (self.backend_lib, self.backend_utils, self.stub):
            link = python / src.name
            if not link.exists():
                link.symlink_to(src)
        return where / "backends"

    def environment(self) -> dict[str, str]:
        """The stub links the bundled libcudart; model.py imports numpy/onnxruntime from this venv."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(self.libs), env.get("LD_LIBRARY_PATH")]))
        site = sysconfig.get_paths()["purelib"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
        return env


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


@dataclass(frozen=True)
class TLS:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Sockets:
    """tritonserver's endpoints: Unix sockets in a directory only the server's user can open.

    Nothing else on the machine can reach Triton (its admin APIs included): the front door is the
    only way in. Triton appends its port to a Unix address, hence the gRPC socket's odd name.
    """

    directory: Path

    @property
    def http(self) -> Path:
        return self.directory / "http.sock"

    @property
    def metrics(self) -> Path:
        return self.directory / "metrics.sock"

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.directory}/grpc.sock:{Ports.grpc}"

    def prepare(self) -> None:
        """A private directory without the sockets a killed server may have left behind."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        for stale in self.directory.glob("*.sock*"):
            stale.unlink()


@dataclass(frozen=True)
class ServerCommand:
    """The tritonserver flags; the Docker image runs the same ones (docker/entrypoint.sh)."""

    repository: Path
    backend_dir: Path
    sockets: Sockets
    config_name: str | None = None  # None = config.pbtxt (GPU); "cpu" = configs/cpu.pbtxt
    extra: tuple[str, ...] = ()
    # Admin APIs stay behind a header key too (defence in depth): from the environment if set,
    # else a random secret per server that nobody holds.
    admin_secret: str = field(default_factory=lambda: os.environ.get("BATCHSTRING_ADMIN_KEY") or secrets.token_hex(16))

    def argv(self, binary: Path) -> list[str]:
        args = [
            str(binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={self.backend_dir}",
            "--model-control-mode=none",
            "--strict-readiness=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_SECS}",
            f"--http-address=unix:{self.sockets.http}",
            f"--grpc-address=unix:{self.sockets.directory}/grpc.sock",
            f"--grpc-port={Ports.grpc}",
            f"--metrics-address=unix:{self.sockets.metrics}",
            f"--allow-gpu-metrics={'false' if self.config_name == 'cpu' else 'true'}",
            f"--http-restricted-api={RESTRICTED}:admin-key={self.admin_secret}",
            f"--grpc-restricted-protocol={RESTRICTED}:admin-key={self.admin_secret}",
        ]
        if self.config_name:
            args.append(f"--model-config-name={self.config_name}")
        return args + list(self.extra)
