"""One request's side of the conversation: its text, stop strings, streaming and final answer.

Only requests that need text while they generate (streamed ones, or ones with stop strings) are
detokenised token by token; the others are decoded once, when they finish. Either way the text
is byte-exact (engine/tokenizer.py): a multi-byte character is never split across pieces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.tokenizer import TextCodec


@dataclass(frozen=True)
class RequestOutput:
    """What the engine hands back: a text piece (streaming) or the whole text, and maybe the end."""

    request_id: str
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    retryable: bool = False  # an error the caller may send again (overload, shutdown, a broken engine)
    logprobs: list[dict] | None = None  # one entry per token generated since the last response
    code: str | None = None  # the error's kind when its reason does not say it (INVALID_ARG: a grammar's dead end)


OutputSink = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class OutputStream:
    """Turns a sequence's tokens into what its caller receives, through its sink."""

    def __init__(self, request_id: str, prompt: str, num_input_tokens: int, sink: OutputSink, codec: TextCodec,
                 params: SamplingParams, *, stream: bool = False, include_input: bool = False) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.num_input_tokens = num_input_tokens
        self.sink = sink
        self.codec = codec
        self.params = params
        self.stream = stream
        self.include_input = include_input
        self.decoder = codec.stream_decoder() if stream or params.stop else None
        self.longest_stop = max(map(len, params.stop), default=0)
        self.text = ""  # completion text decoded so far (stop strings cut off)
        self.emitted = 0  # characters of `text` already streamed
        self.responses = 0  # outputs handed to the sink so far
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.sent_logprobs = 0

    @property
    def per_token(self) -> bool:
        """Whether every generated token must come here (text now, or log-probabilities)."""
        return self.decoder is not None or self.logprobs is not None

    def push(self, token: int, generated: int, logprob: TokenLogprob | None) -> bool:
        """Takes one generated token (not an end-of-sequence one); True when a stop string ended it."""
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.decoder is None:
            return False
        before = len(self.text)
        self.text += self.decoder.push(token)
        if self.params.stop and generated > self.params.min_tokens and self._cut_at_stop(before):
            return True
        if self.stream and (piece := self._piece(finished=False)) is not None:
            self.sink(piece)
        return False

    def _cut_at_stop(self, before: int) -> bool:
        """A new match ends in the new piece, which may be long: search from just before it."""
        start = max(0, before - self.longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def final(self, output_ids: list[int], reason: str, error: str | None = None, *, retryable: bool = False,
              ended_by_eos: bool = False, cut: bool = False, code: str | None = None) -> RequestOutput:
        """The last response. `cut`: a stop string ended the text, so nothing held back follows it."""
        if error is None:
            if self.decoder is None:
                self.text = self.codec.decode(output_ids[:-1] if ended_by_eos else output_ids)
            elif not cut:
                self.text += self.decoder.flush()
        out = self._piece(finished=True, reason=reason, error=error, retryable=retryable,
                          num_output_tokens=len(output_ids))
        return dataclasses.replace(out, code=code) if code else out

    def _piece(self, finished: bool, reason: str | None = None, error: str | None = None, retryable: bool = False,
               num_output_tokens: int = 0) -> RequestOutput | None:
        """What is safe to show now: text that may still become a stop string is held back."""
        piece = ""
        if error is None:
            hold = 0 if finished else max(0, self.longest_stop - 1)
            end = max(self.emitted, len(self.text) - hold)
            piece = self.text[self.emitted : end] if self.stream else self.text
            self.emitted = end
            if self.include_input and not self.responses:
                piece = self.prompt + piece
            if not piece and not finished:
                return None
        logprobs = None
        if self.logprobs is not None:
            logprobs = [_entry(e, self.codec) for e in self.logprobs[self.sent_logprobs :]]
            self.sent_logprobs = len(self.logprobs)
        self.responses += 1
        return RequestOutput(self.request_id, piece, finished, reason, self.num_input_tokens, num_output_tokens,
                             error, retryable, logprobs)

    def deliver(self, out: RequestOutput) -> None:
        """The sink only hands the output on (model.py's queues it for the responder thread, which
        alone talks to Triton), so it does not fail here."""
        self.sink(out)


def _entry(e: TokenLogprob, codec: TextCodec) -> dict:
    return {"token_id": e.token_id, "token": codec.token_text(e.token_id), "logprob": e.logprob,
            "top_logprobs": [{"token_id": i, "token": codec.token_text(i), "logprob": lp} for i, lp in e.top]}
