"""`batchstring structured-bench`: what constrained decoding costs, side by side in one run.

The engine in process, behind its serving shell (engine/serving.py), as model.py drives it:
requests are made (tokenised and, for structured ones, their grammar compiled) on the caller's
thread and submitted; the engine thread only steps. Two measurements, each against its own
unconstrained twin in the same run:

- throughput: `--concurrency` requests kept in flight (a finished one is replaced at once) for
  `--seconds`, the same prompts and sampling, with and without a JSON schema (a few schemas,
  compiled once and then cached). Output tokens per second; the ratio is the cost of the masks.
- arrival: `--concurrency` requests decoding, then as many new requests arrive at once; with new,
  distinct JSON schemas (each compiled on arrival) or without. The p99 step time of the steps
  while they join and run; the ratio is what new grammars cost the requests already running.

A JSON completion ends when its schema is complete, so each unconstrained twin generates exactly
as many tokens as its constrained run did (max_tokens set to that count, end of sequence
ignored): both sides do the same model work and differ only by the grammar.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from batchstring.engine.config import EngineConfig
from batchstring.engine.output import RequestOutput
from batchstring.engine.sampling import SamplingParams, parse_sampling_parameters
from batchstring.engine.serving import ServingEngine
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest.workload import mixed


def schema(i: int) -> dict:
    """Distinct small extraction schemas: field names, enums and bounds vary with i."""
    return {"type": "object", "additionalProperties": False, "required": [f"name_{i}", "kind", "size"],
            "properties": {f"name_{i}": {"type": "string", "maxLength": 12 + i % 7},
                           "kind": {"enum": [f"k{i}", "function", "class"]},
                           "size": {"type": "integer", "minimum": 0, "maximum": 100 + i},
                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}}


@dataclass
class Driven:
    tokens: int
    seconds: float
    step_seconds: list[float]

    def add(self, other: Driven) -> Driven:
        return Driven(self.tokens + other.tokens, self.seconds + other.seconds, self.step_seconds + other.step_seconds)


class Bench:
    """A serving engine whose steps are timed."""

    def __init__(self, model_dir: Path, max_num_seqs: int) -> None:
        config = EngineConfig(model_dir=model_dir, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max(512, max_num_seqs))
        self.engine = ServingEngine(config)
        self.engine.core.warm_up()
        self.steps: list[tuple[float, float]] = []  # (started, seconds)
        step = self.engine.core.step

        def timed() -> bool:
            began = time.perf_counter()
            ran = step()
            if ran:
                self.steps.append((began, time.perf_counter() - began))
            return ran

        self.engine.core.step = timed
        self.engine.start()
        self.tokens = 0
        self._lock = threading.Lock()

    def submit(self, prompt: str, params: SamplingParams, done: threading.Semaphore,
               lengths: dict[int, int], index: int) -> None:
        def sink(out: RequestOutput) -> None:
            if out.finished:
                with self._lock:
                    self.tokens += out.num_output_tokens
                    lengths[index] = out.num_output_tokens
                done.release()

        self.engine.submit(self.engine.core.make_sequence(prompt, params, sink))

    def closed_loop(self, items: list[tuple[str, SamplingParams]], concurrency: int,
                    seconds: float) -> tuple[Driven, dict[int, int]]:
        """`concurrency` of `items` in flight for `seconds`, in order; tokens of finished requests."""
        done, lengths = threading.Semaphore(0), {}
        self.tokens, self.steps = 0, []
        began = time.perf_counter()
        for k in range(concurrency):
            self.submit(*items[k], done, lengths, k)
        k = concurrency
        while time.perf_counter() - began < seconds and k < len(items):
            if done.acquire(timeout=0.05):
                self.submit(*items[k], done, lengths, k)
                k += 1
        elapsed = time.perf_counter() - began
        tokens = self.tokens
        for _ in range(concurrency):  # drain what is in flight before the next measurement
            done.acquire()
        return Driven(tokens, elapsed, [s for _, s in self.steps]), lengths

    def arrival(self, prompts: list[str], running: SamplingParams, arriving: list[SamplingParams],
                settle_steps: int) -> tuple[list[float], dict[int, int]]:
        """Step times from the moment `arriving` requests are made (on this thread, as Triton's
        would) while `len(arriving)` requests are decoding, until they have all finished."""
        done, arrived, lengths = threading.Semaphore(0), threading.Semaphore(0), {}
        for i in range(len(arriving)):
            self.submit(prompts[i % len(prompts)], running, done, {}, i)
        while len(self.steps) < settle_steps:
            time.sleep(0.01)
        self.steps = []
        for i, params in enumerate(arriving):
            self.submit(prompts[-1 - i % len(prompts)], params, arrived, lengths, i)
        for _ in arriving:
            arrived.acquire()
        window = [s for _, s in self.steps]
        for _ in arriving:
            done.acquire()
        return window, lengths

    def stop(self) -> None:
        self.engine.stop()


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


def run(args: argparse.Namespace) -> int:
    console = Console()
    prompts = [item.prompt for item in mixed(256, seed=3)]
    rate = lambda **v: parse_sampling_parameters(json.dumps(v), 512, 16)  # noqa: E731

    def twin(lengths: dict[int, int], k: int) -> SamplingParams:
        """The unconstrained twin of constrained request k: as many tokens as it generated."""
        seen = list(lengths.values()) or [args.max_tokens]
        done = lengths.get(k) or seen[k % len(seen)]
        return rate(max_tokens=max(1, done), temperature=args.temperature, ignore_eos=True)

    structured = [rate(max_tokens=args.max_tokens, temperature=args.temperature, json_schema=schema(i))
                  for i in range(4)]
    bench = Bench(args.model_dir, 2 * args.concurrency)
    count = 4096  # more than any run can finish
    try:
        console.print(f"throughput at concurrency {args.concurrency}: {args.rounds} rounds of {args.seconds:g} s "
                      "each, in turn first (a shared machine drifts)...")
        constrained, free, lengths = Driven(0, 0.0, []), Driven(0, 0.0, []), {}
        for r in range(args.rounds):  # the twins use the previous constrained run's lengths, so either goes first
            runs = ["constrained", "free"] if r % 2 == 0 else ["free", "constrained"]
            for run_kind in runs:
                if run_kind == "constrained":
                    one, lengths = bench.closed_loop([(prompts[k % len(prompts)], structured[k % len(structured)])
                                                      for k in range(count)], args.concurrency, args.seconds)
                    constrained = constrained.add(one)
                else:
                    other, _ = bench.closed_loop([(prompts[k % len(prompts)], twin(lengths, k))
                                                  for k in range(count)], args.concurrency, args.seconds)
                    free = free.add(other)
        console.print(f"{args.concurrency} new requests arriving at once while {args.concurrency} decode...")
        long = rate(max_tokens=args.max_tokens * 4, temperature=args.temperature, ignore_eos=True)
        new_schemas = [rate(max_tokens=args.max_tokens, temperature=args.temperature,
                            json_schema=schema(1000 + i)) for i in range(args.concurrency)]
        compiled_before = bench.engine.core.grammars.compiled
        fresh, arrived = bench.arrival(prompts, long, new_schemas, settle_steps=5)
        compiled = bench.engine.core.grammars.compiled - compiled_before
        base, _ = bench.arrival(prompts, long, [twin(arrived, i) for i in range(args.concurrency)], settle_steps=5)
    finally:
        bench.stop()
    table = Table(title="structured output: cost, side by side (one run)")
    for col in ("measurement", "unconstrained", "JSON schema", "ratio", "target"):
        table.add_column(col, justify="right")
    free_rate, constrained_rate = free.tokens / free.seconds, constrained.tokens / constrained.seconds
    table.add_row(f"output tokens/s, concurrency {args.concurrency}", f"{free_rate:.0f}", f"{constrained_rate:.0f}",
                  f"{constrained_rate / free_rate:.2f}x", ">= 0.80x")
    table.add_row(f"p99 step ms, {args.concurrency} arrive ({compiled} new schemas)", f"{p99(base) * 1e3:.1f}",
                  f"{p99(fresh) * 1e3:.1f}", f"{p99(fresh) / p99(base):.2f}x", "<= 1.20x")
    table.add_row("mean step ms (throughput runs)", f"{np.mean(free.step_seconds) * 1e3:.1f}",
                  f"{np.mean(constrained.step_seconds) * 1e3:.1f}",
                  f"{np.mean(constrained.step_seconds) / np.mean(free.step_seconds):.2f}x", "")
    console.print(table)
    if args.out:
        args.out.write_text(json.dumps({
            "concurrency": args.concurrency,
            "tokens_per_s": {"unconstrained": free_rate, "json_schema": constrained_rate},
            "p99_step_s": {"unconstrained_arrivals": p99(base), "new_schema_arrivals": p99(fresh)},
            "new_schemas_compiled": compiled}, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, default=MODEL_VERSION_DIR)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0, help="length of each throughput measurement")
    p.add_argument("--rounds", type=int, default=2, help="constrained / unconstrained pairs, each order in turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
