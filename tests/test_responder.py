"""The model's responder thread on its own: when it asks about cancellation.

The responder only queues and sends; what it sends through is Triton's response sender, which
the end-to-end tests (tests/test_faults.py) use for real. Here a recording sender stands in for
it, so that the thread can be kept busier than any server here would keep it.
"""

from __future__ import annotations

import importlib.util
import time
from types import SimpleNamespace

from batchstring.engine.output import RequestOutput
from batchstring.export.layout import MODEL_VERSION_DIR


def _load_responder():
    spec = importlib.util.spec_from_file_location("responder", MODEL_VERSION_DIR / "responder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


responder_module = _load_responder()


PB = SimpleNamespace(
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
    InferenceResponse=lambda **fields: fields,
    Tensor=lambda name, value: (name, value),
)


class Sender:
    """Records what is sent; each send takes `send_seconds`, as an IPC round trip does."""

    def __init__(self, send_seconds: float = 0.0, cancelled: bool = False) -> None:
        self.send_seconds = send_seconds
        self.cancelled = cancelled
        self.sent = 0
        self.asked = 0

    def send(self, response, flags: int = 0) -> None:
        time.sleep(self.send_seconds)
        self.sent += 1

    def is_cancelled(self) -> bool:
        self.asked += 1
        return self.cancelled


def test_a_cancelled_request_is_noticed_while_the_queue_never_empties():
    """Outputs of a busy request arrive faster than they can be sent, so the queue is never empty;
    a request whose client cancelled must still be asked about, and stopped, on its schedule."""
    abandoned: list[str] = []
    responder = responder_module.Responder(PB, lambda seq, why: abandoned.append(why))
    responder.start()
    busy, gone = responder.ticket(Sender(send_seconds=0.002)), responder.ticket(Sender(cancelled=True))
    responder.track(busy)
    responder.track(gone)
    piece = RequestOutput("x", "x", False, None)
    deadline = time.monotonic() + 5 * responder_module.FIRST_POLL_SECONDS + 1
    while not abandoned and time.monotonic() < deadline:
        for _ in range(10):  # ten pieces each 2 ms: twice what the sender can send
            busy(piece)
        time.sleep(0.01)
    backlog = responder._queue.qsize()
    responder.stop(timeout=30)
    assert backlog > 0, "the test did not keep the responder's queue full"
    assert abandoned == ["cancelled by the client"]
    assert gone.sender.sent == 0


def test_a_finished_request_is_never_asked_about():
    """Each question costs an IPC round trip: only requests still running are asked."""
    responder = responder_module.Responder(PB, lambda seq, why: None)
    responder.start()
    live, done = responder.ticket(Sender()), responder.ticket(Sender())
    responder.track(live)
    responder.track(done)
    done(RequestOutput("x", "x", True, "length"))
    time.sleep(3 * responder_module.FIRST_POLL_SECONDS)
    responder.stop(timeout=30)
    assert done.sender.asked == 0 and done.sender.sent == 1
    assert live.sender.asked >= 1
