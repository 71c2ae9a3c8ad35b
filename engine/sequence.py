"""One request's token and cache state: what the scheduler schedules and the step computes.

Everything about talking back to the caller (text, stop strings, streaming, the sink) lives in
the request's `OutputStream` (engine/output.py); a sequence only points at it.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from batchstring.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # both import the sequence's module; a sequence only points at them
    from batchstring.engine.adapters import Adapter
    from batchstring.engine.grammar import Constraint
    from batchstring.engine.output import OutputStream


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output: OutputStream | None = None  # what its caller receives (None: a throw-away probe)
    constraint: Constraint | None = None  # its grammar's state (structured output), if it has one
    group: int = 0  # the Triton batch it arrived in (static scheduling keeps groups together)
    deadline: float | None = None  # time.monotonic() after which nobody will read the answer
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its leading full blocks (a memo)
    committed: int = 0  # leading blocks it has made findable in the prefix cache
    dropped: int = 0  # leading blocks it gave up, outside every layer's sliding window
    priority: int = 1  # 1: interactive; higher: background (Batch API lines), which gives way to 1
    cache_salt: bytes = b""  # keys its prefix-cache blocks: only sequences with the same salt share them
    row: int | None = None  # its row in the block manager's table while it holds blocks
    num_computed: int = 0  # computed tokens (vLLM's num_computed_tokens): the leading ones whose K/V are in the cache
    status: Status = Status.WAITING
    order: int = field(default_factory=lambda: next(_arrival_order))
    first_token_at: float | None = None
    padding: bool = False  # static batching: finished, its row computes on until its batch ends
    rng: np.random.Generator | None = None  # a seeded request's own stream (engine/randomness.py draws from it)
    adapter: Adapter | None = None  # the LoRA adapter its rows run with (engine/adapters.py)
    adapter_slot: int = -1  # that adapter's slot while it runs (-1: none)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return tuple(self.prompt_ids[start:end])
        return tuple(self.all_ids[start:end])

    def token_at(self, index: int) -> int:
        prompt = len(self.prompt_ids)
        return self.prompt_ids[index] if index < prompt else self.output_ids[index - prompt]

    def pending_ids(self, count: int) -> list[int]:
        """The next `count` tokens the step must feed (after a preemption: prompt and output again)."""
        start = self.num_computed
        prompt = len(self.prompt_ids)
        if start + count <= prompt:
            return self.prompt_ids[start : start + count]
        return self.all_ids[start : start + count]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
