"""The one thread that talks to Triton once `execute` has returned: responses and cancellation.

The engine thread never calls into Triton. Each engine output is queued here and turned into a
Triton response on this thread, so sending (an IPC round trip to the server) overlaps the next
engine step instead of delaying it (the runtime releases the GIL while it computes). The same
thread asks Triton, a few requests at a time, whether a client cancelled, and tells the engine;
keeping every call into Triton on one thread matters: `is_cancelled()` from a second thread has
crashed tritonserver under load.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from batchstring.engine.output import RequestOutput

# How often each live request is asked whether its client cancelled (each question costs the thread): soon
# after it arrives, then twice as long each time up to CANCEL_POLL_SECONDS, so a request dropped at
# once (a user who stops a generation) is noticed within a tenth of a second, not half a second.
FIRST_POLL_SECONDS = 0.1
CANCEL_POLL_SECONDS = 0.5
# Questions due within this of each other are asked in one wake-up of the thread.
POLL_GRANULARITY_SECONDS = 0.05
_STOP = object()


class Ticket:
    """One request as the responder knows it; calling it is the engine's output sink (it only queues)."""

    def __init__(self, sender, outbox: queue.SimpleQueue) -> None:
        self.sender = sender
        self.seq = None  # set once the engine has made the sequence
        self.poll_interval = FIRST_POLL_SECONDS
        self.next_poll = time.monotonic() + FIRST_POLL_SECONDS
        self.send_fault = False  # fault injection: its first send raises
        self._outbox = outbox

    def __call__(self, out: RequestOutput) -> None:
        self._outbox.put((self, out))


class Responder:
    def __init__(self, pb_utils, abandon: Callable[[object, str], None]) -> None:
        self.pb = pb_utils
        self.abandon = abandon  # engine.abandon(seq, why), thread-safe
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[Ticket] = set()  # requests that may still be cancelled
        self._next_poll = math.inf  # when the first live request is due to be asked (may be early, never late)
        self._thread = threading.Thread(target=self._run, name="batchstring-responder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Sends what is queued, then stops."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def fail_all(self, message: str) -> None:
        """A retryable error for every request not answered yet (the engine cannot answer them)."""
        self._queue.put((None, RequestOutput("", "", True, "abort", error=message, retryable=True)))

    def ticket(self, sender) -> Ticket:
        return Ticket(sender, self._queue)

    def track(self, ticket: Ticket) -> None:
        """Called on execute's thread before the engine sees the sequence, so it precedes its outputs."""
        self._queue.put((ticket, None))

    def _run(self) -> None:
        """One output at a time, and the cancellation questions whenever they are due: while many
        streams keep the queue full, a thread that asked only once it was empty would never ask,
        and a cancelled request would run to its last token."""
        while True:
            try:
                item = self._queue.get(timeout=self._until_next_poll())
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                self._handle(*item)
            if self._next_poll <= time.monotonic() + POLL_GRANULARITY_SECONDS:
                self._poll_cancellations()

    def _handle(self, ticket: Ticket | None, out: RequestOutput | None) -> None:
        if ticket is None:  # fail_all
            for live in list(self._live):
                self._handle(live, out)
            return
        if out is None:
            self._live.add(ticket)
            self._next_poll = min(self._next_poll, ticket.next_poll)
            return
        if ticket not in self._live:
            return  # already answered (or given up on): nothing more goes to this request
        if out.finished:
            self._live.discard(ticket)
        try:
            self._send(ticket, out)
        except Exception as exc:  # the client is gone or the frontend refused: stop its work, carry on
            self._live.discard(ticket)
            if not out.finished:
                self.abandon(ticket.seq, f"the response could not be sent ({exc})")
            message = f"a response to this request could not be sent ({exc}); its generation was stopped"
            with contextlib.suppress(Exception):  # tell the caller, if the channel still works
                self._send(ticket, RequestOutput("", "", True, "error", error=message))

    def _send(self, ticket: Ticket, out: RequestOutput) -> None:
        if ticket.send_fault:
            ticket.send_fault = False
            raise RuntimeError("send failed (injected fault)")
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if out.finished else 0
        ticket.sender.send(self._response(out), flags=final)

    def _until_next_poll(self) -> float | None:
        """How long the thread may sleep: until the first live request is due to be asked about
        cancellation, or until something arrives when none is live. A fixed short poll would wake
        it (and make it take the GIL from the engine's thread) 20 times a second for nothing."""
        if not self._live:
            return None
        return max(self._next_poll - time.monotonic(), POLL_GRANULARITY_SECONDS)

    def _poll_cancellations(self) -> None:
        now = time.monotonic()
        for ticket in [t for t in self._live if t.next_poll <= now + POLL_GRANULARITY_SECONDS]:
            try:
                cancelled, why = ticket.sender.is_cancelled(), "cancelled by the client"
            except Exception as exc:  # asking failed: treat the caller as gone
                cancelled, why = True, f"could not ask whether the request was cancelled ({exc})"
            if cancelled:
                self._live.discard(ticket)
                self.abandon(ticket.seq, why)
            else:
                ticket.poll_interval = min(2 * ticket.poll_interval, CANCEL_POLL_SECONDS)
                ticket.next_poll = now + ticket.poll_interval
        self._next_poll = min((t.next_poll for t in self._live), default=math.inf)

    def _response(self, out: RequestOutput):
        pb = self.pb
        if out.error:
            code = out.code or ("UNAVAILABLE" if out.retryable or out.finish_reason == "abort" else "INTERNAL")
            return pb.InferenceResponse(error=error(pb, out.error, code))
        tensors = [_text(pb, "text_output", out.text)]
        if out.logprobs is not None:
            tensors.append(_text(pb, "logprobs", json.dumps(out.logprobs)))
        if out.finished:  # streamed pieces carry only text; the last response says how it ended
            tensors += [
                _text(pb, "finish_reason", out.finish_reason or ""),
                pb.Tensor("num_input_tokens", np.array([[out.num_input_tokens]], dtype=np.uint32)),
                pb.Tensor("num_output_tokens", np.array([[out.num_output_tokens]], dtype=np.uint32)),
            ]
        return pb.InferenceResponse(output_tensors=tensors)


def error(pb, message: str, code: str):
    """A Triton error whose message starts with its code: Triton's stream protocol carries only the
    message, and clients decide what to retry by the code (client/errors.py)."""
    return pb.TritonError(f"{code}: {message}", getattr(pb.TritonError, code))


def _text(pb, name: str, value: str):
    return pb.Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))
