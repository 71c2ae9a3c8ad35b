"""`batchstring bench`: the served-throughput sweep, with baselines, in one run on the same items.

For each client concurrency (closed loop: each virtual caller sends its next string as soon as
its previous one completes) it measures output tokens/s, requests/s, latency percentiles and
time to first token for:

  no-batching   tritonserver, dynamic batching off, engine limited to 1 sequence
  static        tritonserver, dynamic batching, request-level (run-to-completion) engine
  continuous    tritonserver, dynamic batching, continuous-batching engine (the default)
  seed-asyncio  the classic asyncio batcher (16 / 50 ms, one batch at a time), in-process
  hf-generate   Hugging Face `generate` on padded batches of `concurrency` prompts, in-process
  ceiling       the bare runner: output tokens / runner-busy seconds of the in-process
                continuous engine at the same concurrency (the batch sizes the server ran)

Served systems are called through the project's own AsyncBatchClient: `batchstring([prompt])`
like users do, except every STREAM_EVERY-th request, which streams and supplies the TTFT samples
(streaming every request would measure per-token response overhead on a 2-core machine where the
callers share the cores, more than it measures batching).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from tqdm import tqdm

from client import AsyncBatchClient
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from export.layout import MODEL_VERSION_DIR
from loadtest.workload import Item, mixed
from server.local import LocalServer
from server.stats import batch_stats, metrics

CONCURRENCY = (1, 4, 16, 64)
STREAM_EVERY = 4
SERVED = {
    "no-batching": {"params": {"max_num_seqs": "1"}, "edit": lambda c: c.ClearField("dynamic_batching")},
    "static": {"params": {"scheduling": "static"}},
    "continuous": {"params": {}},
}
SYSTEMS = ("no-batching", "static", "continuous", "seed-asyncio", "hf-generate", "ceiling")


@dataclass
class Point:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    requests_per_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    ttft_p50_s: float | None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    latency: float
    ttft: float | None
    tokens: int


def summarize(system: str, concurrency: int, samples: list[Sample], seconds: float, **extra) -> Point:
    lat = np.array([s.latency for s in samples])
    ttft = [s.ttft for s in samples if s.ttft is not None]
    tokens = sum(s.tokens for s in samples)
    return Point(system, concurrency, len(samples), tokens, seconds, tokens / seconds, len(samples) / seconds,
                 *(float(np.percentile(lat, q)) for q in (50, 90, 99)),
                 float(np.percentile(ttft, 50)) if ttft else None, extra)


async def closed_loop(call: Callable[[int, Item], Awaitable[float | None]], items: list[Item],
                      concurrency: int) -> tuple[list[Sample], float]:
    """`concurrency` callers share the item list; `call(index, item)` returns the TTFT (or None)."""
    queue = list(reversed(list(enumerate(items))))
    samples: list[Sample] = []

    async def caller() -> None:
        while queue:
            index, item = queue.pop()
            began = time.perf_counter()
            ttft = await call(index, item)
            samples.append(Sample(time.perf_counter() - began, ttft, item.max_tokens))

    began = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return samples, time.perf_counter() - began


def served_points(name: str, items_for: Callable[[int], list[Item]], levels: tuple[int, ...],
                  bar: tqdm) -> list[Point]:
    spec = SERVED[name]
    with LocalServer(config="cpu", params=spec["params"], edit=spec.get("edit")) as server:
        async def sweep() -> list[Point]:
            points = []
            async with AsyncBatchClient(server.grpc_url, max_in_flight=512) as client:
                async def call(index: int, item: Item) -> float | None:
                    if index % STREAM_EVERY:
                        await client.batchstring([item.prompt], max_tokens=item.max_tokens, ignore_eos=True)
                        return None
                    began = time.perf_counter()
                    first = None
                    async for _ in client.stream(item.prompt, max_tokens=item.max_tokens, ignore_eos=True):
                        first = first or time.perf_counter() - began
                    return first

                await closed_loop(call, items_for(4)[:4], 4)  # warm-up
                for c in levels:
                    before, m0 = batch_stats(server.grpc_url), metrics(server.metrics_url)
                    samples, seconds = await closed_loop(call, items_for(c), c)
                    stats, m1 = batch_stats(server.grpc_url) - before, metrics(server.metrics_url)
                    steps = m1["batchstring_steps_total"] - m0.get("batchstring_steps_total", 0)
                    seqs = m1["batchstring_step_sequences_total"] - m0.get("batchstring_step_sequences_total", 0)
                    points.append(summarize(name, c, samples, seconds, triton_batch=stats.average_batch,
                                            triton_queue_ms=stats.average_queue_ms,
                                            engine_step_batch=seqs / steps if steps else 0.0))
                    bar.update()
            return points

        return asyncio.run(sweep())


def seed_points(items_for, levels, bar) -> list[Point]:
    from loadtest.seed_batcher import SeedBatcher

    engine = Engine(EngineConfig(model_dir=MODEL_VERSION_DIR, scheduling="static"))
    points = []
    for c in levels:
        async def run(c=c):
            async with SeedBatcher(engine) as batcher:
                async def call(index: int, item: Item) -> None:
                    await batcher.infer(item.prompt, item.max_tokens)

                return await closed_loop(call, items_for(c), c)

        samples, seconds = asyncio.run(run())
        points.append(summarize("seed-asyncio", c, samples, seconds))
        bar.update()
    return points


def hf_points(items_for, levels, bar) -> list[Point]:
    from loadtest.hf_generate import HFGenerate

    hf = HFGenerate()
    points = []
    for c in levels:
        timings = hf.run(items_for(c), batch=c)
        samples = [Sample(t.seconds, None, item.max_tokens) for t in timings for item in t.items]
        points.append(summarize("hf-generate", c, samples, sum(t.seconds for t in timings)))
        bar.update()
    return points


def ceiling_points(items_for, levels, bar) -> list[Point]:
    """The in-process continuous engine at the same concurrency, timed at the runner only."""
    points = []
    for c in levels:
        engine = Engine(EngineConfig(model_dir=MODEL_VERSION_DIR))
        busy = [0.0]
        step = engine.runner.step

        def timed(batch, step=step, busy=busy):
            began = time.perf_counter()
            try:
                return step(batch)
            finally:
                busy[0] += time.perf_counter() - began

        engine.runner.step = timed
        items = items_for(c)
        pending = list(reversed(items))
        live = []
        while pending or live:
            while pending and len(live) < c:
                item = pending.pop()
                seq = engine.make_sequence(item.prompt, SamplingParams(max_tokens=item.max_tokens, temperature=0.0,
                                                                       ignore_eos=True), lambda out: None)
                engine.scheduler.add(seq)
                live.append(seq)
            engine.step()
            live = [s for s in live if not s.finished]
        samples = [Sample(0.0, None, item.max_tokens) for item in items]
        point = summarize("ceiling", c, samples, busy[0], engine_step_batch=engine.stats.step_seqs / engine.stats.steps)
        point.p50_s = point.p90_s = point.p99_s = float("nan")  # a throughput reference, not a latency
        points.append(point)
        bar.update()
    return points


def run(args: argparse.Namespace) -> int:
    console = Console()
    levels = CONCURRENCY
    per_level = (lambda c: max(8, c)) if args.quick else (lambda c: max(16, 2 * c))
    max_tokens = (16, 48) if args.quick else (16, 128)
    pool = mixed(2 * max(levels) + 16, max_tokens=max_tokens, seed=args.seed)

    def items_for(c: int) -> list[Item]:
        return pool[: per_level(c)]

    out_dir = args.out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = [s for s in SYSTEMS if not args.systems or s in args.systems]
    bar = tqdm(total=len(systems) * len(levels), desc="bench", unit="point")
    points: list[Point] = []
    started = time.monotonic()
    for system in systems:
        bar.set_postfix(system=system)
        if system in SERVED:
            points += served_points(system, items_for, levels, bar)
        else:
            points += {"seed-asyncio": seed_points, "hf-generate": hf_points, "ceiling": ceiling_points}[system](
                items_for, levels, bar)
    bar.close()
    from loadtest.report import markdown_table, plot

    meta = {"command": " ".join(["batchstring", "bench", *(["--quick"] if args.quick else [])]),
            "seconds": round(time.monotonic() - started, 1), "machine": machine(), "max_tokens": max_tokens,
            "prompt_tokens": (8, 200), "requests_per_level": {c: per_level(c) for c in levels}}
    (out_dir / "bench.json").write_text(json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=2))
    table = markdown_table(points)
    (out_dir / "bench.md").write_text(table + "\n")
    plot(points, out_dir)
    console.print(table)
    console.print(f"\nwrote {out_dir}/bench.json, bench.md, throughput.png, latency.png in {meta['seconds']:.0f} s")
    return 0


def machine() -> dict:
    import os

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests (about 2 minutes)")
    p.add_argument("--systems", nargs="*", choices=SYSTEMS, help="measure only these (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default: results/bench-<time>)")
