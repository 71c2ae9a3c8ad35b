"""`batchstring peer-bench`: our server beside llama.cpp's and HF generate, on the same weights.

Every system completes the same code prompts (windows of real stdlib source, the shipped model's
job), greedy, a fixed number of new tokens each, with N callers in a closed loop (each sends its
next prompt when its previous one is answered). Systems take turns at each level, so a slow spell
of this noisy machine lands on all of them. Measured per system and level: output tokens/s and
p50/p99 request latency, with ratios to llama.cpp without speculation, all from one run.

  batchstring         served: tritonserver + the front door, started here, called through our
                      client; speculative decoding off for these requests
  batchstring-ngram   the same server, n-gram (prompt lookup) speculation allowed
  llama.cpp           llama.cpp's `llama-server` (binary and GGUF given), greedy, continuous batching
  llama.cpp-ngram     the same server binary with its own n-gram speculation (`--llama-spec-args`)
  hf-generate         Hugging Face `generate`, padded static batches of `callers` prompts, in-process

llama.cpp is fed the prompts as token ids (our tokenizer's), so every engine sees the same input;
the share of prompts whose greedy completion equals ours is reported as a sanity check.

Every prompt recurs within a run (the untimed first calls, the levels, the repeats), so neither
side reuses a cached prompt unless `--prefix-caching` turns reuse on for both: our prefix cache is
off (`enable_prefix_caching=false`) as llama-server is asked not to (`cache_prompt: false`).
Otherwise ours would time prompts it has seen while llama.cpp computes them again. The prompt
tokens our server found cached are read from its metrics and reported (0 when off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.console import Console
from tqdm import tqdm

from batchstring.client import AsyncBatchClient
from batchstring.engine.cores import available_cores
from batchstring.engine.tokenizer import TextCodec
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest.bench import Point, Sample, closed_loop, machine, summarize
from batchstring.loadtest.workload import Item, mixed
from batchstring.server.local import LocalServer, free_ports
from batchstring.server.repository import repository_for
from batchstring.server.triton import DEFAULT_REPOSITORY

CALLERS = (1, 16, 64)
SYSTEMS = ("batchstring", "batchstring-ngram", "llama.cpp", "llama.cpp-ngram", "hf-generate")
REFERENCE = "llama.cpp"
PREFIX_CACHING = "enable_prefix_caching"
# llama.cpp's own prompt lookup in the build this was measured with (`llama-server --help`): the last
# 3 tokens looked up, 4 drafted, as many drafts as ours (its defaults, 12 and 48, suit long verbatim
# repeats). Ours looks up the last 8 tokens and falls back to shorter matches; llama.cpp's
# ngram-simple matches exactly n, and n = 8 made it slower than n = 3 (docs/benchmarks.md, one caller).
LLAMA_SPEC_ARGS = "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 4"


class Run:
    """One system's answers at one level: the samples, the wall time and each prompt's text."""

    def __init__(self, samples: list[Sample], seconds: float, texts: dict[int, str]) -> None:
        self.samples, self.seconds, self.texts = samples, seconds, texts


class Ours:
    """Our server through our client, as users call it; `speculative` is the per-request switch."""

    def __init__(self, server: LocalServer, speculative: bool) -> None:
        self.server = server
        self.options = {"speculative": speculative}

    def measure(self, items: list[Item], callers: int) -> Run:
        texts: dict[int, str] = {}

        async def go():
            async with AsyncBatchClient(self.server.grpc_url, max_in_flight=512) as client:
                async def call(index: int, item: Item) -> None:
                    texts[index] = (await client.batchstring([item.prompt], max_tokens=item.max_tokens,
                                                             ignore_eos=True, **self.options))[0]

                return await closed_loop(call, items, callers)

        samples, seconds = asyncio.run(go())
        return Run(samples, seconds, texts)

    def close(self) -> None:
        pass


class LlamaServer:
    """llama.cpp's HTTP server on a free loopback port, one slot per caller of the largest level."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int, extra: list[str],
                 log: Path) -> None:
        self.port = free_ports(1)[0]
        argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                "-np", str(slots), "-c", str(slots * context), "-t", str(threads), "--no-warmup", *extra]
        self.log = log.open("w")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"llama-server not ready after {timeout:.0f} s; see {self.log.name}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class LlamaCpp:
    """Calls a llama-server's /completion with our tokenizer's ids; greedy, exactly `max_tokens` new."""

    def __init__(self, server: LlamaServer, codec: TextCodec, cache_prompt: bool) -> None:
        self.server, self.codec, self.cache_prompt = server, codec, cache_prompt

    def measure(self, items: list[Item], callers: int) -> Run:
        import aiohttp

        url = f"http://127.0.0.1:{self.server.port}/completion"
        texts: dict[int, str] = {}

        async def go():
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def call(index: int, item: Item) -> None:
                    body = {"prompt": self.codec.encode(item.prompt), "n_predict": item.max_tokens,
                            "temperature": 0.0, "top_k": 1, "ignore_eos": True, "cache_prompt": self.cache_prompt}
                    async with session.post(url, json=body) as response:
                        answer = await response.json()
                    if response.status != 200:
                        raise RuntimeError(f"llama-server answered {response.status}: {answer}")
                    texts[index] = answer["content"]

                return await closed_loop(call, items, callers)

        samples, seconds = asyncio.run(go())
        return Run(samples, seconds, texts)

    def close(self) -> None:
        self.server.close()


class HFGenerateSystem:
    """Padded static batches of `callers` prompts through Hugging Face generate (each prompt's
    latency is its batch's time)."""

    def __init__(self) -> None:
        from batchstring.loadtest.hf_generate import HFGenerate

        self.hf = HFGenerate()

    def measure(self, items: list[Item], callers: int) -> Run:
        timings = self.hf.run(items, batch=callers)
        samples = [Sample(t.seconds, None, item.max_tokens) for t in timings for item in t.items]
        return Run(samples, sum(t.seconds for t in timings), {})

    def close(self) -> None:
        pass


def build(names: list[str], args: argparse.Namespace, out_dir: Path, items: list[Item]) -> dict:
    systems: dict = {}
    if any(n.startswith("batchstring") for n in names):
        repository = repository_for(args.model, out_dir / "repository") if args.model else DEFAULT_REPOSITORY
        server = LocalServer(config="cpu", repository=repository, params=engine_params(args)).start()
        systems["batchstring"] = Ours(server, speculative=False)
        systems["batchstring-ngram"] = Ours(server, speculative=True)
    codec = TextCodec.from_file((args.model or MODEL_VERSION_DIR) / "tokenizer.json")
    # each slot holds the longest prompt in the served model's own tokens (another export's tokenizer may
    # cut the workload's text into more tokens than the shipped one does)
    context = max(len(codec.encode(item.prompt)) for item in items) + args.max_tokens + 16
    for name, extra in (("llama.cpp", []), ("llama.cpp-ngram", args.llama_spec_args.split())):
        if name in names:
            if not (args.llama_server and args.gguf):
                raise SystemExit(f"{name} needs --llama-server and --gguf (docs/benchmarks.md says how to build them)")
            server = LlamaServer(args.llama_server, args.gguf, max(args.callers), context, args.llama_threads, extra,
                                 out_dir / f"{name}.log")
            systems[name] = LlamaCpp(server, codec, args.prefix_caching)
    if "hf-generate" in names:
        systems["hf-generate"] = HFGenerateSystem()
    return {n: systems[n] for n in names}


def engine_params(args: argparse.Namespace) -> dict[str, str]:
    """Our server's engine parameters: `--param`s, and prefix caching as `--prefix-caching` says
    (set there only, so that llama.cpp's `cache_prompt` always agrees with it)."""
    params = dict(p.split("=", 1) for p in args.param)
    if PREFIX_CACHING in params:
        raise SystemExit(f"--param {PREFIX_CACHING}=... would cache prompts on one side only; use --prefix-caching, "
                         "which sets it for both systems")
    return params | {PREFIX_CACHING: str(args.prefix_caching).lower()}


def prefix_hits(systems: dict) -> dict[str, float]:
    """Prompt tokens our server looked up in its prefix cache and found there, from its metrics."""
    from batchstring.server.stats import settled_metrics

    ours = next((s for s in systems.values() if isinstance(s, Ours)), None)  # both variants share one server
    if ours is None:
        return {}
    values = settled_metrics(ours.server.metrics_url)
    return {"prompt_tokens_looked_up": values.get("batchstring_prefix_cache_queries_total", 0.0),
            "prompt_tokens_reused": values.get("batchstring_prefix_cache_hits_total", 0.0)}


def run(args: argparse.Namespace) -> int:
    console = Console(width=140)
    names = [s for s in SYSTEMS if s in (args.systems or SYSTEMS)]
    items = mixed(args.prompts, prompt_tokens=tuple(args.prompt_tokens), max_tokens=(args.max_tokens,) * 2,
                  seed=args.seed)
    out_dir = args.out or Path("results") / time.strftime("peer-bench-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with console.status(f"starting {', '.join(names)}..."):
        systems = build(names, args, out_dir, items)
    points: list[Point] = []
    agreement: dict[str, float] = {}
    cache: dict[str, float] = {}
    bar = tqdm(total=len(names) * len(args.callers) * args.repeats, desc="peer-bench", unit="run")
    try:  # every server started is stopped, whatever fails (a refused first request included)
        for system in systems.values():  # first-call costs (allocations, connections) are nobody's result
            system.measure(items[:2], 1)
        for callers in args.callers:
            runs: dict[str, list[Run]] = {name: [] for name in names}
            for system in systems.values():  # a level's first batches (new shapes, arena growth) are nobody's result
                system.measure(items[:callers], callers)
            for _ in range(args.repeats):  # systems take turns, repeat after repeat
                for name, system in systems.items():
                    bar.set_postfix(callers=callers, system=name)
                    runs[name].append(system.measure(items, callers))
                    bar.update()
            points += [summarize(name, callers, [(r.samples, r.seconds) for r in runs[name]]) for name in names]
            if callers == args.callers[0] and "batchstring" in runs:
                agreement = same_text({name: r[0] for name, r in runs.items()})
        cache = prefix_hits(systems)
    finally:
        bar.close()
        for system in systems.values():
            system.close()
        for server in {id(s.server): s.server for s in systems.values() if isinstance(s, Ours)}.values():
            server.close()  # one server behind both of our variants
    table = markdown(points)
    meta = {"command": command(args), "machine": machine(), "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "llama_spec_args": args.llama_spec_args, "llama_threads": args.llama_threads,
            "prefix_caching": args.prefix_caching, "our_prefix_cache": cache,
            "seconds": round(time.monotonic() - started, 1),
            "greedy_agreement_with_batchstring": agreement}
    (out_dir / "peer.json").write_text(json.dumps({"meta": meta, "points": [asdict(p) for p in points]}, indent=2))
    (out_dir / "peer.md").write_text(table + "\n")
    console.print(table)
    if agreement:
        console.print("greedy completions equal to batchstring's: "
                      + ", ".join(f"{k} {v:.0%}" for k, v in agreement.items()))
    if cache:
        console.print(f"prefix caching {'on' if args.prefix_caching else 'off'} for every system: our server reused "
                      f"{cache['prompt_tokens_reused']:,.0f} cached prompt tokens")
    console.print(f"\nwrote {out_dir}/peer.json, peer.md in {meta['seconds']:.0f} s")
    return 0


def same_text(runs: dict[str, Run]) -> dict[str, float]:
    """Share of prompts whose completion equals batchstring's (greedy: they should, bar near-ties)."""
    ours = runs["batchstring"].texts
    return {name: float(np.mean([r.texts.get(i) == text for i, text in ours.items()]))
            for name, r in runs.items() if name != "batchstring" and r.texts}


def markdown(points: list[Point]) -> str:
    by = {(p.system, p.concurrency): p for p in points}
    lines = ["| callers | system | output tok/s | p50 | p99 | x llama.cpp |", "|---|---|---|---|---|---|"]
    for p in points:
        reference = by.get((REFERENCE, p.concurrency))
        ratio = f"{p.tokens_per_s / reference.tokens_per_s:.2f}x" if reference else "—"
        lines.append(f"| {p.concurrency} | {p.system} | {p.tokens_per_s:,.0f} | {p.p50_s * 1e3:.0f} ms | "
                     f"{p.p99_s * 1e3:.0f} ms | {ratio} |")
    return "\n".join(lines)


def command(args: argparse.Namespace) -> str:
    parts = ["batchstring peer-bench", *(["--model EXPORT"] if args.model else []), f"--prompts {args.prompts}",
             f"--repeats {args.repeats}",
             f"--max-tokens {args.max_tokens}",
             "--callers " + " ".join(map(str, args.callers))]
    if args.systems:
        parts.append("--systems " + " ".join(args.systems))
    parts += ["--prefix-caching"] * args.prefix_caching
    return " ".join(parts + [f"--param {p}" for p in args.param]
                    + ["--llama-server LLAMA_SERVER --gguf MODEL.gguf"] * bool(args.llama_server))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="our export to serve (default: the repository's), e.g. a quantized "
                                               "one (`batchstring quantize`) beside a GGUF of as many bits")
    p.add_argument("--llama-server", type=Path, help="a llama-server binary built from llama.cpp's source")
    p.add_argument("--gguf", type=Path, help="the shipped model converted to GGUF (f32), for llama-server")
    p.add_argument("--llama-spec-args", default=LLAMA_SPEC_ARGS,
                   help=f"llama-server flags for its own n-gram speculation (default: {LLAMA_SPEC_ARGS!r})")
    p.add_argument("--llama-threads", type=int, default=available_cores(),
                   help="llama-server threads (default: every core this process may use, as our small steps' "
                        "spinning threads do; 1 keeps it off a core other work needs: on 2 shared cores its "
                        "spinning barrier with 2 threads collapsed whenever anything else ran)")
    p.add_argument("--systems", nargs="*", choices=SYSTEMS, help="measure only these (default: all)")
    p.add_argument("--callers", nargs="+", type=int, default=list(CALLERS), help="closed-loop callers per level")
    p.add_argument("--prompts", type=int, default=256, help="prompts per system and level")
    p.add_argument("--repeats", type=int, default=1, help="runs per system and level; median tokens/s reported")
    p.add_argument("--prompt-tokens", nargs=2, type=int, default=[32, 192], metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per prompt (end of sequence ignored)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="engine parameter for our server (repeatable)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="let both sides reuse cached prompts (our prefix cache, llama-server's cache_prompt); "
                        "off by default: every prompt recurs in a run, and only ours would find it cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="results folder (default: results/peer-bench-<time>)")
