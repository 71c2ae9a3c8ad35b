"""Batching policies: who may join a step, and whether a finished sequence leaves it at once.

Continuous batching (the default) lets any waiting sequence join at any iteration and retires a
finished one immediately. Static batching is request-level batching, kept as the baseline that
continuous batching is measured against (Orca's baseline, a padded `generate` call): a Triton
batch is admitted into an empty engine and runs until its longest sequence is done; the rows that
finish first stay in the batch as padding (they keep computing) and their answers are held here
until then. The scheduler asks who may join; the core hands each finished answer to `defers` and
delivers what `released` gives back.
"""

from __future__ import annotations

from batchstring.engine.output import RequestOutput
from batchstring.engine.sequence import Sequence, Status


class ContinuousBatching:
    chunks = True  # prompts may be prefilled a chunk per step, beside the decoding sequences

    def __init__(self) -> None:
        self.deferred: dict[Sequence, RequestOutput] = {}  # padding rows' answers, sent with their batch

    def may_admit(self, running: list[Sequence]) -> bool:
        return True

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return True

    def defers(self, seq: Sequence, final: RequestOutput, running: list[Sequence]) -> bool:
        """Whether a sequence that just finished stays in its batch as padding (its row computes on,
        and nothing it generates is its answer any more); if so its answer `final` is held."""
        return False

    def released(self, running: list[Sequence], max_len: int) -> list[tuple[Sequence, RequestOutput]]:
        """Padding rows whose batch has ended (or that cannot grow any more), with their answers."""
        return []

    def take(self, seq: Sequence) -> RequestOutput:
        """A padding row's held answer, now that it is delivered."""
        return self.deferred.pop(seq)

    def forget(self, seq: Sequence) -> None:
        """A row answered otherwise (a padding row whose step failed gets that error instead)."""
        self.deferred.pop(seq, None)


class StaticBatching(ContinuousBatching):
    """Request-level batching: one Triton batch (group) at a time, run to completion."""

    chunks = False  # whole prompts, in steps of their own, as a padded generate call runs them

    def may_admit(self, running: list[Sequence]) -> bool:
        return not running

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return seq.group == first.group

    def defers(self, seq: Sequence, final: RequestOutput, running: list[Sequence]) -> bool:
        seq.padding = seq.status is Status.RUNNING and _group_generating(seq, running)
        if seq.padding:
            self.deferred[seq] = final
        return seq.padding

    def released(self, running: list[Sequence], max_len: int) -> list[tuple[Sequence, RequestOutput]]:
        done = [s for s in running if s.padding and (not _group_generating(s, running) or s.num_tokens >= max_len)]
        return [(seq, self.take(seq)) for seq in done]


def _group_generating(seq: Sequence, running: list[Sequence]) -> bool:
    return any(s.group == seq.group and s is not seq and not s.padding for s in running)


def policy_for(scheduling: str) -> ContinuousBatching:
    return StaticBatching() if scheduling == "static" else ContinuousBatching()
