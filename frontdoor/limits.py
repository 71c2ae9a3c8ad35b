"""What one request may be, and how the front door says no."""

from __future__ import annotations

from dataclasses import dataclass

from batchstring.client.defaults import MAX_MESSAGE_BYTES

MiB = 2**20


@dataclass(frozen=True)
class Limits:
    # Far below the ~2-4 MB at which Triton's HTTP frontend crashes, far above any request the
    # model accepts (text_input is refused beyond 16 KiB, sampling_parameters beyond 8 KiB).
    max_body_bytes: int = 1 * MiB
    max_message_bytes: int = MAX_MESSAGE_BYTES  # one gRPC message (one request of a stream), as the client expects

    def too_large(self, what: str, limit: int) -> str:
        return (f"{what} is larger than the front door's limit of {limit} bytes ({limit / MiB:g} MiB); "
                "send one string per request (text_input is at most 16 KiB)")
