"""Test-only fault injection: a prompt that contains the configured marker breaks something.

Off unless the `fault_marker` parameter is set (never in production); then the runner is wrapped,
and the two places that break outside a step ask `fault_kind` too: the engine loop
(engine/serving.py) and the responder's first send (model_repository/llm/1/model.py). What breaks
depends on what follows the marker in the prompt:

    <marker>          its step runs out of memory (an isolated, input-dependent failure)
    <marker>:device   from then on every step fails, as after a sticky CUDA error
    <marker>:loop     the engine loop itself raises (a bug outside the isolated step)
    <marker>:stall    its step never returns (a hung runtime)
    <marker>:send     sending its first response raises (a broken frontend); see responder.py
"""

from __future__ import annotations

import threading

from batchstring.engine.batch import StepBatch
from batchstring.engine.runner import PagedCacheRunner, StepOutput

KINDS = ("device", "loop", "stall", "send")


class EngineLoopFault(RuntimeError):
    """Raised outside step isolation, to exercise the engine's own failure handling."""


def fault_kind(marker: str, prompt: str) -> str | None:
    """Which fault a prompt asks for: "oom", one of KINDS, or None."""
    if not marker or marker not in prompt:
        return None
    return next((k for k in KINDS if f"{marker}:{k}" in prompt), "oom")


class FaultyRunner:
    """A runner whose steps fail as the prompts in them ask; everything else is the real runner's."""

    def __init__(self, runner: PagedCacheRunner, marker: str) -> None:
        self.runner = runner
        self.marker = marker
        self.device_failed = False
        self._forever = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def step(self, batch: StepBatch) -> StepOutput:
        kinds = {fault_kind(self.marker, w.seq.output.prompt) for w in batch.work if w.seq.output is not None}
        self.device_failed = self.device_failed or "device" in kinds
        if self.device_failed:
            raise RuntimeError("device failure (injected: a sticky fault, every step fails)")
        if "stall" in kinds:
            self._forever.wait()
        if "oom" in kinds:
            raise MemoryError(f"out of memory (injected: a prompt in this step contains {self.marker!r})")
        return self.runner.step(batch)


def with_faults(runner: PagedCacheRunner, marker: str) -> PagedCacheRunner:
    """The runner itself, or wrapped for fault injection when a marker is configured."""
    return FaultyRunner(runner, marker) if marker else runner
