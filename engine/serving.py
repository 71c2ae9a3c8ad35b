"""The serving shell around the engine's core: its thread, inbox, backpressure, watchdog and health.

Requests come in from any thread (`submit`, `abandon`); the core (engine/core.py) is driven on
the engine's own thread only. The shell also knows when the engine is broken rather than unlucky:
an error in its own loop, a step that does not return (`stall_seconds`), or a device that fails
every step (the core raises EngineBroken). Then every request it holds gets a retryable error, it
accepts nothing more, and `on_broken` tells its host (model.py ends the model process, so that it
is restarted).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from batchstring.engine.adapters import AdapterChange, AdapterWatcher
from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.errors import EngineBroken
from batchstring.engine.faults import EngineLoopFault, fault_kind
from batchstring.engine.runner import PagedCacheRunner
from batchstring.engine.sequence import Sequence

WATCHDOG_SECONDS = 1.0
ADAPTER_SCAN_SECONDS = 1.0  # how often the watched adapter directory is read (engine parameter adapter_dir)
DEADLINE_CHECK_SECONDS = 0.1  # how often requests are checked against their callers' deadlines
_STOP = object()
log = logging.getLogger(__name__)


class ServingEngine:
    def __init__(self, config: EngineConfig, runner: PagedCacheRunner | None = None,
                 on_broken: Callable[[str], None] | None = None) -> None:
        self.core = EngineCore(config, runner)  # driven on the engine's thread only (but make_sequence)
        self.config = config
        self.on_broken = on_broken
        self.broken: str | None = None  # why the engine stopped serving, once it has
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Condition()
        self._room_waiters = 0
        self._stopping = False
        self._checked_at = 0.0
        self._thread: threading.Thread | None = None
        self._step_started: float | None = None  # set while a step runs: the watchdog reads it

    # ----- requests in (any thread) ------------------------------------------------------------

    def submit(self, *seqs: Sequence) -> None:
        """The sequences join at the next iteration (a broken engine refuses them)."""
        for seq in seqs:
            if self.broken:
                self.core.fail(seq, self._broken_message())
            else:
                self._inbox.put(seq)

    def abandon(self, seq: Sequence, why: str) -> None:
        """Stop a request nobody will read (cancelled, its caller unreachable); see EngineCore.abort."""
        self._inbox.put((seq, why))

    def queued(self) -> int:
        return self._inbox.qsize() + len(self.core.scheduler.waiting)

    def wait_for_room(self) -> None:
        """Blocks while `max_waiting_seqs` requests are already queued (backpressure to the caller)."""
        with self._room:
            self._room_waiters += 1
            try:
                self._room.wait_for(lambda: self._stopping or self.queued() < self.config.max_waiting_seqs)
            finally:
                self._room_waiters -= 1

    # ----- the thread --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batchstring-engine", daemon=True)
        self._thread.start()
        threading.Thread(target=self._watchdog, name="batchstring-watchdog", daemon=True).start()
        if self.config.adapter_dir:
            threading.Thread(target=self._watch_adapters, name="batchstring-adapters", daemon=True).start()

    def stop(self) -> None:
        """Aborts what is left (each request gets its final response) and joins the thread."""
        self._wake(stopping=True)
        if self._thread:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        try:
            while not self.broken and self._take(self._next(block=not self.core.scheduler.has_work())):
                self._step()
        except EngineBroken as exc:
            self._break(str(exc))
        except Exception as exc:  # a bug outside step isolation: nothing the engine holds is safe
            self._break(f"the engine loop failed ({type(exc).__name__}: {exc})")
        if not self.broken:
            self.core.drain("the model is shutting down; retry on another instance")

    def _next(self, block: bool) -> object:
        try:
            return self._inbox.get(block=block)
        except queue.Empty:
            return None

    def _step(self) -> None:
        now = time.monotonic()
        if now - self._checked_at >= DEADLINE_CHECK_SECONDS:
            self._checked_at = now
            self.core.expire(now)
        self._step_started = now
        self.core.step()
        self._step_started = None
        if self._room_waiters and self.queued() < self.config.max_waiting_seqs:
            self._wake()

    def _take(self, first: object) -> bool:
        """Moves everything queued into the core; False when asked to stop."""
        item = first
        while item is not None:
            if item is _STOP:
                return False
            if isinstance(item, tuple):  # (sequence, why): abandoned
                self.core.abort(*item)
            elif isinstance(item, AdapterChange):
                self.core.adapters.apply(item)
            else:
                if fault_kind(self.config.fault_marker, item.output.prompt) == "loop":
                    raise EngineLoopFault("the engine loop failed (injected fault)")
                self.core.add(item)
            item = self._next(block=False)
        return True

    # ----- health ------------------------------------------------------------------------------

    def _break(self, why: str) -> None:
        """Stops serving for good: every request held gets a retryable error; the host is told."""
        if self.broken:
            return
        self.broken = why
        message = self._broken_message()
        self.core.drain(message)
        while (item := self._next(block=False)) is not None:
            if isinstance(item, Sequence):
                self.core.fail(item, message)
        self._wake(stopping=True)
        if self.on_broken:
            self.on_broken(why)

    def _broken_message(self) -> str:
        return f"the model's engine failed ({self.broken}); it is being restarted: retry"

    def _watchdog(self) -> None:
        """From its own thread: a step that does not return breaks the engine (the engine thread
        cannot notice, it is the one stuck)."""
        while self._thread is not None and not self.broken:
            time.sleep(WATCHDOG_SECONDS)
            started = self._step_started
            if started is not None and time.monotonic() - started > self.config.stall_seconds:
                self.broken = f"a step has not returned for {self.config.stall_seconds:g} s"
                if self.on_broken:
                    self.on_broken(self.broken)

    def _watch_adapters(self) -> None:
        """From its own thread: adapters added to, changed in or removed from `adapter_dir` reach
        the engine's thread as changes (loading one never holds up a step)."""
        slots = self.core.adapters
        watcher = AdapterWatcher(Path(self.config.adapter_dir), slots.base, slots.dtype)
        while self._thread is not None and not self.broken and not self._stopping:
            for change in watcher.scan():
                if change.error:
                    log.warning("batchstring: %s", change.error)
                self._inbox.put(change)
            time.sleep(ADAPTER_SCAN_SECONDS)

    def _wake(self, stopping: bool = False) -> None:
        """Wakes callers waiting for room; `stopping`: for good (they return at once from now on)."""
        with self._room:
            self._stopping = self._stopping or stopping
            self._room.notify_all()
