"""Running one step so that only a request that fails on its own gets an error.

A step that raises is split in halves and each half run again, recursively. The result says what
ran, what failed, and whether a step failed because of its size (out of memory, while both its
halves passed): the core then lowers admissions (engine/scheduler.py). When every request failed,
the core asks for a one-token probe step (`device_works`) to tell a broken device (it fails too)
from requests that fail on their own. This module reads the block table to build steps and never
takes or frees a block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from batchstring.engine.batch import StepBatch, Work, build_step, split_step
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.errors import is_out_of_memory
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.runner import PagedCacheRunner, StepOutput
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence
from batchstring.engine.stats import EngineStats


@dataclass(frozen=True)
class Ran:
    """A part of the step that ran: its rows, its inputs and what came back."""

    work: list[Work]
    batch: StepBatch
    out: StepOutput


@dataclass(frozen=True)
class StepResult:
    """What one scheduled step came to."""

    ran: list[Ran]
    failed: list[tuple[Sequence, BaseException]]
    oversized: int | None = None  # rows of the smallest step that ran out of memory while its halves passed

    def __add__(self, other: StepResult) -> StepResult:
        sizes = [s for s in (self.oversized, other.oversized) if s is not None]
        return StepResult(self.ran + other.ran, self.failed + other.failed, min(sizes, default=None))


class IsolatedStep:
    def __init__(self, runner: PagedCacheRunner, blocks: BlockManager, stats: EngineStats, random: RandomStreams,
                 eos_token_ids: tuple[int, ...], query_group: int, split_cost: int) -> None:
        self.runner = runner
        self.blocks = blocks  # read for the block table; the scheduler owns every block
        self.stats = stats
        self.random = random
        self.probe_token = eos_token_ids[0] if eos_token_ids else 0
        self.query_group = query_group  # query heads per kv head, for the choice of span (build_step)
        self.split_cost = split_cost  # padded attention worth a second call of a step (split_step)

    def run(self, work: list[Work]) -> StepResult:
        result = StepResult([], [])
        for part in split_step(work, self.blocks.block_size, self.split_cost):
            result += self._bisect(part)
        return result

    def _bisect(self, work: list[Work]) -> StepResult:
        try:
            batch = build_step(work, self.blocks, self.random, self.query_group)
            began = time.perf_counter()
            out = self.runner.step(batch)
            self.stats.runner_seconds += time.perf_counter() - began
            return StepResult([Ran(work, batch, out)], [])
        except Exception as exc:  # any runtime failure: isolate it, never kill the loop
            if is_out_of_memory(exc):
                self.stats.oom_events += 1
            if len(work) == 1:
                return StepResult([], [(work[0].seq, exc)])
            mid = len(work) // 2
            halves = self._bisect(work[:mid]) + self._bisect(work[mid:])
            if is_out_of_memory(exc) and not halves.failed:
                return halves + StepResult([], [], len(work))
            return halves

    def probe(self) -> Sequence:
        """A throw-away one-token sequence for `device_works`, to be given a block first."""
        return Sequence("probe", [self.probe_token], SamplingParams(max_tokens=1, temperature=0.0))

    def device_works(self, probe: Sequence) -> bool:
        """Whether the device still runs a step: the probe's one token."""
        try:
            self.runner.step(build_step([Work(probe, 1)], self.blocks, self.random, self.query_group))
        except Exception:
            return False
        return True
