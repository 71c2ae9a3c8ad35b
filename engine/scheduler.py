"""Iteration-level scheduling: which sequences run in the next step, and what a step did to them.

With chunked prefill (the default), every step carries every running sequence that decodes
(one token each), then the prompts still being prefilled, then newly admitted sequences, all
within a budget of `max_num_batched_tokens` tokens; a prompt longer than
`long_prefill_token_threshold` gets at most that many tokens per step. A long prompt is
prefilled a chunk per step while the others keep decoding, so no step is much longer than a
decode step, and short prompts are not held back behind it. Without chunked prefill, a step
either admits waiting sequences and prefills their whole prompts, or decodes every running one.
A waiting sequence whose next prompt block another sequence is computing right now waits for
that block to be cached rather than computing it again (one instruction, many inputs).
Admission is also bounded by `max_num_seqs` and by the KV-cache blocks, and a sequence admitted
with a cached prefix (engine/block_manager.py) only computes the rest. When a running sequence
cannot grow, the youngest running sequence is preempted: its blocks are released (its computed
blocks stay cached) and it is recomputed later.

`schedule` returns what it decided (`ScheduledStep`); the core passes it on and brings back
what ran. After a step, `update` owns the bookkeeping: computed counts, appended tokens, which
sequences ended (end-of-sequence token, `max_tokens`; admission already checked that prompt +
`max_tokens` fit the context), and the blocks the prefix cache may now offer to others. The
batching policy (engine/policy.py) decides who may join a step. The scheduler owns the block
manager: nothing else in the engine takes or frees blocks, so speculative drafts get their room
here (`grant_drafts`) and the isolation probe its scratch block (`scratch`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from batchstring.engine.adapters import AdapterSlots
from batchstring.engine.batch import Work
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.config import EngineConfig
from batchstring.engine.policy import ContinuousBatching
from batchstring.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledStep:
    """What the scheduler decided for one step: each row's work, and whether prompts are in it."""

    work: list[Work]
    prefill: bool

    @property
    def seqs(self) -> list[Sequence]:
        return [w.seq for w in self.work]


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, policy: ContinuousBatching,
                 eos_token_ids: tuple[int, ...], adapters: AdapterSlots | None = None) -> None:
        self.config = config
        self.adapters = adapters
        self.blocks = blocks
        self.policy = policy
        self.eos = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._background = 0  # background (priority > 1) sequences held, running or waiting
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
        self._background += seq.priority > 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def all(self) -> list[Sequence]:
        """Every sequence the scheduler holds, running or waiting."""
        return [*self.running, *self.waiting]

    def schedule(self) -> ScheduledStep | None:
        if self._background and self.policy.may_admit(self.running):
            self._yield_to_interactive()  # before any row is scheduled: a preempted row is in no step
        budget = self.config.max_num_batched_tokens
        if self.config.enable_chunked_prefill and self.policy.chunks:
            work = self._decode_rows() + self._prefill_chunks()
            admitted = self._admit(budget - sum(w.new for w in work))
            work += admitted
            prefill = any(w.new > 1 for w in work) or bool(admitted)
            return ScheduledStep(work, prefill=prefill) if work else None
        admitted = self._admit(budget if self.policy.chunks else None)
        if admitted:
            return ScheduledStep(admitted, prefill=True)
        work = self._decode_rows()
        return ScheduledStep(work, prefill=False) if work else None

    def _admit(self, budget: int | None) -> list[Work]:
        """Waiting sequences that fit, in order. With chunked prefill (a running step), each gets a
        chunk of its uncached tokens within the budget; otherwise (a prefill step) whole prompts,
        the first even beyond the budget (or a long prompt could never run); budget None: no limit."""
        if not self.policy.may_admit(self.running):
            return []
        chunked = self.config.enable_chunked_prefill and self.policy.chunks
        cap = min(self.admit_cap, self.config.max_num_seqs - len(self.running))
        admitted: list[Work] = []
        # Interactive requests first; a stable sort keeps arrival order within a level.
        for seq in sorted(self.waiting, key=_level) if self._background else list(self.waiting):
            if len(admitted) >= cap or (budget is not None and budget <= 0 and admitted):
                break
            if admitted and not self.policy.may_join(seq, admitted[0].seq):
                break
            hits = self.blocks.lookup(seq)
            if chunked and self._prefix_in_flight(seq, len(hits), [w.seq for w in admitted]):
                continue  # its next block is being computed by another sequence: reuse it next step
            pending = seq.num_tokens - len(hits) * self.blocks.block_size
            new = min(pending, budget, self._chunk_cap(pending)) if chunked else pending
            if new <= 0 or (not chunked and admitted and budget is not None and new > budget):
                break
            reserve = self._watermark if self.running or admitted else 0
            if not self._take_adapter_slot(seq):
                break  # every adapter slot is held by rows of other adapters: waits its turn
            if not self.blocks.admit(seq, hits, new, reserve):
                self._free_adapter_slot(seq)
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            admitted.append(Work(seq, new, samples=new == pending))
            if budget is not None:
                budget -= new
        if admitted:  # kept oldest first: preemption takes the youngest from the end
            self.running = sorted(self.running + [w.seq for w in admitted], key=lambda s: s.order)
        return admitted

    def _yield_to_interactive(self) -> None:
        """Background rows (Batch API lines) give way: for each interactive request that waits while
        every seat is taken, the youngest background row is preempted (its computed blocks stay
        cached, so it resumes cheaply once the interactive load lets it)."""
        interactive = sum(1 for s in self.waiting if s.priority == 1)
        short = interactive - (self.config.max_num_seqs - len(self.running))
        if short > 0:
            for seq in [s for s in reversed(self.running) if s.priority > 1][:short]:
                self.preempt(seq)

    def _chunk_cap(self, pending: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        return threshold if 0 < threshold < pending else pending

    def _prefix_in_flight(self, seq: Sequence, hit_blocks: int, admitted: list[Sequence]) -> bool:
        """Whether a sequence that is still prefilling will soon cache `seq`'s next full block."""
        if not self.blocks.prefix_caching:
            return False
        end = (hit_blocks + 1) * self.blocks.block_size
        if end > seq.num_tokens - 1:
            return False  # no further full block to share
        prefix = seq.token_slice(0, end)
        return any(other.num_computed < end <= other.num_tokens - 1 and other.token_slice(0, end) == prefix
                   for other in [*self.running, *admitted] if other.num_tokens - other.num_computed > 1)

    def _decode_rows(self) -> list[Work]:
        """One more token for every running sequence that has computed all its tokens but the last,
        oldest first; the youngest is preempted while one cannot grow. Only a sequence whose next
        token starts a new block needs anything from the block manager."""
        size = self.blocks.block_size
        for seq in [s for s in self.running if len(s.blocks) * size < s.num_tokens]:
            if seq.num_tokens - seq.num_computed > 1:
                continue  # still prefilling: gets its blocks with its next chunk
            while seq.status is Status.RUNNING and not self.blocks.can_grow(seq, seq.num_tokens):
                self.preempt(self.running[-1])
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, seq.num_tokens)
        return [Work(s, 1) for s in self.running if s.num_tokens - s.num_computed == 1]

    def grant_drafts(self, work: list[Work], drafts: dict[int, tuple[int, ...]]) -> list[Work]:
        """The step's work with the speculative drafts proposed for its rows (by index; see
        engine/speculation.py), each given blocks for its drafts here; a row whose drafts would eat
        into the blocks kept free for growth decodes plainly instead."""
        work = list(work)
        for i, draft in drafts.items():
            seq = work[i].seq
            end = seq.num_tokens + len(draft)
            if self.blocks.extra_blocks(seq, end) + self._watermark <= self.blocks.num_free:
                self.blocks.grow(seq, end)
                work[i] = Work(seq, 1 + len(draft), draft=draft)
        return work

    def _prefill_chunks(self) -> list[Work]:
        """The next chunk of each running sequence still prefilling, within the step's budget."""
        budget = self.config.max_num_batched_tokens - sum(1 for s in self.running if s.num_tokens - s.num_computed == 1)
        work = []
        for seq in [s for s in self.running if s.num_tokens - s.num_computed > 1]:
            if budget <= 0:
                break
            pending = seq.num_tokens - seq.num_computed
            new = min(pending, budget, self._chunk_cap(pending))
            if not self.blocks.can_grow(seq, seq.num_computed + new):
                break  # waits for blocks; never preempts the decoding sequences
            self.blocks.grow(seq, seq.num_computed + new)
            work.append(Work(seq, new, samples=seq.num_computed + new == seq.num_tokens))
            budget -= new
        return work

    def _take_adapter_slot(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        slot = self.adapters.acquire(seq.adapter)
        seq.adapter_slot = -1 if slot is None else slot
        return slot is not None

    def _free_adapter_slot(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = -1

    def preempt(self, seq: Sequence) -> None:
        """Frees the sequence's cache and puts it first in line; it will be recomputed."""
        self.running.remove(seq)
        self.blocks.release(seq)
        self._free_adapter_slot(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    @contextmanager
    def scratch(self, seq: Sequence, num_tokens: int) -> Iterator[bool]:
        """Blocks for a throw-away sequence (the isolation probe) while the context lasts; yields
        whether there was room for it."""
        if not self.blocks.can_grow(seq, num_tokens):
            yield False
            return
        self.blocks.grow(seq, num_tokens)
        try:
            yield True
        finally:
            self.blocks.release(seq)

    def retire(self, seq: Sequence) -> None:
        """Done with `seq` (answered, or failed before it was ever added): its blocks are freed."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            seq.status = Status.FINISHED  # never held here
            return
        self._background -= seq.priority > 1
        self.blocks.release(seq)
        self._free_adapter_slot(seq)
        seq.status = Status.FINISHED

    # ----- after a step ------------------------------------------------------------------------

    def update(self, work: list[Work], sampled: list[Sequence], tokens: np.ndarray) -> dict[Sequence, str]:
        """Records a step that ran; returns the sequences that ended, with why (stop / length).
        Structured output's part (engine/structured_output.py) follows, on the same values.

        A plain loop: per row it is a list append and two comparisons, cheaper than building
        arrays for them at any batch size the engine runs (measured; see docs/benchmarks.md). A verified
        draft row (engine/speculation.py) comes as several rows of the same sequence, one per token it
        keeps, and caches the accepted drafts: its tokens are appended before its blocks are hashed.
        """
        eos = self.eos
        ended = {}
        for seq, token in zip(sampled, tokens.tolist()):
            generated = seq.output_ids
            generated.append(token)
            if seq.padding:
                continue
            if token in eos and not seq.params.ignore_eos:
                ended[seq] = "stop"
            elif len(generated) >= seq.params.max_tokens:
                ended[seq] = "length"  # admission checked that max_tokens fits the context
        size = self.blocks.block_size
        for w in work:
            seq = w.seq
            seq.num_computed += w.new
            if self.blocks.prefix_caching and seq.num_computed // size > seq.committed:
                self.blocks.commit(seq)
            self.blocks.slide(seq)
        return ended


def _level(seq: Sequence) -> int:
    return seq.priority
