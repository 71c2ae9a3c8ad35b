"""Batching policies: who may join a step, and whether a finished sequence leaves it at once.

Continuous batching (the default) lets any waiting sequence join at any iteration and retires a
finished one immediately. Static batching is request-level batching, kept as the baseline that
continuous batching is measured against (Orca's baseline, a padded `generate` call): a Triton
batch is admitted into an empty engine and runs until its longest sequence is done; the rows that
finish first stay in the batch as padding (they keep computing) and their answers are deferred
until then. The scheduler asks; the core (engine/core.py) delivers what is deferred.
"""

from __future__ import annotations

from batchstring.engine.sequence import Sequence


class ContinuousBatching:
    chunks = True  # prompts may be prefilled a chunk per step, beside the decoding sequences

    def may_admit(self, running: list[Sequence]) -> bool:
        return True

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return True

    def pads(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether a sequence that just finished stays in the batch as padding."""
        return False

    def padding_done(self, running: list[Sequence], max_len: int) -> list[Sequence]:
        """Padding rows whose batch has ended (or that cannot grow any more)."""
        return []


class StaticBatching(ContinuousBatching):
    """Request-level batching: one Triton batch (group) at a time, run to completion."""

    chunks = False  # whole prompts, in steps of their own, as a padded generate call runs them

    def may_admit(self, running: list[Sequence]) -> bool:
        return not running

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return seq.group == first.group

    def pads(self, seq: Sequence, running: list[Sequence]) -> bool:
        return _group_generating(seq, running)

    def padding_done(self, running: list[Sequence], max_len: int) -> list[Sequence]:
        return [s for s in running if s.padding and (not _group_generating(s, running) or s.num_tokens >= max_len)]


def _group_generating(seq: Sequence, running: list[Sequence]) -> bool:
    return any(s.group == seq.group and s is not seq and not s.padding for s in running)


def policy_for(scheduling: str) -> ContinuousBatching:
    return StaticBatching() if scheduling == "static" else ContinuousBatching()
