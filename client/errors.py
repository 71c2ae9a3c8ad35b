"""What a `batchstring` call can raise, and which failures are worth retrying."""

from __future__ import annotations


class ItemError(Exception):
    """The server answered this item with an error (e.g. invalid input, or a failed model step)."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class StreamBroken(ItemError):
    """The connection or stream died with the item in flight; safe to send again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=True)


class DeadlineExceeded(TimeoutError):
    """The call's deadline passed before this item got its result (retries included)."""


class BatchError(Exception):
    """Some items failed. `results[i]` is item i's text or its exception, in input order."""

    def __init__(self, results: list[str | BaseException]) -> None:
        self.results = results
        self.errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        first = next(iter(self.errors.items()))
        super().__init__(
            f"{len(self.errors)} of {len(results)} items failed; item {first[0]}: "
            f"{type(first[1]).__name__}: {first[1]}"
        )


# Server messages that mean "not now" rather than "never": overload, restarts, shutdown.
RETRYABLE_MESSAGES = (
    "exceeds maximum queue size",  # Triton queue policy: queue full
    "request timeout expired",  # Triton queue policy: waited too long in the queue
    "is not ready",  # model (re)loading
    "unknown model",  # server up, model not loaded yet
    "shutting down",  # engine draining on SIGTERM
    "stub process is not healthy",  # Python backend lost its stub
    "failed to connect",
)


def is_retryable_message(message: str) -> bool:
    text = message.lower()
    return any(m in text for m in RETRYABLE_MESSAGES)
