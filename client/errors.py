"""Every error the client raises: one root, `BatchstringError`, and a subclass per kind.

Whether to retry is decided by the class alone (`retryable`), never by an error's wording. Errors
from the `llm` model carry their kind in front of the message ("UNAVAILABLE: ...", the Triton error
code the model sent), because Triton's stream protocol carries only a message. Triton's own
per-request errors on a stream carry no code at all, so the few that Triton raises itself (a full
or timed-out queue, a model not ready) are recognised by their message here, in one table, and
nowhere else. The client's own refusals (a non-string input, a request too large to send) are
the same classes.
"""

from __future__ import annotations

import grpc


class BatchstringError(Exception):
    """Root of the family. `message` is the server's (or the client's) message; `code` the kind."""

    code = "INTERNAL"
    retryable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(BatchstringError, ValueError):
    """The request is wrong (bad text, out-of-range sampling values, a prompt beyond the context);
    sending it again cannot help. Also a ValueError, as Python's own argument errors are."""

    code = "INVALID_ARG"


class TooLarge(InvalidArgument):
    """The request is larger than the server accepts (the front door's message limit)."""

    code = "TOO_LARGE"


class NotFound(InvalidArgument):
    """The request names something the server does not serve (a LoRA adapter); the message lists
    what it serves."""

    code = "NOT_FOUND"


class Unavailable(BatchstringError):
    """Not now: a full or timed-out queue, a model (re)loading, restarting or shutting down."""

    code = "UNAVAILABLE"
    retryable = True


class StreamBroken(Unavailable):
    """The connection or stream died with the item in flight; safe to send again."""

    code = "STREAM_BROKEN"


class DeadlineExceeded(BatchstringError, TimeoutError):
    """The call's deadline passed before this item got its result (retries included)."""

    code = "DEADLINE_EXCEEDED"


class Internal(BatchstringError):
    """The server failed this request (a model step that failed for it alone); not retried."""

    code = "INTERNAL"


class Unauthenticated(BatchstringError):
    """The server wants an API key this client did not send (or a wrong one)."""

    code = "UNAUTHENTICATED"


class BatchError(BatchstringError):
    """Some items failed. `results[i]` is item i's text (or Completion) or its exception, in order;
    `errors` maps the failed items' indices to their exceptions."""

    code = "BATCH"

    def __init__(self, results: list) -> None:
        self.results = results
        self.errors = {i: r for i, r in enumerate(results) if isinstance(r, BaseException)}
        first, error = next(iter(self.errors.items()))
        super().__init__(f"{len(self.errors)} of {len(results)} items failed; item {first}: "
                         f"{type(error).__name__}: {error}")

    def __str__(self) -> str:
        return self.message


# The kinds the model writes in front of its messages (model_repository/llm/1/responder.py).
MODEL_KINDS: dict[str, type[BatchstringError]] = {
    "INVALID_ARG": InvalidArgument, "NOT_FOUND": NotFound, "UNAVAILABLE": Unavailable, "INTERNAL": Internal,
    "UNAUTHENTICATED": Unauthenticated,
}
# Triton's own errors, which it sends without a code; all of them mean "not now".
TRITON_UNAVAILABLE = (
    "exceeds maximum queue size",  # queue policy: queue full
    "request timeout expired",  # queue policy: waited too long in the queue
    "is not ready",  # model (re)loading
    "unknown model",  # server up, model not loaded yet
    "stub process is not healthy",  # the Python backend lost its stub
    "failed to connect",
)
# A stream that ends with a gRPC status: what each status means for the items it carried.
STATUS_KINDS: dict[grpc.StatusCode, type[BatchstringError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooLarge,  # the front door's message limit
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
}


def from_server(message: str) -> BatchstringError:
    """The error of an item the server answered with `message`."""
    head, sep, rest = message.partition(": ")
    if sep and head in MODEL_KINDS:
        return MODEL_KINDS[head](rest)
    text = message.lower()
    return Unavailable(message) if any(m in text for m in TRITON_UNAVAILABLE) else Internal(message)


def from_status(code: grpc.StatusCode, details: str) -> BatchstringError:
    """The error of every item in flight on a stream that ended with a gRPC status."""
    kind = STATUS_KINDS.get(code)
    return kind(details) if kind else StreamBroken(f"stream broken ({code.name}: {details})")
