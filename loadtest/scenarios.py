"""`batchstring bench --scenario shared-prefix`: a workload the plain sweep does not show, run on
two servers that differ in one setting, taking turns, through Triton and our client.

shared-prefix  64 strings that start with the same 300-token instruction, each followed by its own
               20-60-token input, max_tokens 32. Throughput: one `batchstring` call of the 64.
               Time to first token: the same shape of call in which every 4th item streams (as in
               the sweep: streaming all 64 would measure the per-token messages on two shared
               cores more than the engine), all on one gRPC stream as `batchstring` sends them, so
               no item is favoured by arriving on a connection of its own. Prefix caching on vs
               off. Every call uses a new instruction, so the cache starts cold each time.

Long-prompt interference (chunked prefill on vs off) is measured in-process by `engine-bench`
(loadtest/interference.py): through the server on two shared cores, the gaps between streamed
pieces mostly measure the client's own scheduling jitter.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from batchstring.client import AsyncBatchClient
from batchstring.client.protocol import GenerationOptions, build_request
from batchstring.engine.tokenizer import TextCodec
from batchstring.export.layout import MODEL_VERSION_DIR
from batchstring.loadtest.workload import source_tokens
from batchstring.server.local import LocalServer

STREAM_EVERY = 4
SCENARIOS = {"shared-prefix": ("enable_prefix_caching", "prefix caching")}


@dataclass
class Outcome:
    setting: str  # "on" / "off"
    tokens_per_s: float
    ttft_p50_s: float | None = None
    extra: dict = field(default_factory=dict)


class Texts:
    """Windows of real source text with exact token counts (see loadtest/workload.py)."""

    def __init__(self, seed: int) -> None:
        self.codec = TextCodec.from_file(MODEL_VERSION_DIR / "tokenizer.json")
        self.source = source_tokens(self.codec)
        self.rng = np.random.default_rng(seed)

    def window(self, tokens: int) -> str:
        start = int(self.rng.integers(0, len(self.source) - tokens))
        return self.codec.decode(self.source[start : start + tokens])


async def _stream(client: AsyncBatchClient, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first piece, arrival times of the pieces, tokens asked for)."""
    began = time.perf_counter()
    arrivals = []
    async for _ in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
        arrivals.append(time.perf_counter())
    return arrivals[0] - began, arrivals, max_tokens


async def shared_prefix(url: str, texts: Texts) -> Outcome:
    def call() -> list[str]:
        instruction = texts.window(300)
        return [instruction + "\n" + texts.window(int(texts.rng.integers(20, 61))) for _ in range(64)]

    async with AsyncBatchClient(url) as client:
        await client.batchstring(["warm"], max_tokens=1)  # the connection is open before the clock starts
        prompts = call()
        began = time.perf_counter()
        await client.batchstring(prompts, max_tokens=32, ignore_eos=True)
        seconds = time.perf_counter() - began
        stream = client.connections[0].open_stream()  # every item on one stream, as batchstring sends them

        async def item(i: int, prompt: str) -> float | None:
            request = build_request(f"ttft-{i}-{time.monotonic_ns()}", prompt.encode(),
                                    GenerationOptions(max_tokens=32, ignore_eos=True, temperature=0.0),
                                    stream=i % STREAM_EVERY == 0)
            started = time.perf_counter()
            first = None
            async for _ in stream.request(request):
                first = first or time.perf_counter() - started
            return first if i % STREAM_EVERY == 0 else None

        ttfts = [t for t in await asyncio.gather(*(item(i, p) for i, p in enumerate(call()))) if t is not None]
    return Outcome("", 32 * len(prompts) / seconds, ttft_p50_s=float(np.median(ttfts)))


def run_scenario(name: str, repeats: int, seed: int = 0, progress=None,
                 params: dict[str, str] | None = None) -> list[Outcome]:
    """Both settings, taking turns, `repeats` times each; medians per setting. `params` apply to both."""
    key, _ = SCENARIOS[name]
    servers = {s: LocalServer(config="cpu", params={**(params or {}), key: "true" if s == "on" else "false"}).start()
               for s in ("on", "off")}
    texts = Texts(seed)
    runs: dict[str, list[Outcome]] = {"on": [], "off": []}
    try:
        for _ in range(repeats):
            for setting, server in servers.items():
                runs[setting].append(asyncio.run(shared_prefix(server.grpc_url, texts)))
                if progress:
                    progress()
    finally:
        for server in servers.values():
            server.close()
    return [_median(setting, outcomes) for setting, outcomes in runs.items()]


def _median(setting: str, outcomes: list[Outcome]) -> Outcome:
    def med(attr: str) -> float | None:
        values = [getattr(o, attr) for o in outcomes if getattr(o, attr) is not None]
        return float(np.median(values)) if values else None

    return Outcome(setting, med("tokens_per_s"), med("ttft_p50_s"), {"repeats": len(outcomes)})


def markdown(name: str, outcomes: list[Outcome]) -> str:
    _, label = SCENARIOS[name]
    on, off = (next(o for o in outcomes if o.setting == s) for s in ("on", "off"))
    rows = [f"| {label} | output tok/s | TTFT p50 |", "|---|---|---|"]
    rows += [f"| {o.setting} | {o.tokens_per_s:.0f} | {o.ttft_p50_s:.3f} s |" for o in (on, off)]
    rows.append(f"| **on / off** | **{on.tokens_per_s / off.tokens_per_s:.2f}x** | "
                f"**{off.ttft_p50_s / on.ttft_p50_s:.2f}x lower** |")
    return "\n".join(rows)
