"""Test-only fault injection: a prompt that contains the configured marker breaks something.

Off unless the `fault_marker` parameter is set (never in production). What breaks depends on
what follows the marker in the prompt:

    <marker>          its step runs out of memory (an isolated, input-dependent failure)
    <marker>:device   from then on every step fails, as after a sticky CUDA error
    <marker>:loop     the engine loop itself raises (a bug outside the isolated step)
    <marker>:stall    its step never returns (a hung runtime)
    <marker>:send     sending its first response raises (a broken frontend); see responder.py
"""

from __future__ import annotations

import threading

KINDS = ("device", "loop", "stall", "send")


class EngineLoopFault(RuntimeError):
    """Raised outside step isolation, to exercise the engine's own failure handling."""


class FaultInjector:
    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.device_failed = False
        self._forever = threading.Event()

    def kind(self, prompt: str) -> str | None:
        """Which fault a prompt asks for: "oom", one of KINDS, or None."""
        if not self.marker or self.marker not in prompt:
            return None
        return next((k for k in KINDS if f"{self.marker}:{k}" in prompt), "oom")

    def before_step(self, prompts: list[str]) -> None:
        """Inside the isolated step: raises as the faults in this step's prompts ask."""
        kinds = {self.kind(p) for p in prompts} if self.marker else set()
        if "device" in kinds:
            self.device_failed = True
        if self.device_failed:
            raise RuntimeError("device failure (injected: a sticky fault, every step fails)")
        if "stall" in kinds:
            self._forever.wait()
        if "oom" in kinds:
            raise MemoryError(f"out of memory (injected: a prompt in this step contains {self.marker!r})")

    def in_loop(self, prompts: list[str]) -> None:
        """Outside step isolation: the engine loop's own code fails."""
        if self.marker and any(self.kind(p) == "loop" for p in prompts):
            raise EngineLoopFault("engine loop failure (injected)")
