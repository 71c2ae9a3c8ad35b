"""`batchstring long-bench`: one long prompt served beside short callers, what it costs them.

A real server (`LocalServer`, the CPU config) on a long-context export (by default the random
32k-context checkpoint of the shipped shape that `engine-bench --only long` builds). `callers`
short callers stream greedy completions over gRPC back to back for the whole run; after
`baseline` seconds one long prompt (`long_tokens` tokens) goes to /v1/completions, streamed.
Every gap between two streamed pieces of a short caller is timestamped and falls in one of three
phases: before the long request (baseline), while it prefills (until its first token: its time to
first token), and while it decodes beside them. The table gives each phase's inter-token p50 and
p99 and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import numpy as np
from rich.console import Console
from rich.table import Table

PHASES = ("alone", "prefill", "decode")


@dataclass(frozen=True)
class Phase:
    name: str
    gaps: int
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True)
class LongServed:
    long_tokens: int
    ttft_s: float
    decode_s: float
    long_output_tokens: int
    phases: list[Phase]

    def ratio(self, phase: str, of: str = "p50_ms") -> float:
        by = {p.name: p for p in self.phases}
        return getattr(by[phase], of) / getattr(by["alone"], of)


def long_prompt(model_dir: Path, tokens: int) -> str:
    """Real source text (the stdlib's argparse, repeated) cut to `tokens` tokens of the model."""
    import sysconfig

    from batchstring.engine.tokenizer import TextCodec

    codec = TextCodec.from_file(model_dir / "tokenizer.json")
    source = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    text = source
    while len(codec.encode(text)) < tokens:
        text += source
    return codec.decode(codec.encode(text)[:tokens])


async def _short_callers(url: str, callers: int, stop: asyncio.Event, gaps: list[tuple[float, float]],
                         max_tokens: int) -> None:
    from batchstring.client import AsyncBatchClient

    async with AsyncBatchClient(url) as client:
        async def caller(i: int) -> None:
            while not stop.is_set():
                last = None
                async for _ in client.stream(f"# caller {i}\ndef handle_{i}(request):\n    ", max_tokens=max_tokens,
                                             ignore_eos=True):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now

        await asyncio.gather(*(caller(i) for i in range(callers)))


async def _long_request(http_url: str, prompt: str, max_tokens: int) -> tuple[float, float, float, int]:
    """(sent, first token, end) monotonic times and the pieces streamed, over /v1/completions."""
    body = {"model": "llm", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent = time.monotonic()
    first, pieces = None, 0
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session, \
            session.post(f"http://{http_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"the long request was refused: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                first = first or time.monotonic()
                pieces += 1
    return sent, first or time.monotonic(), time.monotonic(), pieces


async def measure(grpc_url: str, http_url: str, prompt: str, callers: int, baseline: float, long_max_tokens: int,
                  short_max_tokens: int) -> tuple[tuple[float, float, float, int], list[tuple[float, float]], float]:
    gaps: list[tuple[float, float]] = []
    stop = asyncio.Event()
    shorts = asyncio.create_task(_short_callers(grpc_url, callers, stop, gaps, short_max_tokens))
    await asyncio.sleep(2.0)  # every caller streaming before the baseline is counted
    began = time.monotonic()
    await asyncio.sleep(baseline)
    timing = await _long_request(http_url, prompt, long_max_tokens)
    stop.set()
    await shorts
    return timing, gaps, began


def summarize(timing: tuple[float, float, float, int], gaps: list[tuple[float, float]], began: float,
              tokens: int) -> LongServed:
    sent, first, end, pieces = timing
    windows = {"alone": (began, sent), "prefill": (sent, first), "decode": (first, end)}
    phases = []
    for name, (start, stop) in windows.items():
        values = np.array([gap for at, gap in gaps if start < at - gap and at <= stop]) * 1e3
        phases.append(Phase(name, len(values), float(np.percentile(values, 50)) if len(values) else float("nan"),
                            float(np.percentile(values, 99)) if len(values) else float("nan")))
    return LongServed(tokens, first - sent, end - first, pieces, phases)


def run(args: argparse.Namespace) -> int:
    from batchstring.loadtest.long_context import long_model
    from batchstring.server.local import LocalServer
    from batchstring.server.repository import repository_for

    console = Console(width=130)
    exported = long_model(args.model)
    prompt = long_prompt(exported, args.long_tokens)
    with tempfile.TemporaryDirectory(prefix="batchstring-long-") as tmp:
        repository = repository_for(exported, Path(tmp) / "repository")
        with console.status(f"serving {exported.name}; {args.callers} short callers, then one {args.long_tokens:,}-"
                            "token prompt"), LocalServer(config="cpu", repository=repository) as server:
            timing, gaps, began = asyncio.run(measure(server.grpc_url, server.http_url, prompt, args.callers,
                                                      args.baseline, args.long_max_tokens, args.short_max_tokens))
    result = summarize(timing, gaps, began, args.long_tokens)
    table = Table(title=f"{args.callers} short callers' inter-token latency while one {args.long_tokens:,}-token "
                        f"prompt is served beside them (/v1/completions, streamed; its TTFT {result.ttft_s:.1f} s, "
                        f"{result.long_output_tokens} pieces in {result.decode_s:.1f} s)")
    for col in ("phase", "gaps", "p50", "p99", "p50 / alone", "p99 / alone"):
        table.add_column(col, justify="right")
    for p in result.phases:
        table.add_row(p.name, str(p.gaps), f"{p.p50_ms:.1f} ms", f"{p.p99_ms:.1f} ms",
                      f"{result.ratio(p.name):.2f}x", f"{result.ratio(p.name, 'p99_ms'):.2f}x")
    console.print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(result), indent=2))
        console.print(f"wrote {args.out}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="exported long-context model (default: the 32k random one, built once)")
    p.add_argument("--long-tokens", type=int, default=16384, help="the long prompt's tokens")
    p.add_argument("--long-max-tokens", type=int, default=128)
    p.add_argument("--callers", type=int, default=16, help="short callers streaming throughout")
    p.add_argument("--short-max-tokens", type=int, default=64)
    p.add_argument("--baseline", type=float, default=15.0, help="seconds of short callers alone before")
    p.add_argument("--out", type=Path, default=Path("results/long-bench.json"))
