"""Whether the model process behind Triton is alive.

In Triton 2.51 `/v2/models/llm/ready` stays 200 after the Python backend's stub process (the
model process, where the engine runs) has died: requests then fail with "stub process is not
healthy" and nothing restarts it. So the front door looks for the stub itself: a child process
of its tritonserver, found in /proc. Readiness through the front door is Triton's answer and
this one together.
"""

from __future__ import annotations

from pathlib import Path

STUB = b"triton_python_backend_stub"


def stub_alive(triton_pid: int, proc: Path = Path("/proc")) -> bool:
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == triton_pid and state != "Z" and STUB in (entry / "cmdline").read_bytes():
                return True
        except (OSError, ValueError, IndexError):
            continue  # a process that ended while we looked
    return False
