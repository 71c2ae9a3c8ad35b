"""Keeps a local server serving: restarts tritonserver when the model is dead, the front door
when it is gone.

Triton 2.51 does not restart a crashed Python stub, and `/v2/health/ready` stays 200 while the
model is gone. So the supervisor watches what matters: the server process, the stub process, the
front door process, and `/v2/models/llm/ready` through the front door. A vanished process means
restart now; a model that stays unready for a few probes in a row (not one slow probe) means
restart too. The engine turns readiness off itself when it breaks (its stub exits).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchstring.server.local import LocalServer, ServerError


@dataclass
class Supervisor:
    server: LocalServer
    interval: float = 1.0
    unready_probes: int = 3
    report: Callable[[str], None] = print
    restarts: int = 0

    def problem(self) -> tuple[str, bool] | None:
        """What is wrong, and whether it is certain (restart at once) or may pass."""
        proc = self.server.process
        if proc is None or proc.poll() is not None:
            return f"tritonserver exited (code {None if proc is None else proc.returncode})", True
        front = self.server.front
        if front is None or front.poll() is not None:
            return f"the front door exited (code {None if front is None else front.returncode})", True
        if not self.server.stub_processes():
            return "the model's Python stub process is gone", True
        if not self.server.model_ready():
            return "model not ready", False
        return None

    def run(self, stop: threading.Event) -> None:
        unready = 0
        while not stop.wait(self.interval):
            found = self.problem()
            if found is None:
                unready = 0
                continue
            reason, certain = found
            unready += 1
            if certain or unready >= self.unready_probes:
                self._restart(reason, stop)
                unready = 0

    def _restart(self, reason: str, stop: threading.Event) -> None:
        started = time.monotonic()
        front_only = reason.startswith("the front door") and self.server.process.poll() is None
        self.report(f"batchstring: {reason}; restarting {'the front door' if front_only else 'tritonserver'}")
        while not stop.is_set():
            try:
                if front_only:  # Triton and the requests it is running are fine: clients reconnect and retry
                    self.server.restart_front_door()
                    self.server.wait_ready()
                else:
                    # No grace: requests in flight on a dead model would never finish, so draining
                    # them only delays recovery. Their clients see the stream break and retry.
                    self.server.restart(grace=0)
            except ServerError as exc:
                self.report(f"batchstring: restart failed, retrying in 5 s: {exc}")
                stop.wait(5)
                continue
            self.restarts += 1
            self.report(f"batchstring: serving again after {time.monotonic() - started:.1f} s")
            return
