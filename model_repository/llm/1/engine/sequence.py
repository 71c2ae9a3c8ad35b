"""One request's life in the engine: its tokens, its cache blocks, its text, how it ends."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.sampling import Sampler, SamplingParams
from engine.tokenizer import StreamDecoder


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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


OutputSink = Callable[[RequestOutput], None]
_arrival_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    decoder: StreamDecoder
    stream: bool = False
    include_input: bool = False
    group: int = 0  # the Triton batch it arrived in (static scheduling keeps groups together)
    is_cancelled: Callable[[], bool] = lambda: False
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are in the cache
    status: Status = Status.WAITING
    text: str = ""  # completion text decoded so far (stop strings cut off)
    emitted: int = 0  # characters of `text` already streamed
    responses: int = 0  # outputs handed to the sink so far
    arrival: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_arrival_order))
    first_token_at: float | None = None
    held: RequestOutput | None = None  # static scheduling: finished, but its row stays until the group ends

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_ids(self) -> list[int]:
        """Tokens the next step must feed: the whole prompt at first, then the last sampled one.

        After a preemption the cache is empty again and this is prompt + output: recompute.
        """
        return self.all_ids[self.num_cached :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
