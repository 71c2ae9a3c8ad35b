"""How much of each engine step is host (Python) work, per sampling mode: `engine-bench` section.

In-process `EngineCore.generate` of `batch` sequences of `max_tokens` tokens each; "runner" is the
time inside the runner's step (the exported graph, including sampling, and the cache write-back),
"host" is the rest of the wall time (scheduling, building the step's inputs, appending tokens,
text and stop strings, responses). The device should never wait for Python: host time should be
a small share of the step.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.output import RequestOutput
from batchstring.engine.sampling_params import SamplingParams
from batchstring.loadtest.workload import mixed

MAX_TOKENS = 64
# Stop strings that a 64-token completion of code does not contain, so that every request runs its
# full length and the cost of looking for them is what is measured.
RARE_STOPS = ("\nclass NeverDefined", "<|stop|>")
MODES: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature 1.0": {"temperature": 1.0},
    "top_k 40": {"temperature": 0.8, "top_k": 40},
    "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "seeded": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
    "stop strings": {"temperature": 0.8, "stop": RARE_STOPS},
    "streaming": {"temperature": 0.8, "stream": True},
}


@dataclass(frozen=True)
class HostResult:
    mode: str
    batch: int
    runner_ms: float  # per step
    host_ms: float  # per step
    steps: int

    @property
    def share(self) -> float:
        return self.host_ms / (self.host_ms + self.runner_ms)

    @property
    def of_runner(self) -> float:
        return self.host_ms / self.runner_ms


class _Pieces:
    """A sink that keeps what a caller would receive (streamed pieces cost what they cost)."""

    def __init__(self) -> None:
        self.received: list[RequestOutput] = []

    def __call__(self, out: RequestOutput) -> None:
        self.received.append(out)


def measure(model_dir: Path, mode: str, batch: int, repeats: int = 3, profile: cProfile.Profile | None = None,
            **engine_args) -> HostResult:
    """Median over `repeats` runs of one engine (warmed up once) at one batch size."""
    options = dict(MODES[mode])
    stream = options.pop("stream", False)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **options)
    engine = EngineCore(EngineConfig(model_dir=model_dir, max_num_seqs=max(64, batch), **engine_args))
    engine.warm_up()
    items = mixed(batch, prompt_tokens=(16, 64), max_tokens=(MAX_TOKENS, MAX_TOKENS), seed=1, model_dir=model_dir)
    runs = []
    for _ in range(repeats):
        sink = _Pieces()
        seqs = [engine.make_sequence(it.prompt, params, sink, stream=stream) for it in items]
        runner0, steps0 = engine.stats.runner_seconds, engine.stats.steps
        if profile:
            profile.enable()
        began = time.perf_counter()
        engine.generate(seqs)
        wall = time.perf_counter() - began
        if profile:
            profile.disable()
        steps = engine.stats.steps - steps0
        runner = engine.stats.runner_seconds - runner0
        runs.append((runner / steps * 1e3, (wall - runner) / steps * 1e3, steps))
    runner_ms, host_ms, steps = (float(np.median([r[i] for r in runs])) for i in range(3))
    return HostResult(mode, batch, runner_ms, host_ms, int(steps))


def sweep(model_dir: Path, batches: tuple[int, ...] = (1, 64), repeats: int = 3, progress=None) -> list[HostResult]:
    results = []
    for mode in MODES:
        for batch in batches:
            results.append(measure(model_dir, mode, batch, repeats))
            if progress:
                progress()
    return results


def profile_host(model_dir: Path, mode: str = "top_p 0.95", batch: int = 64, out: Path | None = None) -> str:
    """cProfile of the engine at one mode and batch size; the 20 functions with most own time."""
    profile = cProfile.Profile()
    measure(model_dir, mode, batch, repeats=2, profile=profile)
    if out:
        profile.dump_stats(str(out))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
    return text.getvalue()
