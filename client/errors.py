"""What a `batchstring` call can raise, and which failures are worth retrying.

Every item error has a kind, and the retry decision is made on the kind alone. Errors from the
`llm` model carry their kind in front of the message ("UNAVAILABLE: ...", the Triton error code
the model sent). Triton's own per-request errors on a stream carry no code at all (the gRPC
stream protocol has only a message), so the few that Triton raises itself (a full or timed-out
queue, a model not ready) are recognised by their message here, in one table, and nowhere else.
"""

from __future__ import annotations

INVALID_ARGUMENT = "INVALID_ARG"
UNAVAILABLE = "UNAVAILABLE"
INTERNAL = "INTERNAL"
STREAM_BROKEN = "STREAM_BROKEN"
UNAUTHENTICATED = "UNAUTHENTICATED"  # the server wants an API key this client did not send
RETRYABLE = frozenset({UNAVAILABLE, STREAM_BROKEN})
MODEL_KINDS = (INVALID_ARGUMENT, UNAVAILABLE, INTERNAL, UNAUTHENTICATED)  # kinds carried in front of a message

# Triton's own errors, which it sends without a code; all of them mean "not now".
TRITON_UNAVAILABLE = (
    "exceeds maximum queue size",  # queue policy: queue full
    "request timeout expired",  # queue policy: waited too long in the queue
    "is not ready",  # model (re)loading
    "unknown model",  # server up, model not loaded yet
    "stub process is not healthy",  # the Python backend lost its stub
    "failed to connect",
)


def error_kind(message: str) -> str:
    head, sep, _ = message.partition(": ")
    if sep and head in MODEL_KINDS:
        return head
    text = message.lower()
    return UNAVAILABLE if any(m in text for m in TRITON_UNAVAILABLE) else INTERNAL


class ItemError(Exception):
    """The server answered this item with an error; `kind` says which (see error_kind)."""

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind or error_kind(message)

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


class StreamBroken(ItemError):
    """The connection or stream died with the item in flight; safe to send again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, STREAM_BROKEN)


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
