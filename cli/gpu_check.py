"""`batchstring gpu-check`: the device check, one command from a plain checkout.

Tier 1 (the default) needs only a GPU and the checkout: torch, transformers, tokenizers,
safetensors and numpy, no package index, no tritonserver, no ONNX Runtime (`python3 -m
batchstring.cli gpu-check`, within `BUDGET_SECONDS`). Stage by stage, each under its own time
limit and each written to results/gpu-check/report.md and report.json as soon as it ends:

1. environment: the device, its memory, the versions;
2. a synthetic Llama-3.2-1B-shaped checkpoint, built here (export/synthetic.py);
3. for the shipped model and the synthetic one, in float16 and bfloat16: the TorchScript step
   traced on the CPU (as `batchstring export` does), loaded onto the device, its logits and new
   keys/values checked against HF eager on the same device (the float32 truth, with HF's own
   16-bit forward as the yardstick: the export's tolerance rule), and greedy agreement with HF
   `generate` in the same dtype (measured; 16-bit rounding flips near-ties);
4. for each model, the in-process engine on the device with `kv_cache_tokens: auto` (its
   start-up line reported): output tokens/s at batch 1, 16, 64 and 256, the device time per step
   from CUDA events next to the host time, HF `generate` on the same prompts as the side-by-side
   reference, one long-context row among short ones (its greedy tokens against its run alone, and
   the device time per decode step beside the short rows alone);
5. decode steps replayed from CUDA graphs (`cuda_graphs`) against without: the same greedy tokens,
   and device time per step beside each other;
6. structured output (where llguidance is installed; tier 1 does not need it): JSON-schema
   requests against free ones of as many tokens, and with forced-token skipping against without,
   in runs taking turns at batch 16 and 64: tokens/s, requests/s, device and host time per step,
   every completion parsed.

`--device cpu --quick` runs the same stages on the CPU with tiny shapes and few tokens (`make
test` runs it). Tier 2, `--full`, adds what needs a GPU host with an index and `make install`:
ONNX Runtime's CUDA provider (the `gpu` extra), the ONNX step on the device, its int8 and int4
quantizations beside it (greedy tokens and time per step, taking turns), and tritonserver serving
the GPU config. Exit status: 0 all passed, 1 a check failed, 2 no GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from batchstring.export.layout import DEFAULT_MODEL_DIR, MODEL_VERSION_DIR, REPO_ROOT

BUDGET_SECONDS = 480  # tier 1: one command of at most 8 minutes (the acceptance machine allows 10)
FULL_BUDGET_SECONDS = 1500
SHIPPED = "shipped model"
SYNTHETIC = "synthetic Llama-3.2-1B shape"
DTYPES = ("float16", "bfloat16")
QUANTIZED_ROUNDS = 3  # runs of each step, taking turns, in the quantized stage


class CheckFailed(RuntimeError):
    """A check that ran and found the device path wrong."""


class StageTimeout(RuntimeError):
    pass


@dataclass(frozen=True)
class Scope:
    """How much a run covers: the real shapes on a GPU, or tiny ones with few tokens (`--quick`)."""

    device: str
    quick: bool

    @property
    def synthetic_shape(self) -> str:
        return "tiny-llama-3" if self.quick else "llama-3.2-1b"

    @property
    def cases(self) -> list[tuple[int, int]]:
        from batchstring.export.verify import CASES

        return [(1, 0), (3, 17)] if self.quick else CASES

    @property
    def greedy(self) -> tuple[tuple[str, ...], int]:
        from batchstring.export.verify import GREEDY_PROMPTS, GREEDY_TOKENS

        return (GREEDY_PROMPTS[:1], 8) if self.quick else (GREEDY_PROMPTS, GREEDY_TOKENS)

    @property
    def batches(self) -> tuple[int, ...]:
        return (1, 4) if self.quick else (1, 16, 64, 256)

    @property
    def max_tokens(self) -> int:
        return 8 if self.quick else 64

    @property
    def long_prompt(self) -> int:
        return 200 if self.quick else 8192

    def limit(self, seconds: int) -> int:
        """A stage's time limit: the GPU figure, or a CPU one for the tiny shapes (shared cores)."""
        return 120 if self.quick else seconds


@dataclass
class Stage:
    name: str
    limit: int  # seconds
    run: Callable[[dict], list[str]]  # context -> report lines
    status: str = "not run"
    lines: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ----- stages -----------------------------------------------------------------------------------


def environment(ctx: dict) -> list[str]:
    import numpy
    import torch
    import transformers

    device = ctx["scope"].device
    lines = [f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"transformers {transformers.__version__}, numpy {numpy.__version__}"]
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        lines.append(f"{device}: {torch.cuda.get_device_name(torch.device(device))}, "
                     f"{total / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    else:
        lines.append(f"device: cpu ({platform.processor() or platform.machine()})")
    optional = {name: importlib.util.find_spec(name) is not None for name in ("onnxruntime", "tritonclient")}
    lines.append("optional (tier 2): " + ", ".join(f"{k} {'present' if v else 'absent'}" for k, v in optional.items())
                 + f"; tritonserver {'on PATH' if shutil.which('tritonserver') else 'absent'}")
    return lines


def synthetic_checkpoint(ctx: dict) -> list[str]:
    import torch

    from batchstring.export.synthetic import SHAPES, describe, random_checkpoint

    config, tokenizer_vocab = SHAPES[ctx["scope"].synthetic_shape]
    path = random_checkpoint(Path(ctx["scratch"]) / "synthetic", config(), dtype=torch.bfloat16,
                             tokenizer_vocab=tokenizer_vocab)
    ctx["models"][SYNTHETIC] = path
    return [f"{ctx['scope'].synthetic_shape}: {describe(path)}, random weights, built here"]


def step_on_device(model: str, dtype: str) -> Callable[[dict], list[str]]:
    def run(ctx: dict) -> list[str]:
        return export_and_verify(ctx, model, dtype)

    return run


def export_and_verify(ctx: dict, model: str, dtype: str) -> list[str]:
    """The TorchScript step traced on the CPU, then checked on the device against HF there."""
    import numpy as np
    import torch

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export import artifacts
    from batchstring.export.exporter import decoder_step, load_checkpoint, torchscript_step, write_model_files
    from batchstring.export.verify import HF_16BIT, tolerance_failures, verify_greedy, verify_logits

    scope, source = ctx["scope"], ctx["models"][model]
    out = Path(ctx["scratch"]) / "exports" / f"{source.name}-{dtype}"
    out.mkdir(parents=True)
    began = time.monotonic()
    hf_16bit = load_checkpoint(source, dtype)
    step, eos = decoder_step(hf_16bit, source)
    artifacts.write_torchscript(step, out / "model.pt")
    write_model_files(step, hf_16bit, eos, source, out)
    sites = step.adapter_sites()
    del step
    pinned = artifacts.device_constants(out / "model.pt")
    if pinned:
        raise CheckFailed(f"the traced step names a device: {pinned[:3]}")
    host = artifacts.host_scalars(out / "model.pt")
    if host:
        raise CheckFailed(f"the traced step hands a host scalar to a device operator: {host[:3]}")
    size = (out / "model.pt").stat().st_size / 2**20
    lines = [f"traced on the CPU and saved in {time.monotonic() - began:.1f} s ({size:.0f} MiB); "
             "no device constant and no host scalar beyond arithmetic in the saved code"]
    ctx["exports"][(model, dtype)] = out
    device = scope.device
    truth = load_checkpoint(source, "float32").to(device)
    hf_16bit = hf_16bit.to(device)
    runtimes = {"torchscript": torchscript_step(out / "model.pt", getattr(torch, dtype), sites, device)}
    cases = verify_logits(truth, runtimes, eos, relative=True, hf_16bit=hf_16bit, cases=scope.cases)
    del truth
    prompts, tokens = scope.greedy
    codec = TextCodec.from_file(out / "tokenizer.json")
    greedy = verify_greedy(hf_16bit, codec.encode, eos, runtimes, np.float32, prompts, tokens,
                           vocabulary=codec.known_ids())
    del hf_16bit, runtimes
    _free_device(device)
    worst = max(cases, key=lambda c: c.max_diff["torchscript"] / max(c.max_diff[HF_16BIT], 1e-12))
    same = sum(ok["torchscript"] for ok in greedy.values())
    lines += [f"logits and new K/V on {device}, max |Δ|/max(1,|truth|) vs HF float32 on {device}: "
              + ", ".join(f"{c.batch} rows past {c.past}: {c.max_diff['torchscript']:.1e} "
                          f"(HF {dtype} {c.max_diff[HF_16BIT]:.1e})" for c in cases),
              f"worst against the rule (2 x HF's own {dtype} error, at least the {dtype} floor): "
              f"{worst.batch} rows, past {worst.past}",
              f"greedy {tokens} tokens identical to HF generate in {dtype} on {device}: {same}/{len(greedy)} prompts "
              "(measured, not required: 16-bit rounding flips near-ties)"]
    failures = tolerance_failures(cases, dtype)
    if failures:
        raise CheckFailed("; ".join(failures[:4]))
    return lines


def _free_device(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class TimedRunner:
    """The engine's runner, with each step's wall time and, on CUDA, its device time (CUDA events)."""

    def __init__(self, runner, cuda: bool) -> None:
        self.runner, self.cuda = runner, cuda
        self.wall, self.events = 0.0, []

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def reset(self) -> None:
        self.wall, self.events = 0.0, []

    def step(self, batch):
        import torch

        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        out = self.runner.step(batch)
        self.wall += time.perf_counter() - began
        if self.cuda:
            end.record()
            self.events.append((start, end))
        return out

    def device_seconds(self) -> float | None:
        import torch

        if not self.cuda:
            return None
        torch.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.events) / 1e3


def engine_on_device(model: str, dtype: str) -> Callable[[dict], list[str]]:
    def run(ctx: dict) -> list[str]:
        return engine_check(ctx, model, dtype)

    return run


def _prompts(count: int) -> list[str]:
    return [f"def task_{i}(items):\n    total = 0\n    for item in items:\n" for i in range(count)]


def engine_check(ctx: dict, model: str, dtype: str) -> list[str]:
    from batchstring.engine.config import AUTO, EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.memory import plan_cache
    from batchstring.engine.runner import RuntimeSpec, build_runner

    scope = ctx["scope"]
    model_dir = ctx["exports"].get((model, dtype))
    if model_dir is None:
        raise CheckFailed(f"the {dtype} export of the {model} did not succeed (see its stage)")
    seqs = max(scope.batches)
    config = EngineConfig(model_dir=model_dir, runtime="torchscript", device=scope.device, kv_cache_tokens=AUTO,
                          max_num_seqs=seqs, max_waiting_seqs=seqs, max_num_batched_tokens=max(256, 16 * seqs),
                          long_prefill_token_threshold=128 if scope.quick else 1024)
    spec = RuntimeSpec.load(model_dir / "runtime.json")
    plan = plan_cache(config, spec, model_dir)
    if plan.tokens > seqs * spec.context_length:
        raise CheckFailed(f"auto sized the cache past what {seqs} sequences can use: {plan.reason}")
    lines = [f"kv_cache_tokens auto on {scope.device}: {plan.reason}"]
    blocks = -(-plan.tokens // config.block_size)
    runner = TimedRunner(build_runner("torchscript", model_dir, spec, blocks, config.block_size, scope.device, 0,
                                      plan.arena_bytes),
                         scope.device.startswith("cuda"))
    core = EngineCore(dataclasses.replace(config, kv_cache_tokens=plan.tokens), runner)
    core.warm_up()
    reference = HFReference(ctx["models"][model], dtype, scope.device)
    lines += ["| batch | engine output tok/s | HF generate tok/s | engine / HF | steps | device ms/step (CUDA events) "
              "| runner ms/step | host ms/step |", "|---|---|---|---|---|---|---|---|"]
    for batch in scope.batches:
        lines.append(_throughput_row(core, runner, reference, _prompts(batch), scope.max_tokens))
    lines.append(_long_row(core, scope, spec.context_length))
    lines.append(_long_timing(core, runner, scope, spec))
    del core, runner, reference
    _free_device(scope.device)
    return lines


def _generate(core, prompts: list[str], max_tokens: int) -> list:
    from batchstring.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [core.make_sequence(p, params, lambda out: None) for p in prompts]
    core.generate(seqs)
    short = [s for s in seqs if len(s.output_ids) != max_tokens]
    if short:
        raise CheckFailed(f"{len(short)} of {len(seqs)} sequences ended with fewer than {max_tokens} tokens")
    return seqs


def _throughput_row(core, runner: TimedRunner, reference: HFReference, prompts: list[str], max_tokens: int) -> str:
    runner.reset()
    steps = core.stats.steps
    began = time.perf_counter()
    _generate(core, prompts, max_tokens)
    wall = time.perf_counter() - began
    steps = core.stats.steps - steps
    device = runner.device_seconds()
    hf_seconds = reference.generate([core.codec.encode(p) for p in prompts], max_tokens)
    tokens = len(prompts) * max_tokens
    device_ms = f"{device / steps * 1e3:.2f}" if device is not None else "n/a (CPU)"
    return (f"| {len(prompts)} | {tokens / wall:,.0f} | {tokens / hf_seconds:,.0f} | {hf_seconds / wall:.2f}x "
            f"| {steps} | {device_ms} | {runner.wall / steps * 1e3:.2f} | {(wall - runner.wall) / steps * 1e3:.2f} |")


def _long_row(core, scope: Scope, context: int) -> str:
    """One prompt near the context (up to scope.long_prompt tokens) among short ones: every row
    runs its full length, and the long row's greedy tokens are compared with its run alone."""
    target = min(scope.long_prompt, context - scope.max_tokens - 8)
    unit = "def handle(request):\n    return request.body\n"
    long_prompt = unit
    while len(core.codec.encode(long_prompt + unit)) <= target:
        long_prompt += unit
    mixed = _generate(core, [long_prompt, *_prompts(7)], scope.max_tokens)
    alone = _generate(core, [long_prompt], scope.max_tokens)
    same = mixed[0].output_ids == alone[0].output_ids
    return (f"long-context row: a {len(mixed[0].prompt_ids)}-token prompt among 7 short ones, every row ran its "
            f"{scope.max_tokens} tokens; its greedy tokens {'equal' if same else 'DIFFER from'} its run alone")


def _long_timing(core, runner: TimedRunner, scope: Scope, spec) -> str:
    """Device time per decode step of one long row among short ones against the short rows alone
    (rows set up as a prefill leaves them: loadtest/long_context.py), taking turns."""
    from batchstring.engine.batch import build_step
    from batchstring.loadtest.long_context import SHORT, decoding

    blocks = core.scheduler.blocks
    rows = min(64, max(scope.batches))
    long = min(scope.long_prompt, spec.context_length - 1)
    cases = {"short": [SHORT] * rows, "mixed": [SHORT] * (rows - 1) + [long]}
    timings: dict[str, list[float]] = {name: [] for name in cases}
    group = max(1, spec.num_heads // spec.num_kv_heads)
    for _ in range(3):
        for name, pasts in cases.items():
            work = decoding(blocks, pasts)
            batch = build_step(work, blocks, query_group=group)
            runner.step(batch)
            runner.reset()
            for _ in range(5):
                runner.step(batch)
            device = runner.device_seconds()
            timings[name].append((device if device is not None else runner.wall) / 5 * 1e3)
            for w in work:
                blocks.release(w.seq)
    short, mixed = (sorted(timings[name])[1] for name in cases)
    sums = sum(cases["mixed"]) / sum(cases["short"])
    kind = "device" if scope.device.startswith("cuda") else "wall"
    return (f"long row among short ones: {rows - 1} rows of {SHORT} past tokens and one of {long}: {mixed:.2f} ms "
            f"of {kind} time per decode step, against {short:.2f} ms for {rows} rows of {SHORT} ({mixed / short:.2f}x; "
            f"the contexts sum to {sums:.2f}x)")


def cuda_graphs(ctx: dict) -> list[str]:
    """The engine with decode steps replayed from CUDA graphs against without, on the device: the
    same greedy tokens, and device time per step beside each other."""
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.runner import RuntimeSpec, build_runner

    scope = ctx["scope"]
    if not scope.device.startswith("cuda"):
        return ["not run on the CPU: graphs are captured on CUDA devices only; the bucketed step they hold is "
                "checked against the unpadded one on the CPU by the tests (tests/test_long_context.py)"]
    model_dir = ctx["exports"].get((SHIPPED, "float16"))
    if model_dir is None:
        raise CheckFailed(f"the float16 export of the {SHIPPED} did not succeed (see its stage)")
    spec = RuntimeSpec.load(model_dir / "runtime.json")
    outputs = {}
    lines = ["| batch | device ms/step without graphs | with graphs | graphs captured |", "|---|---|---|---|"]
    timings: dict[int, list[str]] = {}
    for graphs in (False, True):
        config = EngineConfig(model_dir=model_dir, runtime="torchscript", device=scope.device, kv_cache_tokens=64 * 512,
                              max_num_seqs=64, cuda_graphs=graphs)
        runner = TimedRunner(build_runner("torchscript", model_dir, spec, 64 * 512 // 16, 16, scope.device, 0,
                                          cuda_graphs=graphs), True)
        core = EngineCore(config, runner)
        for batch in (1, 16, 64):
            runner.reset()
            steps = core.stats.steps
            outputs[graphs, batch] = [s.output_ids for s in _generate(core, _prompts(batch), 32)]
            timings.setdefault(batch, []).append(f"{runner.device_seconds() / (core.stats.steps - steps) * 1e3:.3f}")
        captured = len(runner.runner.graphs.captured) if graphs else 0
        del core, runner
        _free_device(scope.device)
    for batch, (plain, graphed) in timings.items():
        lines.append(f"| {batch} | {plain} | {graphed} | {captured} (all batches) |")
    same = sum(a == b for batch in (1, 16, 64) for a, b in zip(outputs[False, batch], outputs[True, batch]))
    lines.append(f"greedy 32 tokens with graphs identical to without: {same}/81 completions (float16: a different "
                 "span per row may flip a near-tie)")
    if same < 73:  # 90%: a flipped near-tie changes one completion; a wrong row or bucket changes many
        raise CheckFailed(f"with CUDA graphs only {same}/81 greedy completions equal those without")
    return lines


STRUCTURED_KINDS = ("free", "constrained", "constrained, no skipping")


def structured_output(ctx: dict) -> list[str]:
    """JSON-schema requests on the device against free requests of as many tokens, and with
    forced-token skipping against without, in runs taking turns: what constraining costs where
    the step does not share the host's cores, and whether skipping a forced run's steps pays
    there. Every completion that ends must parse and hold its schema's keys. Greedy tokens with
    and without skipping are identical in float32 (the tests); in 16 bits a forced token's keys,
    computed in a row of several tokens instead of one, may round apart and flip a near-tie (on
    the CPU one row of 16, where the two best tokens were 0.22-0.40 apart in log-probability), so
    one row in ten (at least one) may differ; a wrong cache for forced tokens changes most rows."""
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.runner import RuntimeSpec, build_runner

    if importlib.util.find_spec("llguidance") is None:
        return ["not measured: llguidance (constrained decoding) is not installed here; tier 1 does not need it. "
                "`python3 -m pip install llguidance==1.9.1` (one wheel, no dependencies) and rerun"]
    scope = ctx["scope"]
    model_dir = ctx["exports"].get((SHIPPED, "float16"))
    if model_dir is None:
        raise CheckFailed(f"the float16 export of the {SHIPPED} did not succeed (see its stage)")
    spec = RuntimeSpec.load(model_dir / "runtime.json")
    batches = (4,) if scope.quick else (16, 64)
    cores = {}
    for skip in (True, False):
        config = EngineConfig(model_dir=model_dir, runtime="torchscript", device=scope.device,
                              kv_cache_tokens=max(batches) * 512, max_num_seqs=max(batches), skip_forced_tokens=skip)
        runner = TimedRunner(build_runner("torchscript", model_dir, spec, max(batches) * 512 // 16, 16, scope.device,
                                          0), scope.device.startswith("cuda"))
        cores[skip] = (EngineCore(config, runner), runner)
    lines = ["| batch | traffic | output tok/s | requests/s | steps | device ms/step | runner ms/step | host ms/step |",
             "|---|---|---|---|---|---|---|---|"]
    for batch in batches:
        lines += _structured_rows(cores, batch)
    del cores
    _free_device(scope.device)
    return lines


@dataclass
class Tally:
    """What runs of one kind of traffic added up to."""

    tokens: int = 0
    requests: int = 0
    wall: float = 0.0
    steps: int = 0
    device: float | None = None  # CUDA events; None on the CPU
    runner: float = 0.0

    def add(self, seqs: list, wall: float, steps: int, runner: TimedRunner) -> None:
        device = runner.device_seconds()
        self.tokens += sum(len(s.output_ids) for s in seqs)
        self.requests += len(seqs)
        self.wall, self.steps, self.runner = self.wall + wall, self.steps + steps, self.runner + runner.wall
        self.device = None if device is None else (self.device or 0.0) + device

    def row(self, batch: int, kind: str) -> str:
        device = f"{self.device / self.steps * 1e3:.2f}" if self.device is not None else "n/a (CPU)"
        per_step = lambda seconds: f"{seconds / self.steps * 1e3:.2f}"  # noqa: E731
        return (f"| {batch} | {kind} | {self.tokens / self.wall:,.0f} | {self.requests / self.wall:,.1f} "
                f"| {self.steps} | {device} | {per_step(self.runner)} | {per_step(self.wall - self.runner)} |")


def _structured_rows(cores: dict, batch: int) -> list[str]:
    """Two rounds of the three kinds of traffic, `batch` requests at once, each round in a new order.
    Free requests make as many tokens as the first constrained run's requests did on average."""
    import json

    from batchstring.engine.sampling_params import parse_sampling_parameters
    from batchstring.loadtest.workload import extraction_schema

    rate = lambda **values: parse_sampling_parameters(json.dumps(values), 512, 16)  # noqa: E731
    schemas = [extraction_schema(i % 4) for i in range(batch)]
    constrained = [rate(max_tokens=48, temperature=0, json_schema=schema) for schema in schemas]
    prompts = [f"# record {i}\ndef describe_{i}(item):\n    return " for i in range(batch)]
    tallies = {kind: Tally() for kind in STRUCTURED_KINDS}
    outputs, free = {}, None
    for r in (1, 2):  # a constrained run first: it sets the free requests' length
        for kind in STRUCTURED_KINDS[r:] + STRUCTURED_KINDS[:r]:
            core, runner = cores[kind != "constrained, no skipping"]
            if kind == "free":
                seqs, wall, steps = _timed_generate(core, runner, prompts, [free] * batch)
            else:
                seqs, wall, steps = _timed_generate(core, runner, prompts, constrained)
                _check_records(core, seqs, schemas)
                outputs[kind] = [s.output_ids for s in seqs]
                tokens = sum(len(s.output_ids) for s in seqs)
                free = free or rate(max_tokens=max(1, round(tokens / batch)), temperature=0, ignore_eos=True)
            tallies[kind].add(seqs, wall, steps, runner)
    same = sum(a == b for a, b in zip(outputs["constrained"], outputs["constrained, no skipping"]))
    if batch - same > max(1, batch // 10):
        raise CheckFailed(f"greedy JSON completions with forced-token skipping equal those without for only "
                          f"{same}/{batch} rows")
    plain, guided = tallies["free"], tallies["constrained"]
    ratio = (f"| {batch} | constrained / free | {guided.tokens / guided.wall / (plain.tokens / plain.wall):.2f}x "
             f"| {guided.requests / guided.wall / (plain.requests / plain.wall):.2f}x "
             f"| tokens with skipping equal without: {same}/{batch} | | | |")
    return [*(tallies[kind].row(batch, kind) for kind in STRUCTURED_KINDS), ratio]


def _timed_generate(core, runner, prompts: list[str], params: list) -> tuple[list, float, int]:
    runner.reset()
    steps = core.stats.steps
    seqs = [core.make_sequence(p, q, lambda out: None) for p, q in zip(prompts, params)]
    began = time.perf_counter()
    core.generate(seqs)
    return seqs, time.perf_counter() - began, core.stats.steps - steps


def _check_records(core, seqs: list, schemas: list[dict]) -> None:
    """A completion that ended before max_tokens is a whole JSON object with its schema's required keys."""
    import json

    for seq, schema in zip(seqs, schemas):
        if len(seq.output_ids) >= seq.params.max_tokens:
            continue
        text = core.codec.decode(seq.output_ids)
        try:
            record = json.loads(text)
        except ValueError:
            raise CheckFailed(f"a constrained completion is not JSON: {text[:200]!r}") from None
        missing = set(schema["required"]) - set(record)
        if missing:
            raise CheckFailed(f"a constrained completion lacks the keys {sorted(missing)}: {text[:200]!r}")


class HFReference:
    """HF `generate` on the same prompts and device, left-padded, greedy, full length: what a user
    would write without a serving system (default attention implementation)."""

    def __init__(self, source: Path, dtype: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch, self.device = torch, device
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).to(device).eval()
        eos = self.model.config.eos_token_id
        self.pad = eos if isinstance(eos, int) else (eos or [0])[0]

    def generate(self, prompts: list[list[int]], max_tokens: int) -> float:
        torch = self.torch
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        self._sync()
        began = time.perf_counter()
        with torch.no_grad():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, pad_token_id=self.pad)
        self._sync()
        return time.perf_counter() - began

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()


# ----- tier 2: ONNX Runtime on CUDA and serving (a GPU host with an index, after `make install`) --


def onnxruntime_cuda(ctx: dict) -> list[str]:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise CheckFailed(f"onnxruntime {ort.__version__} has no CUDA provider: `pip uninstall -y onnxruntime` "
                          "then `pip install -e '.[dev,gpu]'` (both packages install the same module)")
    return [f"onnxruntime {ort.__version__}: {', '.join(ort.get_available_providers())}"]


def onnx_export(ctx: dict) -> list[str]:
    from batchstring.export.exporter import export_model

    repository = Path(ctx["scratch"]) / "repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("1"))
    version = repository / "llm" / "1"
    version.mkdir(parents=True)
    for name in ("model.py", "responder.py", "metrics.py"):
        shutil.copy(MODEL_VERSION_DIR / name, version / name)
    result = export_model(DEFAULT_MODEL_DIR, version, dtype="float16")
    ctx["repository"] = repository
    return [f"float16 export (ONNX and TorchScript) in {result.seconds:.0f} s, verified on the CPU"]


def onnx_on_device(ctx: dict) -> list[str]:
    """ONNX Runtime (CUDA) against TorchScript on the same device: the same greedy tokens."""
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore

    outputs = {}
    for runtime in ("onnxruntime", "torchscript"):
        core = EngineCore(EngineConfig(model_dir=ctx["repository"] / "llm" / "1", runtime=runtime,
                                       device=ctx["scope"].device, kv_cache_tokens=0))
        outputs[runtime] = [s.output_ids for s in _generate(core, _prompts(16), 32)]
    same = sum(a == b for a, b in zip(*outputs.values()))
    if same == 0:
        raise CheckFailed("ONNX Runtime (CUDA) and TorchScript agree on no greedy completion")
    return [f"greedy 32 tokens, ONNX Runtime (CUDA) vs TorchScript on {ctx['scope'].device}: {same}/16 identical"]


def quantized_on_device(ctx: dict) -> list[str]:
    """int8 and int4 exports of tier 2's ONNX step (weight-only MatMulNBits, export/quantize.py),
    each run on the device beside the unquantized step: greedy tokens against its, and the time
    per step, the three taking turns for `QUANTIZED_ROUNDS` rounds."""
    from batchstring.export.layout import HELDOUT_TEXT
    from batchstring.export.quantize import Quantization, quantize_export

    scope, source = ctx["scope"], Path(ctx["repository"]) / "llm" / "1"
    dtype = json.loads((source / "runtime.json").read_text())["dtype"]
    exports, lines = {dtype: source}, []
    for scheme in ("int8", "int4"):
        target = Path(ctx["scratch"]) / f"quantized-{scheme}"
        target.mkdir(exist_ok=True)
        for path in source.iterdir():
            if path.is_file() and path.suffix != ".py" and path.name != "model.pt":
                shutil.copyfile(path, target / path.name)
        measured = quantize_export(target, Quantization(scheme), HELDOUT_TEXT.read_text(encoding="utf-8"), 100.0,
                                   force=True)
        exports[scheme] = target
        lines.append(f"{scheme}: {measured.describe()}")
    cores = {name: _timed_core(directory, "onnxruntime", scope) for name, directory in exports.items()}
    prompts = _prompts(max(scope.batches))
    tokens: dict[str, list] = {}
    seconds: dict[str, list[float]] = {name: [] for name in cores}
    for _ in range(QUANTIZED_ROUNDS):
        for name, (core, runner) in cores.items():
            runner.reset()
            steps = core.stats.steps
            tokens[name] = [s.output_ids for s in _generate(core, prompts, scope.max_tokens)]
            seconds[name].append(runner.wall / (core.stats.steps - steps))
    lines += [f"| step | greedy same as {dtype} | runner ms/step (median of {QUANTIZED_ROUNDS}) | vs {dtype} |",
              "|---|---|---|---|"]
    base = sorted(seconds[dtype])[QUANTIZED_ROUNDS // 2]
    for name in cores:
        same = sum(a == b for a, b in zip(tokens[name], tokens[dtype]))
        median = sorted(seconds[name])[QUANTIZED_ROUNDS // 2]
        lines.append(f"| {name} | {same}/{len(prompts)} | {median * 1e3:.2f} | {median / base:.2f}x |")
        if same == 0:
            raise CheckFailed(f"{name} agrees with the {dtype} step on no greedy completion on {scope.device}")
    del cores
    _free_device(scope.device)
    return lines


def _timed_core(model_dir: Path, runtime: str, scope: Scope) -> tuple:
    """An engine on the device whose runner times each step, its cache a fixed size."""
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.memory import plan_cache
    from batchstring.engine.runner import RuntimeSpec, build_runner

    config = EngineConfig(model_dir=model_dir, runtime=runtime, device=scope.device,
                          kv_cache_tokens=4096 if scope.quick else 65536, max_num_seqs=max(scope.batches))
    spec = RuntimeSpec.load(model_dir / "runtime.json")
    plan = plan_cache(config, spec, model_dir)
    runner = TimedRunner(build_runner(runtime, model_dir, spec, -(-plan.tokens // config.block_size),
                                      config.block_size, scope.device, 0, plan.arena_bytes),
                         scope.device.startswith("cuda"))
    return EngineCore(dataclasses.replace(config, kv_cache_tokens=plan.tokens), runner), runner


def serving(ctx: dict) -> list[str]:
    import asyncio

    from batchstring.client import AsyncBatchClient, BatchClient
    from batchstring.server.local import LocalServer

    prompts = _prompts(64)
    with LocalServer(config="gpu", repository=ctx["repository"]) as server:
        with BatchClient(server.grpc_url) as client:
            got = client.batchstring(prompts, max_tokens=24, ignore_eos=True)

        async def load() -> float:
            async with AsyncBatchClient(server.grpc_url) as aio:
                began = time.perf_counter()
                await asyncio.gather(*(aio.batchstring([p], max_tokens=128, ignore_eos=True) for p in prompts * 4))
                return 256 * 128 / (time.perf_counter() - began)

        rate = asyncio.run(load())
    if len(got) != len(prompts) or not all(got):
        raise CheckFailed("the server did not answer every string")
    return [f"served (gpu config, kv_cache_tokens auto): 64/64 strings answered; 64 callers x 4 strings, 128 tokens "
            f"each: {rate:,.0f} output tokens/s"]


def stages(scope: Scope, full: bool) -> list[Stage]:
    found = [Stage("environment", 30, environment),
             Stage(f"build the {SYNTHETIC} checkpoint", scope.limit(120), synthetic_checkpoint)]
    for model in (SHIPPED, SYNTHETIC):
        for dtype in DTYPES:
            found.append(Stage(f"{model}, {dtype}: TorchScript traced on the CPU, checked on {scope.device}",
                               scope.limit(90 if model == SYNTHETIC else 45), step_on_device(model, dtype)))
    found += [Stage(f"engine on {scope.device}: {SHIPPED}, float16", scope.limit(60),
                    engine_on_device(SHIPPED, "float16")),
              Stage(f"engine on {scope.device}: {SYNTHETIC}, bfloat16", scope.limit(120),
                    engine_on_device(SYNTHETIC, "bfloat16")),
              Stage(f"CUDA graphs on {scope.device}: {SHIPPED}, float16", scope.limit(60), cuda_graphs),
              Stage(f"structured output on {scope.device}: {SHIPPED}, float16", scope.limit(90), structured_output)]
    if full:
        found += [Stage("tier 2: onnxruntime CUDA provider", 30, onnxruntime_cuda),
                  Stage("tier 2: export float16 (ONNX and TorchScript)", 300, onnx_export),
                  Stage(f"tier 2: ONNX Runtime on {scope.device}", 120, onnx_on_device),
                  Stage(f"tier 2: int8 and int4 weights on {scope.device}", 240, quantized_on_device),
                  Stage("tier 2: tritonserver, gpu config", 300, serving)]
    return found


# ----- running ----------------------------------------------------------------------------------


def _alarm(signum, frame) -> None:
    raise StageTimeout("the stage ran past its time limit")


def run_stage(stage: Stage, ctx: dict, deadline: float) -> None:
    """Runs one stage under min(its limit, what the whole check has left); never raises."""
    limit = min(stage.limit, deadline - time.monotonic())
    began = time.monotonic()
    if deadline - began < 5:
        stage.status, stage.lines = "FAIL", ["not run: the check's time budget is spent"]
        return
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        stage.lines = stage.run(ctx)
        stage.status = "pass"
    except StageTimeout:
        stage.status, stage.lines = "FAIL", [f"timed out after {limit:.0f} s (its limit)"]
    except Exception as exc:  # recorded in the report; later stages that need it fail with their reason
        stage.status = "FAIL"
        stage.lines = [f"{type(exc).__name__}: {exc}"]
        if not isinstance(exc, CheckFailed):
            stage.lines += traceback.format_exc().splitlines()[-6:]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        stage.seconds = time.monotonic() - began


def _markdown(lines: list[str]) -> list[str]:
    """A stage's lines as markdown: table rows kept together, every other line a list item."""
    out: list[str] = []
    for line in lines:
        table = line.startswith("|")
        if out and table != out[-1].startswith("|"):
            out.append("")
        out.append(line if table else f"- {line}")
    return out


def write_report(out: Path, scope: Scope, full: bool, done: list[Stage]) -> None:
    """The whole report so far: rewritten after every stage, so a stop at any point leaves it."""
    title = "tier 1 + tier 2 (--full)" if full else "tier 1"
    parts = [f"## Device check (`batchstring gpu-check`), {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{scope.device}{' --quick' if scope.quick else ''}, {title}", ""]
    for stage in done:
        parts += [f"### {stage.name}: {stage.status} ({stage.seconds:.0f} s, limit {stage.limit} s)", "",
                  *_markdown(stage.lines), ""]
    (out / "report.md").write_text("\n".join(parts))
    (out / "report.json").write_text(json.dumps(
        {"device": scope.device, "quick": scope.quick, "full": full,
         "stages": [{"name": s.name, "status": s.status, "seconds": round(s.seconds, 1), "limit": s.limit,
                     "lines": s.lines} for s in done]}, indent=2))


def run(args: argparse.Namespace) -> int:
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else None)
    if device is None:
        print("batchstring gpu-check: torch sees no GPU here. Run it on a machine with an NVIDIA GPU and a CUDA "
              "build of torch, or `batchstring gpu-check --device cpu --quick` to run the check on the CPU.",
              file=sys.stderr)
        return 2
    scope = Scope(device, args.quick)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # where CUDA events record and HF runs by default
    # TorchScript as the engine runs it (engine/runner.py): interpreted, not re-optimised per shape
    torch._C._get_graph_executor_optimize(False)
    out = args.out or REPO_ROOT / "results" / "gpu-check"
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (FULL_BUDGET_SECONDS if args.full else BUDGET_SECONDS)
    done: list[Stage] = []
    with tempfile.TemporaryDirectory(prefix="batchstring-gpu-check-") as scratch:
        ctx = {"scope": scope, "scratch": scratch, "models": {SHIPPED: DEFAULT_MODEL_DIR}, "exports": {}}
        plan = stages(scope, args.full)
        for i, stage in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] {stage.name} (limit {stage.limit} s)...", flush=True)
            run_stage(stage, ctx, deadline)
            done.append(stage)
            write_report(out, scope, args.full, done)
            print(f"    {stage.status} in {stage.seconds:.0f} s", *(f"    {line}" for line in stage.lines),
                  sep="\n", flush=True)
    print(f"\nreport: {out / 'report.md'}")
    return 0 if all(s.status == "pass" for s in done) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cuda:N or cpu (default: cuda:0 where torch sees a GPU)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few tokens (the CPU run in make test)")
    p.add_argument("--full", action="store_true",
                   help="tier 2 too: ONNX Runtime's CUDA provider and tritonserver (needs `make install` and the "
                        "gpu extra)")
    p.add_argument("--out", type=Path, help="report folder (default: results/gpu-check)")
