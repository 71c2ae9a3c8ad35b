"""`batchstring genai-perf` (`make genai-perf`): NVIDIA's LLM benchmark against our server, beside ours.

genai-perf 0.0.16 drives the model unmodified (vLLM-backend contract, streaming, gRPC) through
perf_analyzer. PyPI's `perf-analyzer` package is a placeholder without the binary, so the real
one is taken from the tritonclient 2.51.0 wheel (the version of our server), with the two
libraries it links: libb64 (the copy bundled in nvidia-pytriton) and libcudart (PyPI's CUDA
runtime wheel). genai-perf and its dependencies live in their own virtualenv, `.venv-genai-perf`,
so they cannot disturb the project's pinned stack.

Then the same shape of work (same prompt length, output length and concurrency, streaming) is
run through our own client, and both output-token throughputs are printed side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
import venv
import zipfile
from pathlib import Path

from batchstring.client import AsyncBatchClient
from batchstring.export.layout import DEFAULT_MODEL_DIR, REPO_ROOT
from batchstring.loadtest.workload import mixed
from batchstring.server.local import LocalServer
from batchstring.server.stats import SETTLE_SECONDS, metrics

TOOLS = REPO_ROOT / ".venv-genai-perf"
GENAI_PERF = "genai-perf==0.0.16"
CUDA_RUNTIME = "nvidia-cuda-runtime-cu12==12.9.79"
TRITONCLIENT_WHEEL = "tritonclient==2.51.0"
PERF_ANALYZER_MEMBER = "tritonclient-2.51.0.data/data/bin/perf_analyzer"


def _pip(*args: str) -> None:
    subprocess.run([str(TOOLS / "bin" / "python"), "-m", "pip", "install", "--quiet", *args], check=True)


def ensure_tools() -> dict[str, str]:
    """Installs genai-perf and a working perf_analyzer once; returns the environment to run them."""
    if not (TOOLS / "bin" / "genai-perf").exists():
        print(f"installing {GENAI_PERF} into {TOOLS.name}/ (once, ~1 GB)...", flush=True)
        venv.create(TOOLS, with_pip=True)
        _pip(GENAI_PERF, CUDA_RUNTIME)
    binary = TOOLS / "bin" / "perf_analyzer"
    if not binary.exists() or binary.stat().st_size < 1_000_000:  # the PyPI placeholder is a script
        wheels = TOOLS / "wheels"
        subprocess.run([str(TOOLS / "bin" / "python"), "-m", "pip", "download", "--quiet", "--no-deps",
                        "--dest", str(wheels), TRITONCLIENT_WHEEL], check=True)
        wheel = next(wheels.glob("tritonclient-2.51.0-*.whl"))
        binary.unlink(missing_ok=True)
        binary.write_bytes(zipfile.ZipFile(wheel).read(PERF_ANALYZER_MEMBER))
        binary.chmod(0o755)
    libs = TOOLS / "perf-analyzer-libs"
    libs.mkdir(exist_ok=True)
    import pytriton

    bundled = next((Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs").glob("libb64-*.so.0d"))
    link = libs / "libb64.so.0d"
    if not link.exists():
        link.symlink_to(bundled)
    cudart = next(TOOLS.glob("lib/python*/site-packages/nvidia/cuda_runtime/lib"))
    env = dict(os.environ)
    env["PATH"] = f"{TOOLS / 'bin'}{os.pathsep}{env['PATH']}"
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), str(cudart), env.get("LD_LIBRARY_PATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    return env


def run_genai_perf(env: dict[str, str], server: LocalServer, args: argparse.Namespace, out: Path) -> dict:
    """Triton's KServe gRPC route with the vLLM-backend contract, or our OpenAI-compatible API
    (`--endpoint openai`: genai-perf's own `completions` endpoint type, over HTTP, unmodified)."""
    target = (["--endpoint-type", "completions", "-u", f"http://{server.http_url}"] if args.endpoint == "openai"
              else ["--endpoint-type", "kserve", "--backend", "vllm", "-u", server.grpc_url])
    command = [
        str(TOOLS / "bin" / "genai-perf"), "profile", "-m", "llm", *target, "--streaming",
        "--concurrency", str(args.concurrency),
        "--tokenizer", str(DEFAULT_MODEL_DIR),
        "--synthetic-input-tokens-mean", str(args.input_tokens), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
        "--num-prompts", "100", "--measurement-interval", str(args.seconds * 1000), "--artifact-dir", str(out),
    ]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, env=env, check=True)
    return json.loads(next(out.glob("*/profile_export_genai_perf.json")).read_text())


def run_ours(server: LocalServer, args: argparse.Namespace) -> dict:
    """Same work through our client: streaming, same lengths and concurrency, for `seconds`.

    Output tokens are counted by the server (its generated-tokens counter), not re-tokenised.
    """
    items = iter(mixed(4096, prompt_tokens=(args.input_tokens, args.input_tokens),
                       max_tokens=(args.output_tokens, args.output_tokens), seed=7))

    async def drive() -> tuple[float, float, int]:
        done = 0
        async with AsyncBatchClient(server.grpc_url) as client:
            deadline = time.monotonic() + args.seconds

            async def caller() -> None:
                nonlocal done
                for item in items:  # one iterator shared by all callers
                    if time.monotonic() > deadline:
                        return
                    # temperature=None: the server default, which is what genai-perf gets too
                    async for _ in client.stream(item.prompt, max_tokens=item.max_tokens, temperature=None):
                        pass
                    done += 1

            before = metrics(server.metrics_url)["batchstring_generated_tokens_total"]
            began = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(args.concurrency)))
            seconds = time.perf_counter() - began
            await asyncio.sleep(SETTLE_SECONDS)  # until the model has published what it did
            return metrics(server.metrics_url)["batchstring_generated_tokens_total"] - before, seconds, done

    tokens, seconds, requests = asyncio.run(drive())
    return {"output_token_throughput": tokens / seconds, "request_throughput": requests / seconds}


def run(args: argparse.Namespace) -> int:
    env = ensure_tools()
    out = args.out or Path("results") / time.strftime("genai-perf-%Y%m%d-%H%M%S")
    with LocalServer(config="cpu") as server:
        theirs = run_genai_perf(env, server, args, out)
        time.sleep(2)
        ours = run_ours(server, args)
    g_tps = theirs["output_token_throughput"]["avg"]
    o_tps = ours["output_token_throughput"]
    summary = {"endpoint": args.endpoint, "concurrency": args.concurrency, "input_tokens": args.input_tokens,
               "output_tokens": args.output_tokens,
               "genai_perf_output_tokens_per_s": g_tps, "ours_output_tokens_per_s": o_tps,
               "ratio_ours_to_genai_perf": o_tps / g_tps,
               "genai_perf_ttft_p50_ms": theirs["time_to_first_token"]["p50"],
               "genai_perf_request_throughput": theirs["request_throughput"]["avg"],
               "ours_request_throughput": ours["request_throughput"]}
    (out / "comparison.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{args.endpoint} endpoint, concurrency {args.concurrency}, {args.input_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens, streaming:")
    print(f"  genai-perf : {g_tps:8.1f} output tokens/s  ({summary['genai_perf_request_throughput']:.2f} req/s)")
    print(f"  ours       : {o_tps:8.1f} output tokens/s  ({summary['ours_request_throughput']:.2f} req/s)")
    print(f"  ratio      : {summary['ratio_ours_to_genai_perf']:.2f}   (artifacts in {out}/)")
    return 0 if abs(summary["ratio_ours_to_genai_perf"] - 1) <= 0.15 else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", choices=("kserve", "openai"), default="kserve",
                   help="kserve: Triton's gRPC route (vLLM-backend contract); openai: our /v1/completions")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-tokens", type=int, default=100)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--seconds", type=int, default=20, help="measurement window of each tool")
    p.add_argument("--out", type=Path, help="results folder (default: results/genai-perf-<time>)")
