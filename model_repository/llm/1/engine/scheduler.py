"""Iteration-level scheduling: which sequences run in the next step.

Every iteration either admits waiting sequences (a prefill step) or advances every running
sequence by one token (a decode step). Admission is bounded by `max_num_seqs`, by the KV-cache
blocks, and by a padded-token budget per prefill. When a running sequence cannot grow, the
youngest running sequence is preempted: its blocks are freed and it is recomputed later.

`static` scheduling admits only into an empty engine, one Triton batch (group) at a time, and
runs it to completion: the baseline continuous batching is measured against.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledStep:
    seqs: list[Sequence]
    prefill: bool


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._cap_until = 0.0
        self._cap = config.max_num_seqs
        # Keep a few blocks free when admitting, so that admission does not force preemptions.
        self._watermark = max(1, blocks.num_blocks // 100)

    @property
    def step_cap(self) -> int:
        """Sequences per step: `max_num_seqs`, or less for a while after an out-of-memory step."""
        if self._cap_until and time.monotonic() >= self._cap_until:
            self._cap, self._cap_until = self.config.max_num_seqs, 0.0
        return self._cap

    def lower_cap(self, failed_batch: int) -> None:
        self._cap = max(1, min(self._cap, failed_batch // 2))
        self._cap_until = time.monotonic() + self.config.oom_backoff_seconds

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        admitted = self._admit()
        if admitted:
            return ScheduledStep(admitted, prefill=True)
        decoding = self._grow_running()
        return ScheduledStep(decoding, prefill=False) if decoding else None

    def _admit(self) -> list[Sequence]:
        static = self.config.scheduling == "static"
        if static and self.running:
            return []
        cap = self.step_cap
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(self.running) + len(admitted) < cap:
            seq = self.waiting[0]
            if static and admitted and seq.group != admitted[0].group:
                break
            longest = max(longest, seq.num_tokens)
            if admitted and not static and longest * (len(admitted) + 1) > self.config.max_prefill_tokens:
                break
            reserve = self._watermark if self.running or admitted else 0
            if self.blocks.extra_blocks(seq, seq.num_tokens) + reserve > self.blocks.num_free:
                break
            self.blocks.grow(seq, seq.num_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
        self.running.extend(admitted)
        return admitted

    def _grow_running(self) -> list[Sequence]:
        """Room for one more token per running sequence, oldest first; preempts the youngest."""
        ready: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.order)[: self.step_cap]:
            while seq.status is Status.RUNNING and not self.blocks.can_grow(seq, seq.num_tokens):
                self.preempt(max(self.running, key=lambda s: s.order))
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, seq.num_tokens)
                ready.append(seq)
        return ready

    def preempt(self, seq: Sequence) -> None:
        """Frees the sequence's cache and puts it first in line; it will be recomputed."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def retire(self, seq: Sequence) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED
