"""Batching policies: who may join a step, and whether a finished row leaves it at once.

Continuous batching (the default) lets any waiting sequence join at any iteration and retires a
finished one immediately. Static scheduling is request-level batching, kept as the baseline that
continuous batching is measured against (Orca's baseline, a padded `generate` call): a Triton
batch is admitted into an empty engine and runs until its longest sequence is done; the rows that
finish first keep computing and their answers are held until then.
"""

from __future__ import annotations

from batchstring.engine.sequence import Sequence


class BatchingPolicy:
    """Continuous batching."""

    chunks = True  # prompts may be prefilled a chunk per step, beside the decoding sequences

    def may_admit(self, running: list[Sequence]) -> bool:
        return True

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return True

    def hold(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether a finished sequence stays in the batch (its answer delivered later)."""
        return False

    def releasable(self, running: list[Sequence], max_len: int) -> list[Sequence]:
        """Held sequences that may leave now."""
        return []


class StaticPolicy(BatchingPolicy):
    """Request-level batching: one Triton batch (group) at a time, run to completion."""

    chunks = False  # whole prompts, in steps of their own, as a padded generate call runs them

    def may_admit(self, running: list[Sequence]) -> bool:
        return not running

    def may_join(self, seq: Sequence, first: Sequence) -> bool:
        return seq.group == first.group

    def hold(self, seq: Sequence, running: list[Sequence]) -> bool:
        seq.held = _group_running(seq, running)
        return seq.held

    def releasable(self, running: list[Sequence], max_len: int) -> list[Sequence]:
        return [s for s in running if s.held and (not _group_running(s, running) or s.num_tokens >= max_len)]


def _group_running(seq: Sequence, running: list[Sequence]) -> bool:
    return any(s.group == seq.group and s is not seq and not s.held for s in running)


def policy_for(scheduling: str) -> BatchingPolicy:
    return StaticPolicy() if scheduling == "static" else BatchingPolicy()
