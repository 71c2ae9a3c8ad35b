"""Running one step so that only a request that fails on its own gets an error.

A step that raises is split in halves and each half run again, recursively. Admissions back off
only when the step failed because of its size (the whole failed, both halves passed). When every
request failed, a one-token probe step tells a broken device (it fails too) from requests that fail
on their own; a broken device raises EngineBroken for whoever drives the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from batchstring.engine.batch import StepBatch, Work, build_step, split_step
from batchstring.engine.errors import EngineBroken, is_out_of_memory
from batchstring.engine.runner import PagedCacheRunner, StepOutput
from batchstring.engine.sampling import SamplingParams
from batchstring.engine.scheduler import Scheduler
from batchstring.engine.sequence import Sequence
from batchstring.engine.stats import EngineStats


@dataclass(frozen=True)
class Ran:
    """A part of the step that ran: its rows, its inputs and what came back."""

    work: list[Work]
    batch: StepBatch
    out: StepOutput


class IsolatedStep:
    def __init__(self, runner: PagedCacheRunner, scheduler: Scheduler, stats: EngineStats,
                 eos_token_ids: tuple[int, ...], query_group: int, split_cost: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.stats = stats
        self.probe_token = eos_token_ids[0] if eos_token_ids else 0
        self.rng = np.random.default_rng()  # the random numbers of requests without a seed
        self.query_group = query_group  # query heads per kv head, for the choice of span (build_step)
        self.split_cost = split_cost  # padded attention worth a second call of a step (split_step)

    def run(self, work: list[Work]) -> tuple[list[Ran], list[tuple[Sequence, BaseException]]]:
        ran, failed = [], []
        for part in split_step(work, self.scheduler.blocks.block_size, self.split_cost):
            part_ran, part_failed = self._bisect(part)
            ran, failed = ran + part_ran, failed + part_failed
        if failed and not ran and not self._probe():
            raise EngineBroken(f"every request of a step failed and so did a one-token probe step ({failed[0][1]})")
        return ran, failed

    def _bisect(self, work: list[Work]) -> tuple[list[Ran], list[tuple[Sequence, BaseException]]]:
        try:
            batch = build_step(work, self.scheduler.blocks, self.rng, self.query_group)
            began = time.perf_counter()
            out = self.runner.step(batch)
            self.stats.runner_seconds += time.perf_counter() - began
            return [Ran(work, batch, out)], []
        except Exception as exc:  # any runtime failure: isolate it, never kill the loop
            if is_out_of_memory(exc):
                self.stats.oom_events += 1
            if len(work) == 1:
                return [], [(work[0].seq, exc)]
            mid = len(work) // 2
            left, right = self._bisect(work[:mid]), self._bisect(work[mid:])
            if is_out_of_memory(exc) and not left[1] and not right[1]:
                self.scheduler.lower_admit_cap(len(work))
            return left[0] + right[0], left[1] + right[1]

    def _probe(self) -> bool:
        """Whether the device still runs a step: one token of a throw-away sequence."""
        probe = Sequence("probe", [self.probe_token], SamplingParams(max_tokens=1, temperature=0.0))
        with self.scheduler.scratch(probe, 1) as room:
            if not room:
                return True  # no room to ask; not evidence of a broken device
            try:
                self.runner.step(build_step([Work(probe, 1)], self.scheduler.blocks, self.rng, self.query_group))
            except Exception:
                return False
            return True
