"""`batchstring structured-bench`: what constrained decoding costs, measured in separate runs.

The engine in process, behind its serving shell (engine/serving.py), as model.py drives it:
requests are made (tokenised and, for structured ones, their grammar compiled) on the caller's
thread and submitted; the engine thread only steps. Two measurements:

- throughput: at each of `--callers` (1, 16, 64) and for greedy and sampled requests, three kinds
  of traffic in runs of their own, taking turns (`--rounds` rounds, each round in a new order):
  every request free, every request constrained by a JSON schema (a few schemas, compiled once and
  then cached), and half of each (mixed). `callers` requests kept in flight (a finished one is
  replaced at once) for `--seconds`. Output tokens/s, requests/s, mean step time and the host's
  share of it (the step's wall time less the runner's). A constrained row never shares a step with
  a free twin here: a step's time is paid by every row in it, so a side-by-side run could not show
  what constraining costs.
- arrival: `--concurrency` requests decoding, then as many new requests arrive at once; with new,
  distinct JSON schemas (each compiled on arrival) or without. The p99 step time of the steps
  while they join and run; the ratio is what new grammars cost the requests already running.

A JSON completion ends when its schema is complete, so each free request generates exactly as
many tokens as the constrained run's requests did on average (max_tokens set to it, end of
sequence ignored): both kinds do the same model work and differ only by the grammar.
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
from batchstring.engine.sampling_params import SamplingParams, parse_sampling_parameters
from batchstring.engine.serving import ServingEngine
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest.workload import extraction_schema, mixed


@dataclass
class Driven:
    tokens: int
    seconds: float
    step_seconds: list[float]
    requests: int = 0
    runner_seconds: float = 0.0

    def add(self, other: Driven) -> Driven:
        return Driven(self.tokens + other.tokens, self.seconds + other.seconds, self.step_seconds + other.step_seconds,
                      self.requests + other.requests, self.runner_seconds + other.runner_seconds)

    @property
    def host_share(self) -> float:
        total = sum(self.step_seconds)
        return 1.0 - self.runner_seconds / total if total else float("nan")


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
        stats = self.engine.core.stats
        runner = stats.runner_seconds
        began = time.perf_counter()
        for k in range(concurrency):
            self.submit(*items[k], done, lengths, k)
        k = concurrency
        while time.perf_counter() - began < seconds and k < len(items):
            if done.acquire(timeout=0.05):
                self.submit(*items[k], done, lengths, k)
                k += 1
        elapsed = time.perf_counter() - began
        tokens, finished, steps = self.tokens, len(lengths), [s for _, s in self.steps]
        runner = stats.runner_seconds - runner
        for _ in range(concurrency):  # drain what is in flight before the next measurement
            done.acquire()
        return Driven(tokens, elapsed, steps, finished, runner), lengths

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


KINDS = ("free", "constrained", "mixed")


def _request(kind: str, k: int, free: SamplingParams, schemas: list[SamplingParams]) -> SamplingParams:
    """Request k of a run of `kind`: free, constrained by one of the schemas, or every other one."""
    constrained = kind == "constrained" or (kind == "mixed" and k % 2)
    return schemas[k % len(schemas)] if constrained else free


def throughput(bench: Bench, prompts: list[str], args: argparse.Namespace, console: Console) -> list[dict]:
    """Every (sampling, callers) cell: the three kinds of traffic in runs of their own, taking turns."""
    count = 4096  # more than any run can finish
    rows = []
    for temperature in (0.0, args.temperature):
        rate = lambda **v: parse_sampling_parameters(json.dumps(v), 512, 16)  # noqa: E731
        schemas = [rate(max_tokens=args.max_tokens, temperature=temperature, json_schema=extraction_schema(i))
                   for i in range(4)]
        # as many tokens as a constrained request makes on average (measured once, at 16 callers)
        probe, _ = bench.closed_loop([(prompts[k % len(prompts)], schemas[k % 4]) for k in range(count)],
                                           16, args.seconds / 2)
        mean = max(1, round(probe.tokens / max(1, probe.requests)))
        free = rate(max_tokens=mean, temperature=temperature, ignore_eos=True)
        for callers in args.callers:
            driven = {kind: Driven(0, 0.0, []) for kind in KINDS}
            rounds = []  # constrained / free requests/s of each round: how far apart runs of the same code read
            for r in range(args.rounds):
                ran = {}
                for kind in KINDS[r % 3:] + KINDS[: r % 3]:
                    items = [(prompts[k % len(prompts)], _request(kind, k, free, schemas)) for k in range(count)]
                    ran[kind], _ = bench.closed_loop(items, callers, args.seconds)
                    driven[kind] = driven[kind].add(ran[kind])
                rounds.append(_requests_per_s(ran["constrained"]) / max(_requests_per_s(ran["free"]), 1e-9))
            label = "greedy" if temperature == 0 else f"temperature {temperature:g}"
            console.print(f"{label}, {callers} callers: done")
            rows.append({"sampling": label, "callers": callers, "tokens_per_request": mean,
                         "requests_ratio_by_round": rounds,
                         **{kind: {"tokens_per_s": d.tokens / d.seconds, "requests_per_s": _requests_per_s(d),
                                   "step_ms": float(np.mean(d.step_seconds)) * 1e3, "host_share": d.host_share}
                            for kind, d in driven.items()}})
    return rows


def _requests_per_s(driven: Driven) -> float:
    return driven.requests / driven.seconds


def run(args: argparse.Namespace) -> int:
    console = Console(width=140)
    prompts = [item.prompt for item in mixed(256, seed=3)]
    rate = lambda **v: parse_sampling_parameters(json.dumps(v), 512, 16)  # noqa: E731

    def twin(lengths: dict[int, int], k: int) -> SamplingParams:
        """The unconstrained twin of constrained request k: as many tokens as it generated."""
        seen = list(lengths.values()) or [args.max_tokens]
        done = lengths.get(k) or seen[k % len(seen)]
        return rate(max_tokens=max(1, done), temperature=args.temperature, ignore_eos=True)

    bench = Bench(args.model_dir, max(2 * args.concurrency, *args.callers))
    try:
        console.print(f"throughput: free, constrained and mixed traffic in runs of their own, {args.rounds} rounds "
                      f"of {args.seconds:g} s, at {', '.join(map(str, args.callers))} callers, greedy and sampled...")
        cells = throughput(bench, prompts, args, console)
        console.print(f"{args.concurrency} new requests arriving at once while {args.concurrency} decode...")
        long = rate(max_tokens=args.max_tokens * 4, temperature=args.temperature, ignore_eos=True)
        new_schemas = [rate(max_tokens=args.max_tokens, temperature=args.temperature,
                            json_schema=extraction_schema(1000 + i)) for i in range(args.concurrency)]
        compiled_before = bench.engine.core.grammars.compiled
        fresh, arrived = bench.arrival(prompts, long, new_schemas, settle_steps=5)
        compiled = bench.engine.core.grammars.compiled - compiled_before
        base, _ = bench.arrival(prompts, long, [twin(arrived, i) for i in range(args.concurrency)], settle_steps=5)
    finally:
        bench.stop()
    table = Table(title=f"structured output: JSON-schema traffic against free traffic of as many tokens a request, "
                        f"separate runs taking turns ({args.rounds} rounds of {args.seconds:g} s)")
    for col in ("sampling", "callers", "free tok/s", "constrained", "ratio", "mixed", "ratio", "req/s free / constr.",
                "req/s ratio: rounds", "step ms free / constr.", "host share free / constr."):
        table.add_column(col, justify="right")
    for c in cells:
        f, k, m = c["free"], c["constrained"], c["mixed"]
        rounds = c["requests_ratio_by_round"]
        table.add_row(c["sampling"], str(c["callers"]), f"{f['tokens_per_s']:.0f}", f"{k['tokens_per_s']:.0f}",
                      f"{k['tokens_per_s'] / f['tokens_per_s']:.2f}x", f"{m['tokens_per_s']:.0f}",
                      f"{m['tokens_per_s'] / f['tokens_per_s']:.2f}x",
                      f"{f['requests_per_s']:.1f} / {k['requests_per_s']:.1f}",
                      f"{min(rounds):.2f}-{max(rounds):.2f}x",
                      f"{f['step_ms']:.2f} / {k['step_ms']:.2f}", f"{f['host_share']:.0%} / {k['host_share']:.0%}")
    console.print(table)
    console.print(f"p99 step time while {args.concurrency} requests arrive at once, {compiled} with new schemas: "
                  f"{p99(fresh) * 1e3:.1f} ms against {p99(base) * 1e3:.1f} ms without ({p99(fresh) / p99(base):.2f}x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "throughput": cells,
            "p99_step_s": {"unconstrained_arrivals": p99(base), "new_schema_arrivals": p99(fresh)},
            "new_schemas_compiled": compiled}, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path, default=MODEL_VERSION_DIR)
    p.add_argument("--concurrency", type=int, default=64, help="requests decoding while new schemas arrive")
    p.add_argument("--callers", type=int, nargs="+", default=[1, 16, 64], help="requests in flight, per cell")
    p.add_argument("--seconds", type=float, default=8.0, help="length of each throughput run")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the three kinds, each round in another order")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--out", type=Path, help="write the numbers as JSON here")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
