"""Long-prompt interference, in-process: what a long prefill costs the sequences that are decoding.

The engine runs on its own thread, as in the server. `decoders` sequences stream continuously
(32-token prompts, 256-448 new tokens each: long generations, finishing at different times; a new
one as soon as one finishes) while a 450-token prompt (32 new tokens) arrives every `every` seconds
(0.5 s by default: a p99 only sees what touches more than 1% of the decoders' tokens, and one
long prompt stalls each decoder once). The inter-token latency of the decoding sequences is
the gap between two consecutive streamed pieces, timestamped in the sink (no client, no network:
only scheduling shows). Chunked prefill on vs off, taking turns; medians over repeats.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.config import EngineConfig
from batchstring.engine.output import RequestOutput
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.serving import ServingEngine
from batchstring.loadtest.workload import mixed

LONG = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class Interference:
    chunked: bool
    tokens_per_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    long_prompts: int


class _Decoders:
    """Keeps `count` decoding sequences alive; records the gaps between their pieces."""

    def __init__(self, engine: ServingEngine, items: list, count: int, until: float) -> None:
        self.engine, self.items, self.until = engine, items, until
        self.last: dict[str, float] = {}
        self.gaps: list[float] = []
        self.tokens = 0
        self.live = count
        self.done = threading.Event()
        self._next = 0
        for _ in range(count):
            self._start()

    def _start(self) -> None:
        item = self.items[self._next % len(self.items)]
        self._next += 1
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.submit(self.engine.core.make_sequence(item.prompt, params, self, stream=True))

    def __call__(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.request_id in self.last:
            self.gaps.append(now - self.last[out.request_id])
        self.last[out.request_id] = now
        if out.finished:
            self.tokens += out.num_output_tokens
            if time.perf_counter() < self.until:
                self._start()
            else:
                self.live -= 1
                if not self.live:
                    self.done.set()


def measure(model_dir: Path, chunked: bool, decoders: int = 32, every: float = 0.5, seconds: float = 15.0,
            **engine_args) -> Interference:
    engine = ServingEngine(EngineConfig(model_dir=model_dir, enable_chunked_prefill=chunked, **engine_args))
    engine.core.warm_up()
    short = mixed(256, prompt_tokens=(32, 32), max_tokens=(256, 448), seed=2, model_dir=model_dir)
    long = [i.prompt for i in mixed(32, prompt_tokens=(450, 450), max_tokens=(32, 32), seed=3, model_dir=model_dir)]
    long_done: list[int] = []
    engine.start()
    began = time.perf_counter()
    traffic = _Decoders(engine, short, decoders, began + seconds)
    count = 0

    def finished(out: RequestOutput) -> None:
        if out.finished:
            long_done.append(out.num_output_tokens)

    while time.perf_counter() < began + seconds - every:
        time.sleep(every)
        engine.submit(engine.core.make_sequence(long[count % len(long)], LONG, finished))
        count += 1
    traffic.done.wait()
    while len(long_done) < count:
        time.sleep(0.01)
    elapsed = time.perf_counter() - began
    engine.stop()
    gaps = np.array(traffic.gaps) * 1e3
    return Interference(chunked, (traffic.tokens + sum(long_done)) / elapsed, float(np.percentile(gaps, 50)),
                        float(np.percentile(gaps, 99)), float(gaps.max()), count)


def compare(model_dir: Path, repeats: int = 3, progress=None, **kwargs) -> list[Interference]:
    runs: dict[bool, list[Interference]] = {True: [], False: []}
    for _ in range(repeats):
        for chunked in (True, False):
            runs[chunked].append(measure(model_dir, chunked, **kwargs))
            if progress:
                progress()
    return [Interference(c, *(float(np.median([getattr(r, f) for r in rs]))
                              for f in ("tokens_per_s", "itl_p50_ms", "itl_p99_ms", "itl_max_ms")),
                         rs[0].long_prompts) for c, rs in runs.items()]
