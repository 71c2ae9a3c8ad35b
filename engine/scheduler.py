"""Iteration-level scheduling: which sequences run in the next step, and what a step did to them.

Every iteration either admits waiting sequences (a prefill step) or advances every running
sequence by one token (a decode step). Admission is bounded by `max_num_seqs`, by the KV-cache
blocks, and by a padded-token budget per prefill. When a running sequence cannot grow, the
youngest running sequence is preempted: its blocks are freed and it is recomputed later.

After a step, `update` owns the bookkeeping: cached counts, appended tokens, and which
sequences ended (end-of-sequence token, `max_tokens`; admission already checked that prompt +
`max_tokens` fit the context). The batching policy
(engine/policy.py) decides who may join a step and whether a finished row leaves at once.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.batch import Work
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.policy import BatchingPolicy
from engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledStep:
    work: list[Work]
    prefill: bool

    @property
    def seqs(self) -> list[Sequence]:
        return [w.seq for w in self.work]


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, policy: BatchingPolicy,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.blocks = blocks
        self.policy = policy
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._admit_cap_until = 0.0
        self._admit_cap = config.max_num_seqs
        # Keep a few blocks free when admitting, so that admission does not force preemptions.
        self._watermark = max(1, blocks.num_blocks // 100)

    # ----- admission back-off ------------------------------------------------------------------

    @property
    def admit_cap(self) -> int:
        """Sequences one prefill step may admit: `max_num_seqs`, or fewer for a while after a step
        failed because of its size. Never limits sequences already running."""
        if self._admit_cap_until and time.monotonic() >= self._admit_cap_until:
            self._admit_cap, self._admit_cap_until = self.config.max_num_seqs, 0.0
        return self._admit_cap

    def lower_admit_cap(self, failed_size: int) -> None:
        self._admit_cap = max(1, min(self._admit_cap, failed_size // 2))
        self._admit_cap_until = time.monotonic() + self.config.oom_backoff_seconds

    # ----- queues ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        admitted = self._admit()
        if admitted:
            return ScheduledStep([Work(s, s.num_tokens - s.num_cached) for s in admitted], prefill=True)
        decoding = self._grow_running()
        return ScheduledStep([Work(s, 1) for s in decoding], prefill=False) if decoding else None

    def _admit(self) -> list[Sequence]:
        if not self.policy.may_admit(self.running):
            return []
        cap = min(self.admit_cap, self.config.max_num_seqs - len(self.running))
        admitted: list[Sequence] = []
        longest = 0
        while self.waiting and len(admitted) < cap:
            seq = self.waiting[0]
            if admitted and not self.policy.may_join(seq, admitted[0]):
                break
            longest = max(longest, seq.num_tokens)
            padded = longest * (len(admitted) + 1)
            if admitted and self.policy.bounds_prefill and padded > self.config.max_prefill_tokens:
                break
            reserve = self._watermark if self.running or admitted else 0
            if self.blocks.extra_blocks(seq, seq.num_tokens) + reserve > self.blocks.num_free:
                break
            self.blocks.grow(seq, seq.num_tokens)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
        if admitted:  # kept oldest first: preemption takes the youngest from the end
            self.running = sorted(self.running + admitted, key=lambda s: s.order)
        return admitted

    def _grow_running(self) -> list[Sequence]:
        """Room for one more token per running sequence, oldest first; preempts the youngest.

        Only a sequence whose next token starts a new block needs anything from the block manager.
        """
        size = self.blocks.block_size
        for seq in [s for s in self.running if len(s.blocks) * size < s.num_tokens]:
            while seq.status is Status.RUNNING and not self.blocks.can_grow(seq, seq.num_tokens):
                self.preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, seq.num_tokens)
        return list(self.running)

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

    # ----- after a step ------------------------------------------------------------------------

    def update(self, work: list[Work], sampled: list[Sequence], tokens: np.ndarray) -> list[tuple[Sequence, str]]:
        """Records a successful step; returns the sequences that ended, with why (stop / length).

        A plain loop: per row it is a list append and two comparisons, cheaper than building
        arrays for them at any batch size the engine runs (measured; see BENCHMARKS.md).
        """
        for w in work:
            w.seq.num_cached += w.new
        eos = self.eos
        ended = []
        for seq, token in zip(sampled, tokens.tolist()):
            generated = seq.output_ids
            generated.append(token)
            if seq.held:
                continue
            if token in eos and not seq.params.ignore_eos:
                ended.append((seq, "stop"))
            elif len(generated) >= seq.params.max_tokens:  # admission checked it fits the context
                ended.append((seq, "length"))
        return ended
