"""A private PostgreSQL server for tests and benchmarks: the machine's own `initdb` and `pg_ctl`,
in a temporary directory, on a loopback port, trust authentication, gone when stopped.

`initdb` refuses to run as root: as root the server runs as the `postgres` user (`runuser`),
otherwise as whoever runs this.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _binaries() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).parent
    raise RuntimeError("PostgreSQL's initdb was not found (/usr/lib/postgresql/*/bin or PATH): install the "
                       "server package (Debian: postgresql)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self.bin = _binaries()
        self.root = Path(tempfile.mkdtemp(prefix="batchstring-pg-"))
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "postgres", "postgres")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if self.as_postgres else []
        result = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=120)
        if result.returncode:
            raise RuntimeError(f"{Path(argv[0]).name} failed: {result.stdout[-2000:]}{result.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        data = self.root / "data"
        self._run(str(self.bin / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "-E", "UTF8")
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        self._run(str(self.bin / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(self.root / "log"), "-w",
                  "start")
        return self

    def stop(self) -> None:
        if (self.root / "data" / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
