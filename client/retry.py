"""Retry policy: exponential backoff with jitter, bounded by a per-call deadline."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """Defaults ride out a server restart (~10-20 s) without hammering it.

    Only failures that are safe to repeat are retried: a broken stream, a full or timed-out
    queue, a model that is (re)loading. Invalid input and failed model steps are not.
    """

    max_attempts: int = 8
    initial_backoff: float = 0.2  # seconds before the first retry
    max_backoff: float = 5.0
    multiplier: float = 2.0
    deadline: float = 120.0  # seconds for a whole batchstring call, retries included

    def backoff(self, attempt: int) -> float:
        """Delay after failed attempt `attempt` (1-based): half fixed, half random ("equal jitter").

        The random half spreads the retries of many callers that failed at the same moment.
        """
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base / 2 + random.uniform(0, base / 2)
