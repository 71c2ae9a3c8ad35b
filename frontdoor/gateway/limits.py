"""What one request may be, and how the front door says no."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from batchstring.client.defaults import MAX_MESSAGE_BYTES

MiB = 2**20
KiB = 2**10
# A request carries its text (JSON may escape some of it) and its parameters besides: room for the
# model's whole text_input twice over, and 64 KiB of the rest (sampling_parameters <= 8 KiB, a
# 32 KiB constraint, names and framing).
ENVELOPE_BYTES = 64 * KiB
# Triton 2.51's HTTP frontend crashes on multi-MB bodies (4 MB did, 2 MB did not; DESIGN.md): the
# routes passed through to it keep this bound whatever the model takes, and long prompts beyond it
# go over gRPC or /v1/completions (which reach Triton over gRPC).
TRITON_HTTP_BYTES = 2 * MiB


@dataclass(frozen=True)
class Limits:
    # Far below the ~2-4 MB at which Triton's HTTP frontend crashes, far above any request the
    # shipped model accepts (text_input is refused beyond 16 KiB, sampling_parameters beyond 8 KiB).
    max_body_bytes: int = 1 * MiB
    max_message_bytes: int = MAX_MESSAGE_BYTES  # one gRPC message (one request of a stream), as the client expects
    max_input_bytes: int = 16 * KiB  # the model's own text_input cap, for the refusals' wording

    @classmethod
    def for_model(cls, model_dir: Path | None, body: int | None = None, message: int | None = None) -> Limits:
        """The defaults, raised where the model takes longer inputs (engine/config.py
        INPUT_BYTES_PER_TOKEN x its context: 512 KiB of text for a 16k-token model), so that the
        front door admits every request the model would; `body`/`message` as configured win."""
        from batchstring.engine.config import INPUT_BYTES_PER_TOKEN

        spec = model_dir / "runtime.json" if model_dir else None
        text = cls.max_input_bytes
        if spec is not None and spec.is_file():
            text = INPUT_BYTES_PER_TOKEN * int(json.loads(spec.read_text())["context_length"])
        needed = 2 * text + ENVELOPE_BYTES
        return cls(body or max(cls.max_body_bytes, needed), message or max(cls.max_message_bytes, needed), text)

    def too_large(self, what: str, limit: int) -> str:
        return (f"{what} is larger than the front door's limit of {limit} bytes ({limit / MiB:g} MiB); "
                f"send one string per request (text_input is at most {self.max_input_bytes} bytes)")
