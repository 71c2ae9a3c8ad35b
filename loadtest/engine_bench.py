"""`batchstring engine-bench`: the in-process engine, without any serving cost.

Sections (`--only` picks some):
- scheduling: static vs continuous on the same items. Saturation (every request queued at t=0;
  output tokens/s) and latency (the same items as a Poisson stream at a common rate, a fraction of
  the continuous engine's saturated request rate; p50/p99 latency and time to first token).
- ceiling: the bare runner's decode-step throughput at batch sizes 1..64.
- host: host (Python) time per step next to runner time, per sampling mode, at batch 1 and 64
  (loadtest/host_overhead.py).
- vocab: the host table again on a random small Llama with a 128k-token vocabulary, exported
  through `batchstring export --model` (built once under results/).
- interference: inter-token latency of decoding sequences while long prompts arrive, chunked
  prefill on vs off (loadtest/interference.py).
- long: a long row among 63 short decoding rows against the 64 short rows, per runtime, beside
  the ratio of their context sums, and the host time of a step's inputs at 64 rows of 16k
  against 64 of 256 (loadtest/long_context.py; a 32k-context model built once under results/).
- ops: operators one decode step runs at batch 1 and 64, per runtime.
- moe: a mixture-of-experts step against a dense one (loadtest/mixture_bench.py).
- adapters: decode rows over 8 LoRA adapters of rank 16 against base rows, and the export with
  adapters against the one without when no row uses one, per runtime, at 1 and 64 rows, with the
  memory one resident adapter takes (loadtest/adapter_bench.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from batchstring.engine.batch import Work, build_step
from batchstring.engine.config import EngineConfig
from batchstring.engine.core import EngineCore
from batchstring.engine.output import RequestOutput
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence
from batchstring.engine.serving import ServingEngine
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest import adapter_bench, host_overhead, interference, long_context, mixture_bench
from batchstring.loadtest.workload import Item, mixed

MODES = ("static", "continuous")
CEILING_BATCHES = (1, 2, 4, 8, 16, 32, 64)
SECTIONS = ("scheduling", "ceiling", "host", "vocab", "interference", "long", "ops", "moe", "adapters")
VOCAB = 128256  # Llama 3's vocabulary size


@dataclass
class RunResult:
    mode: str
    scenario: str
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    p50_latency_s: float
    p99_latency_s: float
    p50_ttft_s: float
    mean_step_batch: float


class _Tracker:
    """Sink that timestamps final outputs, with a progress bar."""

    def __init__(self, total: int, label: str) -> None:
        self.done: dict[str, float] = {}
        self.tokens = 0
        self.finished = threading.Event()
        self.total = total
        self.bar = tqdm(total=total, desc=label, unit="req", leave=False)

    def __call__(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.finished:
            self.done[out.request_id] = now
            self.tokens += out.num_output_tokens
            self.bar.update()
            if len(self.done) == self.total:
                self.bar.close()
                self.finished.set()


class _StaticGroups:
    """Mimics Triton's dynamic batcher for `static` mode: requests arriving while the engine is
    busy with a batch join the next batch, up to max_num_seqs."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.current: list[Sequence] = []
        self.group = 0

    def assign(self, seq: Sequence) -> None:
        open_group = len(self.current) < self.limit and all(s.status.value == "waiting" for s in self.current)
        if not open_group:
            self.group += 1
            self.current = []
        seq.group = self.group
        self.current.append(seq)


def run_mode(model_dir: Path, mode: str, items: list[Item], arrivals: np.ndarray, scenario: str,
             **engine_args) -> RunResult:
    engine = ServingEngine(EngineConfig(model_dir=model_dir, scheduling=mode, **engine_args))
    tracker = _Tracker(len(items), f"{mode:>10} {scenario}")
    groups = _StaticGroups(engine.config.max_num_seqs)
    seqs = [engine.core.make_sequence(item.prompt, SamplingParams(max_tokens=item.max_tokens, temperature=0.0,
                                                             ignore_eos=True), tracker, request_id=str(i))
            for i, item in enumerate(items)]
    start = time.monotonic()
    submitted = {}
    for seq in seqs[: int(np.sum(arrivals == 0))]:  # everything due at t=0 is queued before the loop starts
        groups.assign(seq)
        submitted[seq.request_id] = start
        engine.submit(seq)
    engine.start()
    for seq, at in zip(seqs[len(submitted) :], arrivals[len(submitted) :]):
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        groups.assign(seq)
        submitted[seq.request_id] = time.monotonic()
        engine.submit(seq)
    tracker.finished.wait()
    engine.stop()
    end = max(tracker.done.values())
    latency = np.array([tracker.done[s.request_id] - submitted[s.request_id] for s in seqs])
    ttft = np.array([s.first_token_at - submitted[s.request_id] for s in seqs])
    s = engine.core.stats
    return RunResult(mode, scenario, len(items), tracker.tokens, end - start, tracker.tokens / (end - start),
                     float(np.percentile(latency, 50)), float(np.percentile(latency, 99)),
                     float(np.percentile(ttft, 50)), s.step_seqs / max(1, s.steps))


def runner_ceiling(model_dir: Path, past: int = 128, steps: int = 20) -> dict[int, float]:
    """Decode tokens/s of the bare runner (no scheduling, no building of inputs, no responses)."""
    engine = EngineCore(EngineConfig(model_dir=model_dir, max_num_seqs=max(CEILING_BATCHES)))
    blocks = engine.scheduler.blocks
    ids = engine.codec.encode("x" * 4096)[:past]
    result = {}
    for batch in tqdm(CEILING_BATCHES, desc="runner ceiling", leave=False):
        seqs = [engine.make_sequence("x", SamplingParams(max_tokens=8, temperature=0.0), lambda o: None)
                for _ in range(batch)]
        for s in seqs:
            s.prompt_ids, s.output_ids = list(ids), [0]
            blocks.grow(s, past + 1)
            s.num_computed = past
        step_batch = build_step([Work(s, 1) for s in seqs], blocks)
        engine.runner.step(step_batch)
        timings = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.runner.step(step_batch)
            timings.append(time.perf_counter() - t)
        result[batch] = batch / float(np.median(timings))
        for s in seqs:
            blocks.release(s)
    return result


def vocab_model(path: Path | None) -> Path:
    """The exported 128k-vocabulary model: `path` if given, else built once under results/."""
    if path:
        return path
    root = Path("results") / "vocab128k"
    exported = root / "exported"
    if not (exported / "runtime.json").exists():
        from batchstring.export.exporter import export_model
        from batchstring.export.synthetic import random_checkpoint, small_llama_config

        checkpoint = random_checkpoint(root / "checkpoint", small_llama_config(VOCAB))
        export_model(checkpoint, exported)
    return exported


def adapter_models(checkpoint: Path | None) -> tuple[Path, Path]:
    """`checkpoint` (default: the shipped model) exported without and with `--adapters`, built once
    under results/."""
    from batchstring.export.exporter import export_model

    root = Path("results") / "adapters" / (checkpoint.name if checkpoint else "default_model")
    exports = (root / "plain", root / "adapters")
    for out, adapters in zip(exports, (False, True)):
        if not (out / "runtime.json").exists():
            export_model(checkpoint, out, adapters=adapters)
    return exports


def run(args: argparse.Namespace) -> int:
    console = Console(width=130)
    model_dir = MODEL_VERSION_DIR
    sections = args.only or SECTIONS
    report_data: dict = {}
    if "scheduling" in sections:
        items = mixed(args.requests, seed=args.seed)
        engine_args = {"max_num_seqs": args.max_num_seqs}
        zero = np.zeros(len(items))
        results = [run_mode(model_dir, mode, items, zero, "saturated", **engine_args) for mode in MODES]
        continuous = results[1]
        rate = args.load * continuous.requests / continuous.seconds
        arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1 / rate, size=len(items)))
        results += [run_mode(model_dir, mode, items, arrivals, "poisson", **engine_args) for mode in MODES]
        report(console, results, rate)
        report_data["runs"] = [asdict(r) for r in results]
        report_data.update(requests=args.requests, load=args.load)
    if "ceiling" in sections:
        ceiling = runner_ceiling(model_dir)
        report_ceiling(console, ceiling)
        report_data["ceiling_tokens_per_s"] = ceiling
    for section, path in (("host", model_dir), ("vocab", None)):
        if section not in sections:
            continue
        path = path or vocab_model(args.vocab_model)
        bar = tqdm(total=len(host_overhead.MODES) * 2, desc=f"host time ({section})", unit="run", leave=False)
        hosts = host_overhead.sweep(path, progress=bar.update)
        bar.close()
        report_host(console, hosts, describe_model(path))
        report_data[section] = [{**asdict(h), "share": h.share, "of_runner": h.of_runner} for h in hosts]
    if "interference" in sections:
        bar = tqdm(total=6, desc="interference", unit="run", leave=False)
        runs = interference.compare(model_dir, repeats=3, progress=bar.update)
        bar.close()
        report_interference(console, runs)
        report_data["interference"] = [asdict(r) for r in runs]
    if "long" in sections:
        long_dir = long_context.long_model(args.long_model)
        runtimes = ("onnxruntime", "torchscript")
        bar = tqdm(total=2 * 5 * len(long_context.LENGTHS) * len(runtimes), desc="long contexts", unit="run",
                   leave=False)
        decode = {runtime: long_context.decode_ratios(long_dir, runtime=runtime, progress=bar.update)
                  for runtime in runtimes}
        bar.close()
        host = long_context.host_ratio()
        report_long(console, decode, host)
        report_data["long"] = {"decode": {r: [{**asdict(x), "ratio": x.ratio} for x in v] for r, v in decode.items()},
                               "host": {**asdict(host), "ratio": host.ratio}}
    if "ops" in sections:
        ops = long_context.operators(model_dir)
        report_ops(console, ops)
        report_data["ops"] = ops
    if "moe" in sections:
        models = mixture_bench.mixture_models()
        runtimes = ("onnxruntime", "torchscript")
        bar = tqdm(total=2 * 5 * len(mixture_bench.BATCHES) * len(runtimes), desc="mixture vs dense", unit="run",
                   leave=False)
        ratios = [r for runtime in runtimes for r in mixture_bench.compare(models, runtime, progress=bar.update)]
        bar.close()
        report_mixture(console, ratios)
        report_data["moe"] = [{**asdict(r), "ratio": r.ratio} for r in ratios]
    if "adapters" in sections:
        plain, adapted = adapter_models(args.adapter_model)
        runs = [(runtime, rows) for runtime in ("onnxruntime", "torchscript") for rows in (1, adapter_bench.ROWS)]
        bar = tqdm(total=3 * 5 * len(runs), desc="adapters vs base", unit="run", leave=False)
        with tempfile.TemporaryDirectory(prefix="batchstring-adapters-") as scratch:
            costs = [adapter_bench.compare(plain, adapted, runtime, Path(scratch) / f"{runtime}-{rows}", rows,
                                           progress=bar.update) for runtime, rows in runs]
        bar.close()
        report_adapters(console, costs, describe_model(adapted))
        report_data["adapters"] = [{**asdict(c), "ratio": c.ratio} for c in costs]
    if args.profile:
        console.print(host_overhead.profile_host(model_dir, out=args.profile))
        console.print(f"cProfile stats written to {args.profile} (python -m pstats {args.profile})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report_data, indent=2))
        console.print(f"wrote {args.out}")
    return 0


def describe_model(path: Path) -> str:
    spec = json.loads((path / "runtime.json").read_text())
    return f"{spec['source']}: {spec['num_layers']} layers, vocabulary {spec['vocab_size']}"


def report(console: Console, results: list[RunResult], rate: float) -> None:
    table = Table(title=f"in-process engine, {results[0].requests} requests (prompts 8-200 tokens, max_tokens "
                        f"8-256, greedy): saturated = all queued at t=0; poisson = {rate:.1f} req/s")
    for col in ("scenario", "mode", "out tok/s", "p50 latency", "p99 latency", "p50 TTFT", "mean step batch"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.scenario, r.mode, f"{r.tokens_per_s:.0f}", f"{r.p50_latency_s:.2f} s",
                      f"{r.p99_latency_s:.2f} s", f"{r.p50_ttft_s:.2f} s", f"{r.mean_step_batch:.1f}")
    console.print(table)
    by = {(r.scenario, r.mode): r for r in results}
    ratios = Table(title="continuous / static")
    ratios.add_column("measure")
    ratios.add_column("ratio", justify="right")
    ratios.add_row("throughput, saturated",
                   f"{by['saturated', 'continuous'].tokens_per_s / by['saturated', 'static'].tokens_per_s:.2f}x")
    ratios.add_row("p99 latency under Poisson load (static / continuous)",
                   f"{by['poisson', 'static'].p99_latency_s / by['poisson', 'continuous'].p99_latency_s:.2f}x lower")
    console.print(ratios)


def report_ceiling(console: Console, ceiling: dict[int, float]) -> None:
    ceil = Table(title="runner ceiling: decode tokens/s at past = 128 (no scheduling)")
    ceil.add_column("batch", justify="right")
    ceil.add_column("tokens/s", justify="right")
    for b, tps in ceiling.items():
        ceil.add_row(str(b), f"{tps:.0f}")
    console.print(ceil)


def report_interference(console: Console, runs: list[interference.Interference]) -> None:
    on, off = (next(r for r in runs if r.chunked is c) for c in (True, False))
    table = Table(title=f"long-prompt interference: 32 decoding sequences, a 450-token prompt every 0.5 s "
                        f"({on.long_prompts} per run; median of 3)")
    for col in ("chunked prefill", "out tok/s", "inter-token p50", "p99", "max"):
        table.add_column(col, justify="right")
    for r in (on, off):
        table.add_row("on" if r.chunked else "off", f"{r.tokens_per_s:.0f}", f"{r.itl_p50_ms:.1f} ms",
                      f"{r.itl_p99_ms:.1f} ms", f"{r.itl_max_ms:.1f} ms")
    table.add_row("on / off", f"{on.tokens_per_s / off.tokens_per_s:.2f}x", "",
                  f"{off.itl_p99_ms / on.itl_p99_ms:.2f}x lower", f"{off.itl_max_ms / on.itl_max_ms:.2f}x lower")
    console.print(table)


def report_long(console: Console, decode: dict[str, list[long_context.DecodeRatio]],
                host: long_context.HostRatio) -> None:
    rows, short = long_context.ROWS, long_context.SHORT
    table = Table(title=f"one long row among {rows - 1} short ones ({short}-token pasts), decode step time against "
                        f"{rows} short rows (median of runs taking turns)")
    for col in ("runtime", "long row", f"{rows} short", "with the long row", "step ratio", "context-sum ratio"):
        table.add_column(col, justify="right")
    for runtime, results in decode.items():
        for r in results:
            table.add_row(runtime, f"{r.long:,}", f"{r.short_ms:.2f} ms", f"{r.mixed_ms:.2f} ms", f"{r.ratio:.2f}x",
                          f"{r.sum_ratio:.2f}x")
    console.print(table)
    console.print(f"host time to build a step's inputs, {rows} decoding rows: {host.long:,}-token pasts "
                  f"{host.long_us:.0f} µs, {host.short}-token pasts {host.short_us:.0f} µs ({host.ratio:.2f}x)")


def report_mixture(console: Console, ratios: list[mixture_bench.MixtureRatio]) -> None:
    table = Table(title=f"decode step: Qwen3-MoE (8 experts, top-2) against dense Qwen3 of the same active "
                        f"parameters, {mixture_bench.PAST}-token pasts (median of runs taking turns)")
    for col in ("runtime", "rows", "dense", "mixture", "ratio"):
        table.add_column(col, justify="right")
    for r in ratios:
        table.add_row(r.runtime, str(r.rows), f"{r.dense_ms:.2f} ms", f"{r.mixture_ms:.2f} ms", f"{r.ratio:.2f}x")
    console.print(table)


def report_ops(console: Console, ops: dict[str, dict[int, int]]) -> None:
    table = Table(title="operators one decode step runs (ONNX Runtime: executed nodes, the small-step graph at "
                        "batch 1; TorchScript: top-level aten operators)")
    table.add_column("runtime")
    batches = sorted(next(iter(ops.values())))
    for batch in batches:
        table.add_column(f"batch {batch}", justify="right")
    for runtime, counts in ops.items():
        table.add_row(runtime, *(str(counts[b]) for b in batches))
    console.print(table)


def report_adapters(console: Console, costs: list[adapter_bench.AdapterCost], model: str) -> None:
    table = Table(title=f"decode step past {adapter_bench.PAST} tokens a row: the export without adapters, the "
                        f"export with them and no adapter row, every row over {adapter_bench.ADAPTERS} LoRA "
                        f"adapters of rank {adapter_bench.RANK} (every projection); {model}; median of turns")
    for column in ("runtime", "rows", "plain ms", "no adapter ms", "unused", "adapters ms", "ratio",
                   "one adapter, MiB"):
        table.add_column(column, justify="right")
    for c in costs:
        table.add_row(c.runtime, str(c.rows), f"{c.plain_ms:.2f}", f"{c.base_ms:.2f}", f"{c.unused:.2f}x",
                      f"{c.adapted_ms:.2f}", f"{c.ratio:.2f}x", f"{c.adapter_bytes / 2**20:.2f}")
    console.print(table)


def report_host(console: Console, hosts: list[host_overhead.HostResult], model: str) -> None:
    table = Table(title=f"host vs runner time per step ({model}; {host_overhead.MAX_TOKENS} tokens per "
                        "sequence, median of 3)")
    for col in ("sampling", "batch", "runner ms/step", "host ms/step", "host share", "host / runner"):
        table.add_column(col, justify="right")
    for h in hosts:
        table.add_row(h.mode, str(h.batch), f"{h.runner_ms:.2f}", f"{h.host_ms:.2f}", f"{h.share:.1%}",
                      f"{h.of_runner:.1%}")
    console.print(table)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", nargs="*", choices=SECTIONS, help="run only these sections (default: all)")
    p.add_argument("--vocab-model", type=Path, help="exported model for the vocab section (default: built)")
    p.add_argument("--long-model", type=Path, help="exported long-context model for the long section (default: built)")
    p.add_argument("--adapter-model", type=Path,
                   help="checkpoint for the adapters section, exported with and without adapters under results/ "
                        "(default: the shipped one)")
    p.add_argument("--profile", type=Path, help="also cProfile the engine (top_p 0.95, batch 64) into this file")
    p.add_argument("--requests", type=int, default=192, help="items per run")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--load", type=float, default=0.7,
                   help="Poisson rate as a fraction of the continuous engine's saturated request rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/engine-bench.json"))
