"""The classic asyncio dynamic batcher: the baseline `batchstring bench` calls `seed-asyncio`.

What a first answer to "batch requests for a GPU" usually looks like: callers put requests on
a queue; one loop takes up to 16 of them (waiting at most 50 ms after the first), runs that batch
to completion, answers everyone, and only then looks at the queue again. It drives the same
runner as the server (through the engine in `static` mode, which runs a batch to completion),
so comparing it with the server compares scheduling, not models.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from batchstring.engine.core import EngineCore
from batchstring.engine.sampling_params import SamplingParams

MAX_BATCH = 16
TIMEOUT_S = 0.050


@dataclass
class _Pending:
    prompt: str
    max_tokens: int
    future: asyncio.Future


class SeedBatcher:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._loop_task: asyncio.Task | None = None

    async def __aenter__(self) -> SeedBatcher:
        self._loop_task = asyncio.create_task(self._batch_loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop_task

    async def infer(self, prompt: str, max_tokens: int) -> str:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(prompt, max_tokens, future))
        return await future

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self.queue.get()]
            deadline = asyncio.get_running_loop().time() + TIMEOUT_S
            while len(batch) < MAX_BATCH:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), remaining))
                except TimeoutError:
                    break
            texts = await asyncio.to_thread(self._run_to_completion, batch)
            for pending, text in zip(batch, texts):
                pending.future.set_result(text)

    def _run_to_completion(self, batch: list[_Pending]) -> list[str]:
        seqs = [self.engine.make_sequence(p.prompt, SamplingParams(max_tokens=p.max_tokens, temperature=0.0,
                                                                   ignore_eos=True), lambda out: None)
                for p in batch]
        self.engine.generate(seqs)
        return [s.output.text for s in seqs]
