"""Long contexts at the cost of what they hold: `engine-bench` sections `long` and `ops`.

- decode: the runner's step time for 64 decoding rows of `short` past tokens, and for 63 of them
  with one row of L past tokens instead, at each L, beside the ratio of the two batches' context
  sums. Rows are set up as a prefill would leave them (blocks taken, past counted; the cache's
  contents do not change what a step costs), so an L of 32k needs no 32k-token prefill. The two
  cases run in separate runs taking turns (short, mixed, short, mixed, ...), medians of runs.
- host: building a step's inputs (engine/batch.py) for 64 decoding rows of 16k past tokens
  against 64 rows of 256, taking turns: what the host does per step must not grow with context.
- ops: operators one decode step runs, per runtime, at batch 1 and 64: ONNX Runtime's executed
  nodes (its profiler) and TorchScript's top-level aten operators (torch's profiler).

The model is a random checkpoint of the shipped shape with a 32k context (export/synthetic.py),
exported once under results/long-context/.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.batch import Work, build_step
from batchstring.engine.block_manager import BlockManager
from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence

LONG_CONTEXT = 32768
LENGTHS = (4096, 15000, 16384, 32767)  # L: 4k, 15k, 16k, the whole 32k context
SHORT = 97  # the short rows' past: 97-token prompts, a typical short request
ROWS = 64
GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass(frozen=True)
class DecodeRatio:
    long: int
    short_ms: float
    mixed_ms: float
    sum_ratio: float  # the mixed batch's context sum over the short batch's

    @property
    def ratio(self) -> float:
        return self.mixed_ms / self.short_ms


@dataclass(frozen=True)
class HostRatio:
    long: int
    short: int
    long_us: float
    short_us: float

    @property
    def ratio(self) -> float:
        return self.long_us / self.short_us


def long_model(path: Path | None = None) -> Path:
    """The exported long-context model: `path` if given, else built once under results/."""
    if path:
        return path
    root = Path("results") / "long-context"
    exported = root / "exported"
    if not (exported / "runtime.json").exists():
        from batchstring.export.exporter import export_model
        from batchstring.export.synthetic import random_checkpoint, small_llama_config

        checkpoint = random_checkpoint(root / "checkpoint", small_llama_config(4096,
                                                                               max_position_embeddings=LONG_CONTEXT))
        export_model(checkpoint, exported, dtype="float32")
    return exported


def decoding(blocks: BlockManager, pasts: list[int]) -> list[Work]:
    """Sequences that have computed `past` tokens each and decode their next one."""
    work = []
    for i, past in enumerate(pasts):
        seq = Sequence(f"row-{i}", [1 + (i + j) % 97 for j in range(past + 1)], GREEDY)
        blocks.grow(seq, past + 1)
        seq.num_computed = past
        work.append(Work(seq, 1))
    return work


def _release(blocks: BlockManager, work: list[Work]) -> None:
    for w in work:
        blocks.release(w.seq)


def taking_turns(cases: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each case's median over `repeats` runs, the cases' runs alternating."""
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, run in cases.items():
            runs[name].append(run())
    return {name: float(np.median(values)) for name, values in runs.items()}


def step_ms(engine: EngineCore, pasts: list[int], steps: int, progress=None) -> Callable[[], float]:
    """One run: decoding rows of these pasts set up, a step run once to warm up, then the median
    runner time of `steps` steps, in milliseconds; the rows are released after."""
    blocks = engine.scheduler.blocks
    group = max(1, engine.spec.num_heads // engine.spec.num_kv_heads)

    def run() -> float:
        work = decoding(blocks, pasts)
        batch = build_step(work, blocks, query_group=group)
        engine.runner.step(batch)  # a first step's allocations are nobody's result
        timings = []
        for _ in range(steps):
            began = time.perf_counter()
            engine.runner.step(batch)
            timings.append(time.perf_counter() - began)
        _release(blocks, work)
        if progress:
            progress()
        return float(np.median(timings)) * 1e3
    return run


def decode_ratios(model_dir: Path, lengths: tuple[int, ...] = LENGTHS, repeats: int = 5, steps: int = 8,
                  runtime: str = "onnxruntime", progress=None) -> list[DecodeRatio]:
    cache = ROWS * (SHORT + 32) + max(lengths) + 64
    engine = EngineCore(EngineConfig(model_dir=model_dir, runtime=runtime, kv_cache_tokens=cache,
                                     max_num_seqs=ROWS, max_num_batched_tokens=max(512, ROWS)))
    results = []
    for long in lengths:
        short, mixed = [SHORT] * ROWS, [SHORT] * (ROWS - 1) + [long]
        ms = taking_turns({"short": step_ms(engine, short, steps, progress),
                            "mixed": step_ms(engine, mixed, steps, progress)}, repeats)
        results.append(DecodeRatio(long, ms["short"], ms["mixed"], sum(mixed) / sum(short)))
    return results


def host_ratio(long: int = 16384, short: int = 256, block_size: int = 16, repeats: int = 5,
               builds: int = 200) -> HostRatio:
    """Microseconds to build one decode step's inputs, 64 rows of `long` against 64 of `short`."""
    blocks = BlockManager(ROWS * (-(-(long + 1) // block_size)) + 1, block_size, ROWS, long + 1)

    def build_us(past: int) -> Callable[[], float]:
        def run() -> float:
            work = decoding(blocks, [past] * ROWS)
            random = RandomStreams(0)
            build_step(work, blocks, random, query_group=2)
            began = time.perf_counter()
            for _ in range(builds):
                build_step(work, blocks, random, query_group=2)
            elapsed = (time.perf_counter() - began) / builds * 1e6
            _release(blocks, work)
            return elapsed
        return run

    us = taking_turns({"long": build_us(long), "short": build_us(short)}, repeats)
    return HostRatio(long, short, us["long"], us["short"])


def operators(model_dir: Path, batches: tuple[int, ...] = (1, 64), past: int = 128) -> dict[str, dict[int, int]]:
    """Operators one decode step runs: ONNX Runtime's executed nodes (both of its graphs: a step
    of at most 16 tokens runs the small-step one) and TorchScript's top-level aten operators."""
    counts: dict[str, dict[int, int]] = {}
    for runtime in ("onnxruntime", "torchscript"):
        engine = EngineCore(EngineConfig(model_dir=model_dir, runtime=runtime, kv_cache_tokens=max(batches) * 256,
                                         max_num_seqs=max(batches)))
        blocks = engine.scheduler.blocks
        counts[runtime] = {}
        for batch in batches:
            work = decoding(blocks, [past] * batch)
            step = build_step(work, blocks)
            counts[runtime][batch] = (_onnx_nodes(model_dir, engine, step) if runtime == "onnxruntime"
                                      else _aten_operators(engine, step))
            _release(blocks, work)
    return counts


def _onnx_nodes(model_dir: Path, engine: EngineCore, step) -> int:
    import onnxruntime as ort

    from batchstring.export.contract import FETCHED
    from batchstring.export.layout import SMALL_STEP_GRAPH

    small = step.inputs.single_group and (model_dir / SMALL_STEP_GRAPH).exists()
    graph = SMALL_STEP_GRAPH if small else "model.onnx"
    runner = engine.runner
    with tempfile.TemporaryDirectory() as scratch:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "step")
        session = ort.InferenceSession(str(model_dir / graph), options, providers=["CPUExecutionProvider"])
        session.run(FETCHED, step.inputs.feeds(runner.held(step.table.array)))
        trace = json.loads(Path(session.end_profiling()).read_text())
    return sum(1 for event in trace if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"))


def _aten_operators(engine: EngineCore, step) -> int:
    import torch

    engine.runner.step(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.runner._run(step.inputs, step.table)
    return sum(1 for event in profile.events() if event.name.startswith("aten::") and not _under_aten(event))


def _under_aten(event) -> bool:
    """Whether an operator ran inside another aten operator (not one the step itself calls)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False
