"""`batchstring gpu-check` (`make gpu-check`): the GPU acceptance run, one command, a few minutes.

Nothing in this repository had run on a GPU before the first machine with one ran this. It
checks, in order, and writes a report (results/gpu-check/report.md, for BENCHMARKS.md):

1. environment: the GPU (nvidia-smi), torch's CUDA, onnxruntime's CUDA provider (installs
   onnxruntime-gpu into the environment if it is missing);
2. export: the default model in float16 (the GPU default) into a scratch repository;
3. numerics on the device: ONNX Runtime (CUDA) and TorchScript (CUDA) greedy tokens against the
   Hugging Face model run in float16 on the same GPU, agreement measured per runtime;
4. host time per step on the device (the engine's Python next to the runner), batch 1 and 64;
5. serving: tritonserver with the GPU config (KIND_GPU, `kv_cache_tokens: auto`), 64 strings
   through the client equal to the in-process engine's, and served output tokens/s at 64 callers.

`--dry-run` checks what can be checked without a GPU (the plan, the repository, the GPU config,
tritonserver) and prints the plan; `make test` runs it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batchstring.export.layout import DEFAULT_MODEL_DIR, MODEL_VERSION_DIR, REPO_ROOT

ORT_GPU = "onnxruntime-gpu==1.32.0"
PROMPTS = [f"def task_{i}(items):\n    " for i in range(64)]
RUNTIMES = ("onnxruntime", "torchscript")


@dataclass
class Check:
    name: str
    plan: str
    run: Callable[[dict], list[str]]  # context -> report lines
    status: str = "not run"
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


def gpu_visible() -> str | None:
    """The GPUs nvidia-smi lists, or None."""
    if not shutil.which("nvidia-smi"):
        return None
    result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


# ----- the checks ------------------------------------------------------------------------------


def environment(ctx: dict) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} has no CUDA here; install a CUDA build of torch")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", ORT_GPU], check=True)
        raise RuntimeError(f"installed {ORT_GPU} (onnxruntime had no CUDA provider): run `make gpu-check` again")
    ctx["device"] = "cuda:0"
    providers = ", ".join(ort.get_available_providers())
    return [f"GPU: {ctx['gpus']}", f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{torch.cuda.get_device_name(0)}", f"onnxruntime {ort.__version__}: {providers}"]


def export_float16(ctx: dict) -> list[str]:
    from batchstring.export.exporter import export_model

    repository = Path(ctx["scratch"]) / "repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("1"))
    version = repository / "llm" / "1"
    version.mkdir(parents=True)
    for name in ("model.py", "responder.py", "metrics.py"):
        shutil.copy(MODEL_VERSION_DIR / name, version / name)
    result = export_model(DEFAULT_MODEL_DIR, version, dtype="float16")
    ctx["repository"], ctx["model_dir"] = repository, version
    return [f"float16 export in {result.seconds:.0f} s; max |Δ| vs HF (CPU runtimes): "
            + ", ".join(f"{k} {v:.1e}" for k, v in result.max_diff.items())]


def device_numerics(ctx: dict) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.sampling import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float16).to(ctx["device"]).eval()
    lines = []
    for runtime in RUNTIMES:
        engine = EngineCore(EngineConfig(model_dir=ctx["model_dir"], runtime=runtime, device=ctx["device"]))
        same = 0
        for prompt in PROMPTS[:16]:
            ids = engine.codec.encode(prompt)
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids], device=ctx["device"]), max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False)[0, len(ids):].tolist()
            seq = engine.make_sequence(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                                       lambda out: None)
            engine.generate([seq])
            same += seq.output_ids == ref
        lines.append(f"{runtime} on {ctx['device']}, float16: greedy identical to HF float16 for {same}/16 prompts")
    return lines


def host_time(ctx: dict) -> list[str]:
    from batchstring.loadtest.host_overhead import measure

    lines = ["| runtime | sampling | batch | runner ms/step | host ms/step | host share |", "|---|---|---|---|---|---|"]
    for runtime in RUNTIMES:
        for mode in ("greedy", "top_p 0.95"):
            for batch in (1, 64):
                r = measure(ctx["model_dir"], mode, batch, repeats=3, runtime=runtime, device=ctx["device"])
                lines.append(f"| {runtime} | {mode} | {batch} | {r.runner_ms:.2f} | {r.host_ms:.2f} | {r.share:.1%} |")
    return lines


def serving(ctx: dict) -> list[str]:
    import asyncio

    from batchstring.client import AsyncBatchClient, BatchClient
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.sampling import SamplingParams
    from batchstring.server.local import LocalServer

    engine = EngineCore(EngineConfig(model_dir=ctx["model_dir"], device=ctx["device"]))
    expected = []
    for prompt in PROMPTS:
        seq = engine.make_sequence(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                                   lambda out: None)
        engine.generate([seq])
        expected.append(engine.codec.decode(seq.output_ids))
    del engine
    with LocalServer(config="gpu", repository=ctx["repository"]) as server:
        with BatchClient(server.grpc_url) as client:
            got = client.batchstring(PROMPTS, max_tokens=24, ignore_eos=True)
        same = sum(a == b for a, b in zip(got, expected))

        async def load() -> float:
            async with AsyncBatchClient(server.grpc_url) as aio:
                began = time.perf_counter()
                await asyncio.gather(*(aio.batchstring([p], max_tokens=128, ignore_eos=True) for p in PROMPTS * 4))
                return 256 * 128 / (time.perf_counter() - began)

        rate = asyncio.run(load())
    if same < len(PROMPTS):
        raise RuntimeError(f"served greedy output differs from the in-process engine for {len(PROMPTS) - same} "
                           "of 64 strings")
    return ["served (gpu config, kv_cache_tokens auto): 64/64 strings equal the in-process engine",
            f"served, 64 callers x 4 strings, 128 tokens each: {rate:.0f} output tokens/s"]


CHECKS = [
    Check("environment", "nvidia-smi, torch CUDA, onnxruntime CUDA provider", environment),
    Check("export float16", "batchstring export --dtype float16 into a scratch repository", export_float16),
    Check("numerics on the device", "greedy tokens, ONNX Runtime and TorchScript on CUDA vs HF float16",
          device_numerics),
    Check("host time on the device", "engine host ms vs runner ms per step, batch 1 and 64", host_time),
    Check("serving", "tritonserver --config gpu (kv auto): correctness and output tokens/s at 64 callers", serving),
]


# ----- running ---------------------------------------------------------------------------------


def dry_run() -> int:
    """What can be checked without a GPU: the plan, the exported model, the GPU config, tritonserver."""
    from batchstring.export.layout import missing_artifacts
    from batchstring.server.repository import load_config, parameters
    from batchstring.server.triton import TritonInstall

    problems = []
    missing = missing_artifacts(MODEL_VERSION_DIR)
    if missing:
        problems.append(f"the default model is not exported ({', '.join(missing)}): run `make export`")
    config = load_config()
    kinds = {g.kind for g in config.instance_group}
    if kinds != {config.instance_group[0].KIND_GPU}:
        problems.append("config.pbtxt does not place the model on a GPU")
    if parameters(config).get("kv_cache_tokens") != "auto":
        problems.append("config.pbtxt does not size the KV cache from memory (kv_cache_tokens: auto)")
    try:
        binary = TritonInstall.find().binary
    except Exception as exc:  # reported, with the rest
        problems.append(f"tritonserver not found ({exc})")
        binary = None
    print("batchstring gpu-check --dry-run: the plan")
    for i, check in enumerate(CHECKS, 1):
        print(f"  {i}. {check.name}: {check.plan}")
    print(f"GPU here: {gpu_visible() or 'none'}; tritonserver: {binary}; report: results/gpu-check/report.md")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if problems else 0


def run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return dry_run()
    gpus = gpu_visible()
    if gpus is None:
        print("batchstring gpu-check: no GPU visible here (nvidia-smi lists none). Run it on a machine with an "
              "NVIDIA GPU, or `batchstring gpu-check --dry-run` to check the plan.", file=sys.stderr)
        return 2
    out = args.out or REPO_ROOT / "results" / "gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="batchstring-gpu-check-") as scratch:
        ctx = {"gpus": gpus, "scratch": scratch}
        for i, check in enumerate(CHECKS, 1):
            print(f"[{i}/{len(CHECKS)}] {check.name}: {check.plan}...", flush=True)
            began = time.monotonic()
            try:
                check.lines = check.run(ctx)
                check.status = "pass"
            except Exception as exc:  # recorded in the report; later checks that need it fail too
                check.status = "FAIL"
                check.lines = [f"{type(exc).__name__}: {exc}", *traceback.format_exc().splitlines()[-6:]]
            check.seconds = time.monotonic() - began
            print(f"    {check.status} in {check.seconds:.0f} s", flush=True)
            for line in check.lines:
                print(f"    {line}", flush=True)
    report = render(gpus)
    (out / "report.md").write_text(report)
    (out / "report.json").write_text(json.dumps([{"name": c.name, "status": c.status, "seconds": c.seconds,
                                                  "lines": c.lines} for c in CHECKS], indent=2))
    print(f"\nreport: {out / 'report.md'}")
    return 0 if all(c.status == "pass" for c in CHECKS) else 1


def render(gpus: str) -> str:
    parts = [f"## GPU acceptance run (`make gpu-check`), {time.strftime('%Y-%m-%d')}", "", f"GPU: {gpus}", ""]
    for check in CHECKS:
        parts += [f"### {check.name}: {check.status} ({check.seconds:.0f} s)", "", *check.lines, ""]
    return "\n".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="check the plan and what needs no GPU; print the plan")
    p.add_argument("--out", type=Path, help="report folder (default: results/gpu-check)")
