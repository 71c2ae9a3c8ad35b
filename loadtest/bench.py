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
  continuous-sampled, ceiling-sampled
                the same two with sampled requests (temperature 1.0, top_p 0.95), as most real
                traffic is; the others are greedy

The sweep measures batching, not caching: every engine in it runs with its prefix cache off. Each
level replays the items of the levels before it, and each repeat its own, which a server with the
cache on (the shipped default) would find cached while HF generate and the ceiling compute them
all. The prompt tokens each served system found cached since it started are read from its metrics
and reported (`prefix_hit_tokens`, 0); `--scenario shared-prefix` measures the cache.

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

from batchstring.client import AsyncBatchClient
from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.sampling_params import SamplingParams
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest.workload import Item, mixed
from batchstring.server.local import LocalServer
from batchstring.server.stats import batch_stats, metrics, settled_metrics

CONCURRENCY = (1, 4, 16, 64)
STREAM_EVERY = 4
SAMPLED = {"temperature": 1.0, "top_p": 0.95}
GREEDY = {"temperature": 0.0}
NO_PREFIX_CACHE = {"enable_prefix_caching": False}  # every engine of the sweep (module docstring)
SERVED = {
    "no-batching": {"params": {"max_num_seqs": "1"}, "edit": lambda c: c.ClearField("dynamic_batching")},
    "static": {"params": {"scheduling": "static"}},
    "continuous": {"params": {}},
    "continuous-sampled": {"params": {}, "sampling": SAMPLED},
}
SYSTEMS = ("no-batching", "static", "continuous", "continuous-sampled", "seed-asyncio", "hf-generate", "ceiling",
           "ceiling-sampled")


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


def summarize(system: str, concurrency: int, runs: list[tuple[list[Sample], float]], **extra) -> Point:
    """Median throughput over repeated runs; latency percentiles over all their requests."""
    samples = [s for run, _ in runs for s in run]
    lat = np.array([s.latency for s in samples])
    ttft = [s.ttft for s in samples if s.ttft is not None]
    rates = [sum(s.tokens for s in run) / seconds for run, seconds in runs]
    tokens_per_s = float(np.median(rates))
    requests = len(runs[0][0])
    return Point(system, concurrency, requests, sum(s.tokens for s in runs[0][0]),
                 float(np.median([seconds for _, seconds in runs])), tokens_per_s,
                 float(np.median([len(run) / seconds for run, seconds in runs])),
                 *(float(np.percentile(lat, q)) for q in (50, 90, 99)),
                 float(np.percentile(ttft, 50)) if ttft else None, {**extra, "repeats": len(runs)})


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


class Served:
    """A tritonserver variant, called through AsyncBatchClient."""

    def __init__(self, name: str, queue_delay_us: int | None) -> None:
        spec = SERVED[name]
        self.sampling = spec.get("sampling", GREEDY)

        def edit(config) -> None:
            if "edit" in spec:
                spec["edit"](config)
            elif queue_delay_us is not None:
                config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us

        params = spec["params"] | {name: str(value).lower() for name, value in NO_PREFIX_CACHE.items()}
        self.server = LocalServer(config="cpu", params=params, edit=edit).start()
        self.extra: dict[str, list[float]] = {}

    async def _run(self, items: list[Item], concurrency: int) -> tuple[list[Sample], float]:
        async with AsyncBatchClient(self.server.grpc_url, max_in_flight=512) as client:
            async def call(index: int, item: Item) -> float | None:
                if index % STREAM_EVERY:
                    await client.batchstring([item.prompt], max_tokens=item.max_tokens, ignore_eos=True,
                                             **self.sampling)
                    return None
                began = time.perf_counter()
                first = None
                async for _ in client.stream(item.prompt, max_tokens=item.max_tokens, ignore_eos=True,
                                             **self.sampling):
                    first = first or time.perf_counter() - began
                return first

            return await closed_loop(call, items, concurrency)

    def measure(self, items: list[Item], concurrency: int) -> tuple[list[Sample], float]:
        url, murl = self.server.grpc_url, self.server.metrics_url
        before, m0 = batch_stats(url), metrics(murl)
        result = asyncio.run(self._run(items, concurrency))
        stats, m1 = batch_stats(url) - before, settled_metrics(murl)
        steps = m1["batchstring_steps_total"] - m0.get("batchstring_steps_total", 0)
        seqs = m1["batchstring_step_sequences_total"] - m0.get("batchstring_step_sequences_total", 0)
        self.extra = {"triton_batch": stats.average_batch, "triton_queue_ms": stats.average_queue_ms,
                      "engine_step_batch": seqs / steps if steps else 0.0,
                      # since the server started: every level and repeat so far
                      "prefix_hit_tokens": m1.get("batchstring_prefix_cache_hits_total", 0.0)}
        return result

    def close(self) -> None:
        self.server.close()


class SeedAsyncio:
    """The classic asyncio batcher in-process (loadtest/seed_batcher.py)."""

    def __init__(self) -> None:
        self.engine = EngineCore(EngineConfig(model_dir=MODEL_VERSION_DIR, scheduling="static", **NO_PREFIX_CACHE))
        self.extra: dict = {}

    def measure(self, items: list[Item], concurrency: int) -> tuple[list[Sample], float]:
        from batchstring.loadtest.seed_batcher import SeedBatcher

        async def run():
            async with SeedBatcher(self.engine) as batcher:
                async def call(index: int, item: Item) -> None:
                    await batcher.infer(item.prompt, item.max_tokens)

                return await closed_loop(call, items, concurrency)

        return asyncio.run(run())

    def close(self) -> None:
        pass


class HFGenerateSystem:
    """Padded static batches of `concurrency` prompts through Hugging Face generate."""

    def __init__(self) -> None:
        from batchstring.loadtest.hf_generate import HFGenerate

        self.hf = HFGenerate()
        self.extra: dict = {}

    def measure(self, items: list[Item], concurrency: int) -> tuple[list[Sample], float]:
        timings = self.hf.run(items, batch=concurrency)
        samples = [Sample(t.seconds, None, item.max_tokens) for t in timings for item in t.items]
        return samples, sum(t.seconds for t in timings)

    def close(self) -> None:
        pass


class Ceiling:
    """The in-process continuous engine at the same concurrency, timed at the runner only:
    output tokens / seconds the runner was busy, at the batch sizes this scheduler forms."""

    def __init__(self, sampling: dict = GREEDY) -> None:
        self.sampling = sampling
        self.extra: dict = {}

    def measure(self, items: list[Item], concurrency: int) -> tuple[list[Sample], float]:
        engine = EngineCore(EngineConfig(model_dir=MODEL_VERSION_DIR, **NO_PREFIX_CACHE))
        pending, live = list(reversed(items)), []
        while pending or live:
            while pending and len(live) < concurrency:
                item = pending.pop()
                params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, **self.sampling)
                seq = engine.make_sequence(item.prompt, params, lambda out: None)
                engine.add(seq)
                live.append(seq)
            engine.step()
            live = [s for s in live if not s.finished]
        self.extra = {"engine_step_batch": engine.stats.step_seqs / engine.stats.steps}
        return [Sample(float("nan"), None, item.max_tokens) for item in items], engine.stats.runner_seconds

    def close(self) -> None:
        pass


def build(system: str, args: argparse.Namespace):
    if system in SERVED:
        return Served(system, args.queue_delay_us)
    return {"seed-asyncio": SeedAsyncio, "hf-generate": HFGenerateSystem, "ceiling": Ceiling,
            "ceiling-sampled": lambda: Ceiling(SAMPLED)}[system]()


def run_scenario(args: argparse.Namespace) -> int:
    from batchstring.loadtest import scenarios

    console = Console(width=160)
    repeats = args.repeats or 5
    out_dir = args.out or Path("results") / time.strftime(f"bench-{args.scenario}-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=2 * repeats, desc=args.scenario, unit="run")
    started = time.monotonic()
    from batchstring.server.serve import parse_params

    outcomes = scenarios.run_scenario(args.scenario, repeats, args.seed, progress=bar.update,
                                      params=parse_params(args.param))
    bar.close()
    table = scenarios.markdown(args.scenario, outcomes)
    command = " ".join(["batchstring bench --scenario", args.scenario, *(f"--param {p}" for p in args.param)])
    meta = {"command": command, "repeats": repeats, "machine": machine(),
            "seconds": round(time.monotonic() - started, 1)}
    (out_dir / "scenario.json").write_text(json.dumps({"meta": meta, "outcomes": [asdict(o) for o in outcomes]},
                                                      indent=2))
    (out_dir / "scenario.md").write_text(table + "\n")
    console.print(table)
    console.print(f"\nwrote {out_dir}/scenario.json, scenario.md in {meta['seconds']:.0f} s")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.scenario != "sweep":
        return run_scenario(args)
    console = Console(width=160)
    levels = CONCURRENCY
    per_level = (lambda c: max(8, c)) if args.quick else (lambda c: max(16, 2 * c))
    max_tokens = (16, 48) if args.quick else (16, 128)
    repeats = args.repeats or (1 if args.quick else 2)
    pool = mixed(2 * max(levels) + 16, max_tokens=max_tokens, seed=args.seed)
    out_dir = args.out or Path("results") / time.strftime("bench-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [s for s in SYSTEMS if not args.systems or s in args.systems]
    started = time.monotonic()
    with console.status(f"starting {', '.join(names)}..."):
        systems = {name: build(name, args) for name in names}
    points: list[Point] = []
    bar = tqdm(total=len(names) * len(levels) * repeats, desc="bench", unit="run")
    try:
        # Systems take turns at each level, repeat after repeat, so a slow spell of a noisy
        # machine lands on all of them rather than on one.
        for c in levels:
            runs: dict[str, list] = {name: [] for name in names}
            extras: dict[str, dict] = {}
            for _ in range(repeats):
                for name, system in systems.items():
                    bar.set_postfix(concurrency=c, system=name)
                    runs[name].append(system.measure(pool[: per_level(c)], c))
                    extras[name] = system.extra
                    bar.update()
            points += [summarize(name, c, runs[name], **extras[name]) for name in names]
    finally:
        bar.close()
        for system in systems.values():
            system.close()
    for p in points:
        if p.system.startswith("ceiling"):
            p.p50_s = p.p90_s = p.p99_s = float("nan")  # a throughput reference, not a latency
    from batchstring.loadtest.report import markdown_table, plot

    meta = {"command": " ".join(["batchstring", "bench", *(["--quick"] if args.quick else [])]),
            "queue_delay_us": args.queue_delay_us, "repeats": repeats,
            "seconds": round(time.monotonic() - started, 1), "machine": machine(), "max_tokens": max_tokens,
            "prompt_tokens": (8, 200), "requests_per_level": {c: per_level(c) for c in levels},
            "stream_every": STREAM_EVERY}
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
    p.add_argument("--scenario", choices=("sweep", "shared-prefix"), default="sweep",
                   help="sweep: concurrency sweep vs baselines (default); shared-prefix: prefix caching on vs off "
                        "(loadtest/scenarios.py)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="engine parameter for the scenario's servers (repeatable)")
    p.add_argument("--quick", action="store_true", help="fewer and shorter requests (about 2 minutes)")
    p.add_argument("--systems", nargs="*", choices=SYSTEMS, help="measure only these (default: all)")
    p.add_argument("--repeats", type=int, help="runs per point, medians reported (default 2; --quick 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--queue-delay-us", type=int, help="override max_queue_delay_microseconds of batched servers")
    p.add_argument("--out", type=Path, help="results folder (default: results/bench-<time>)")
