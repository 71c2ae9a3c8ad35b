"""`batchstring export`: HF checkpoint -> verified ONNX + TorchScript step in the model repository.

rich (the tables) is imported where it is used: the GPU check imports this module on machines
that have only torch, transformers, tokenizers, safetensors and numpy.
"""

from __future__ import annotations

import contextlib
import gc
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchstring.engine.tokenizer import TextCodec
from batchstring.export import artifacts
from batchstring.export.contract import ADAPTER_SITES, CACHES, AdapterWeights, Held, StepInputs
from batchstring.export.family import features
from batchstring.export.layout import HELDOUT_TEXT, MODEL_VERSION_DIR, SMALL_STEP_GRAPH
from batchstring.export.prequantized import PreQuantized, load_dequantized
from batchstring.export.prequantized import read as read_prequantized
from batchstring.export.quantize import MAX_PERPLEXITY_RISE, Quantization, quantize_export
from batchstring.export.shared_weights import share_weights, weight_bytes
from batchstring.export.source import resolve
from batchstring.export.step import DecoderStep, check_supported
from batchstring.export.verify import (
    HF_16BIT,
    TOLERANCE,
    CaseResult,
    SingleGroup,
    StepFn,
    VerificationError,
    greedy_references,
    limit,
    tolerance_failures,
    verify_greedy,
    verify_logits,
)

if TYPE_CHECKING:
    from rich.console import Console


@dataclass
class ExportResult:
    out_dir: Path
    seconds: float
    max_diff: dict[str, float]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


Loader = Callable[[], "StepFn | None"]  # a runtime loaded when its turn comes; None: it cannot run here
DTYPES = ("float32", "float16", "bfloat16")


def default_dtype() -> str:
    """16-bit where the export runs beside a GPU (as every peer serves), float32 on a CPU."""
    return "float16" if torch.cuda.is_available() else "float32"


def load_checkpoint(path: Path, dtype: str = "float32"):
    """Config first, so an unsupported architecture is refused before any weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise SystemExit(f"{path} is not a Hugging Face checkpoint (no config.json)")
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(
            f"{path} has no tokenizer.json; batchstring needs a fast tokenizer: "
            "AutoTokenizer.from_pretrained(...).save_pretrained(path) writes one"
        )
    check_supported(AutoConfig.from_pretrained(path))
    model, loading = AutoModelForCausalLM.from_pretrained(  # weights streamed, not copied
        path, dtype=getattr(torch, dtype), attn_implementation="eager", low_cpu_mem_usage=True,
        output_loading_info=True)
    missing = sorted(loading["missing_keys"])
    if missing:  # transformers fills them with random values, and verification would agree with those
        raise SystemExit(f"{path} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''}); a complete checkpoint is needed")
    return model.eval()


def eos_ids(hf_model) -> list[int]:
    """Every end-of-sequence id the checkpoint names: its config's and its generation_config's
    (Llama 3 lists three there; its config names one)."""
    found: list[int] = []
    for eos in (hf_model.config.eos_token_id, getattr(hf_model.generation_config, "eos_token_id", None)):
        for i in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if i not in found:
                found.append(int(i))
    return found


def sampling_defaults(hf_model) -> dict:
    """The checkpoint's own sampling defaults (generation_config), for requests that leave them out."""
    gen = getattr(hf_model, "generation_config", None)
    if gen is None or not getattr(gen, "do_sample", False):
        return {}
    values = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    return {k: v for k, v in values.items() if v is not None}


def torch_arguments(inputs: StepInputs, held: Held, dtype: torch.dtype | None = None, device: str = "cpu",
                    sites: dict[str, tuple[int, int]] | None = None) -> list[torch.Tensor]:
    """The step's arguments from host arrays, on `device`, the caches and adapters in `dtype` (None:
    as they are); `sites`: the step's adapter sites, for empty adapter weights where `held` has none."""
    caches = (torch.from_numpy(c).to(device, dtype) for c in (held.key_cache, held.value_cache))
    adapters = None if held.adapters is None else AdapterWeights(*(torch.from_numpy(w).to(device, dtype)
                                                                   for w in held.adapters))
    on_device = Held(torch.from_numpy(held.block_table).to(device), *caches, adapters)
    return inputs.positional(on_device.without_adapters(sites or {}, lambda shape: torch.zeros(
                                 shape, dtype=dtype or held.key_cache.dtype, device=device)),
                             lambda array: torch.from_numpy(array).to(device))


def _numpy_out(outputs) -> tuple:
    return tuple((t.float() if t.is_floating_point() else t).cpu().numpy() for t in outputs)


def _eager(step: DecoderStep) -> StepFn:
    def run(inputs: StepInputs, held: Held):
        with torch.no_grad():
            return _numpy_out(step(*torch_arguments(inputs, held, step.dtype, sites=step.adapter_sites())))

    return run


def onnx_step(path: Path, dtype: str) -> StepFn:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    sites = onnx_adapter_sites(session)

    def run(inputs: StepInputs, held: Held):
        adapters = None if held.adapters is None else AdapterWeights(*(w.astype(dtype) for w in held.adapters))
        cast = held._replace(key_cache=held.key_cache.astype(dtype), value_cache=held.value_cache.astype(dtype),
                             adapters=adapters).without_adapters(sites, lambda shape: np.zeros(shape, dtype))
        return tuple(o.astype("float32") if o.dtype.kind == "f" else o for o in session.run(None, inputs.feeds(cast)))

    return run


def onnx_adapter_sites(session) -> dict[str, tuple[int, int]]:
    """An ONNX Runtime session's adapter sites, (in, out) each, from its inputs' fixed dims."""
    shapes = {i.name: i.shape for i in session.get_inputs()}
    return {site: (shapes[f"{site}_lora_a"][2], shapes[f"{site}_lora_b"][3]) for site in ADAPTER_SITES}


def torchscript_step(path: Path, dtype: torch.dtype, sites: dict[str, tuple[int, int]],
                     device: str = "cpu") -> StepFn:
    """The saved TorchScript step on `device`, taking and returning host arrays; `sites`: its
    adapter sites (runtime.json's)."""
    with artifacts.quiet():
        module = torch.jit.load(str(path), map_location=device)

    def run(inputs: StepInputs, held: Held):
        with torch.no_grad():
            return _numpy_out(module(*torch_arguments(inputs, held, dtype, device, sites)))

    return run


def _runtime_loaders(step: DecoderStep, scratch: Path, dtype: str, console: Console) -> dict[str, Loader]:
    """What runs here, in `dtype`, each loaded when its turn comes (see `_verify_each`): the eager
    step and TorchScript always; ONNX Runtime's CPU provider where it has the kernels (float32,
    float16). A bfloat16 ONNX graph is checked structurally here and numerically by `make gpu-check`."""
    loaders: dict[str, Loader] = {"eager step": lambda: _eager(step),
                                  "torchscript": lambda: torchscript_step(scratch / "model.pt", step.dtype,
                                                                           step.adapter_sites())}
    example = artifacts.example_step(step)

    def onnx(path: Path, small: bool) -> StepFn | None:
        try:
            if dtype == "bfloat16":
                raise NotImplementedError("no bfloat16 kernels in onnxruntime's CPU provider")
            run = onnx_step(path, dtype)
            if not small:  # (the small graph takes a small step's packing: engine/batch.py)
                run(*example)  # kernels missing for this dtype show up here, not mid-verification
        except Exception as exc:  # any refusal to load or run: say so, and check the graph instead
            check_onnx_structure(path, dtype)
            console.print(f"[yellow]onnxruntime (CPU) cannot run the {dtype} graph here ({str(exc)[:200]}); its "
                          f"structure was checked (onnx.checker; weights and cache in {dtype}); `make gpu-check` "
                          "runs it on a GPU[/]")
            return None
        return SingleGroup(run) if small else run

    loaders["onnxruntime"] = lambda: onnx(scratch / "model.onnx", False)
    if (scratch / SMALL_STEP_GRAPH).exists():
        loaders["onnxruntime, small steps"] = lambda: onnx(scratch / SMALL_STEP_GRAPH, True)
    return loaders


Greedy = dict[str, dict[str, bool]]  # prompt -> runtime -> identical to HF up to its first near-tie


def _verify_each(loaders: dict[str, Loader], truth, hf_model, encode, eos: list[int], dtype: str,
                 vocabulary: tuple[int, list[int]] | None = None) -> tuple[list[CaseResult], Greedy]:
    """Each runtime against HF, one at a time, each freed before the next loads: a runtime holds
    its own copy of the weights, and a 1.7B-parameter float32 model's four copies would not fit
    beside HF's on a 24 GiB machine. `truth`: the float32 reference; `hf_model`: the checkpoint in
    the export's dtype (the same model in float32). The same seed makes the same cases for each."""
    references = greedy_references(hf_model, encode, eos, vocabulary=vocabulary)
    cases: list[CaseResult] = []
    greedy: dict[str, dict[str, bool]] = {prompt: {} for prompt in references}
    for name, load in loaders.items():
        run = load()
        if run is None:
            continue
        exact = dtype == "float32"
        part = verify_logits(truth, {name: run}, eos, relative=not exact,
                             hf_16bit=None if exact or cases else hf_model)
        for prompt, ok in verify_greedy(hf_model, encode, eos, {name: run}, references=references).items():
            greedy[prompt] |= ok
        cases = part if not cases else [_merged(c, p) for c, p in zip(cases, part)]
        del run
        gc.collect()
    return cases, greedy


def _merged(case: CaseResult, more: CaseResult) -> CaseResult:
    return replace(case, max_diff=case.max_diff | more.max_diff, sampled=case.sampled | more.sampled)


def check_onnx_structure(path: Path, dtype: str) -> None:
    import onnx

    onnx.checker.check_model(str(path))  # by path: works with external data
    model = onnx.load(str(path), load_external_data=False)
    want = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
            "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    caches = [i for i in model.graph.input if i.name in CACHES]
    floating = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE}
    weights = [t for t in model.graph.initializer if len(t.dims) >= 2 and t.data_type in floating]
    wrong = [i.name for i in caches if i.type.tensor_type.elem_type != want]
    wrong += [t.name for t in weights if t.data_type != want]
    if wrong or len(caches) != 2:
        raise VerificationError(f"the ONNX graph is not {dtype} throughout: {', '.join(wrong[:5])}")


class Stages:
    """One progress line per stage (load, trace, save, verify): elapsed time and the process's
    peak memory so far, printed when each ends, so a non-TTY log shows progress too."""

    def __init__(self, console: Console, total: int) -> None:
        self.console, self.total, self.done = console, total, 0
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str):
        began = time.monotonic()
        with self.console.status(f"[{self.done + 1}/{self.total}] {name}..."):
            yield
        self.done += 1
        peak = peak_rss_gib()
        self.peaks[name] = peak
        self.console.print(f"[{self.done}/{self.total}] {name}: {time.monotonic() - began:.1f} s, "
                           f"peak memory {peak:.2f} GiB")


def peak_rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def export_model(
    source: Path | str | None = None, out_dir: Path = MODEL_VERSION_DIR, console: Console | None = None,
    dtype: str | None = None, quantization: Quantization | None = None, force: bool = False,
    max_rise: float | None = None, heldout: Path | None = None, adapters: bool = False,
    revision: str | None = None,
) -> ExportResult:
    """Exports, verifies in a scratch directory, and only then replaces the served files. `source`:
    a checkpoint directory or a Hugging Face Hub id at `revision` (export/source.py). With
    `quantization`, the verified ONNX graphs are then quantized and measured (`_quantize`); `force`
    keeps a quantization whose perplexity on `heldout` (None: HELDOUT_TEXT) rises past `max_rise`
    percent (None: the scheme's MAX_PERPLEXITY_RISE). `adapters`: the step applies LoRA adapters
    (`batchstring serve --lora` needs it; see export/adapters.py)."""
    from rich.console import Console

    console = console or Console()
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if quantization and dtype == "bfloat16":
        raise SystemExit("--quantize measures the quantized graph with ONNX Runtime's CPU provider, which has no "
                         "bfloat16 kernels: export with --dtype float32 or float16")
    checkpoint = resolve(source, revision)
    source, name = checkpoint.path, checkpoint.name
    published = published_quantization(source, dtype, quantization)
    quantization = quantization or published
    started = time.monotonic()
    stages = Stages(console, 5 if quantization else 4)
    with stages.stage(f"load {name} in {dtype}" + (f", {published.scheme} dequantized" if published else "")):
        hf_model = load_dequantized(source, published, dtype) if published else load_checkpoint(source, dtype)
        step, eos = decoder_step(hf_model, source, adapters)
    console.print(f"{hf_model.config.model_type}: {', '.join(features(hf_model)) or 'Llama layers'}")
    with tempfile.TemporaryDirectory(prefix="batchstring-export-") as tmp:
        scratch = Path(tmp)
        with stages.stage("trace and save ONNX (torch.export)"):
            artifacts.write_onnx(step, scratch / "model.onnx")
            if dtype == "float32":  # the CPU's dtype: layout.SMALL_STEP_GRAPH
                artifacts.write_onnx(step.as_single_group(), scratch / SMALL_STEP_GRAPH)
        with stages.stage("trace and save TorchScript"):
            artifacts.write_torchscript(step, scratch / "model.pt")
        write_model_files(step, hf_model, eos, source, scratch, name)
        codec = TextCodec.from_file(source / "tokenizer.json")
        with stages.stage(f"verify each runtime against the Hugging Face forward (float32 truth, {dtype} beside it)"):
            # 16 bits: the truth in float32 beside the 16-bit copy, ~3x the 16-bit weights, for this stage
            truth = hf_model if dtype == "float32" else (
                load_dequantized(source, published) if published else load_checkpoint(source, "float32"))
            cases, greedy = _verify_each(_runtime_loaders(step, scratch, dtype, console), truth, hf_model,
                                         codec.encode, eos, dtype, codec.known_ids())
            del truth
        max_diff = report(console, cases, greedy, dtype)
        if share_weights(scratch):  # lossless: only where the bytes live changes
            console.print(f"the two ONNX graphs share one weights file: {weight_bytes(scratch) / 2**30:.2f} GiB "
                          "on disk")
        if quantization:
            with stages.stage(f"quantize the ONNX graphs to {quantization.scheme} and measure them"):
                bound = MAX_PERPLEXITY_RISE[quantization.rounding] if max_rise is None else max_rise
                text = (heldout or HELDOUT_TEXT).read_text(encoding="utf-8")
                measured = quantize_export(scratch, quantization, text, bound, force)
            console.print(f"{quantization.describe()}: {measured.describe()}; no TorchScript step (it would hold "
                          "the unquantized weights)")
        install(scratch, out_dir)
    seconds = time.monotonic() - started
    scheme = f", {quantization.scheme} weights" if quantization else ""
    console.print(f"[green]exported and verified[/] {name} ({dtype}{scheme}) -> {out_dir} in {seconds:.1f} s, "
                  f"peak memory {max(stages.peaks.values()):.2f} GiB")
    return ExportResult(out_dir, seconds, max_diff)


def published_quantization(source: Path, dtype: str, quantization: Quantization | None) -> PreQuantized | None:
    """The checkpoint's own quantization (GPTQ, AWQ: export/prequantized.py), checked against the
    export's options; SystemExit saying what to change where they conflict."""
    try:
        published = read_prequantized(source) if (source / "config.json").is_file() else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if published and quantization:
        raise SystemExit(f"{source.name} is published quantized ({published.scheme}); its integers are kept as they "
                         "are: drop --quantize")
    if published and dtype == "bfloat16":
        raise SystemExit(f"{source.name} is published quantized ({published.scheme}): export it with --dtype float16 "
                         "or float32 (ONNX Runtime's CPU provider, which measures the repacked graph, has no bfloat16 "
                         "MatMulNBits kernel)")
    return published


def install(scratch: Path, out_dir: Path) -> None:
    """Moves a verified export from `scratch` into `out_dir`, removing what an earlier export left
    there that this one does not have."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for optional in ("model.onnx.data", SMALL_STEP_GRAPH, f"{SMALL_STEP_GRAPH}.data", "model.pt"):
        if not (scratch / optional).exists():
            (out_dir / optional).unlink(missing_ok=True)
    for produced in scratch.iterdir():  # includes ONNX external data, when there is any
        shutil.move(produced, out_dir / produced.name)


def decoder_step(hf_model, source: Path, adapters: bool = False) -> tuple[DecoderStep, list[int]]:
    """The step over a loaded checkpoint, with its tokenizer's vocabulary and every EOS id;
    `adapters`: LoRA adapters applied (export/adapters.py)."""
    codec = TextCodec.from_file(source / "tokenizer.json")
    eos = eos_ids(hf_model)
    return DecoderStep(hf_model, eos, *codec.known_ids(), adapters=adapters).eval(), eos


def write_model_files(step: DecoderStep, hf_model, eos: list[int], source: Path, out: Path,
                      name: str | None = None) -> None:
    """What the engine reads beside the step: runtime.json (its source `name`, the directory's by
    default) and the tokenizer's files (the chat template and special tokens travel with the model)."""
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copyfile(source / file, out / file)
    spec = artifacts.runtime_spec(step, hf_model.config, eos, name or source.name, sampling_defaults(hf_model))
    artifacts.write_runtime_spec(spec, out / "runtime.json")


def report(console: Console, cases, greedy: dict[str, dict[str, bool]], dtype: str = "float32") -> dict[str, float]:
    """Prints the verification tables; raises VerificationError past the tolerance.

    float32: every runtime within an absolute 1e-4 of the HF float32 forward, every greedy token
    and sampled id equal. 16 bits: the truth is still the HF float32 forward, and HF's own forward
    in the export's dtype is measured against it beside the runtimes; a runtime may be off by at
    most twice what HF itself is off in that case (or the dtype's floor), relative to
    max(1, |truth|). Rounding in 16 bits flips near-equal tokens, so greedy and sampled-id
    agreement with HF in the same dtype are measured and reported, not required."""
    from rich.table import Table

    floor = TOLERANCE[dtype]
    exact = dtype == "float32"
    names = [n for n in cases[0].max_diff if n != HF_16BIT]
    measure = "max |Δ|" if exact else "max |Δ|/max(1,|truth|)"
    rule = f"limit {floor:g}" if exact else f"limit: 2 x HF's own {dtype} error, at least {floor:g}"
    table = Table(title=f"{measure} vs the Hugging Face float32 forward (logits and new K/V; {rule}); "
                        "sampled ids = reference sampler (equal/rows, near-ties)")
    columns = list(cases[0].max_diff)
    for col in ("rows", "past", *columns, *(f"{n} ids" for n in names)):
        table.add_column(col, justify="right")
    for c in cases:
        cells = [f"[{'red' if n != HF_16BIT and d > limit(c, dtype) else 'green'}]{d:.2e}[/]"
                 for n, d in c.max_diff.items()]
        ids = [f"{eq}/{n}" + (f" ({ties})" if ties else "") for n, eq, ties in c.sampled.values()]
        table.add_row(str(c.batch), str(c.past), *cells, *ids)
    console.print(table)
    g = Table(title=f"greedy 32 tokens: identical to HF generate in {dtype} (up to its first near-tie)?")
    g.add_column("prompt")
    for name in names:
        g.add_column(name, justify="center")
    for prompt, ok in greedy.items():
        g.add_row(repr(prompt), *("[green]yes[/]" if v else "[red]NO[/]" for v in ok.values()))
    console.print(g)
    max_diff = {n: max(c.max_diff[n] for c in cases) for n in columns}
    bad = tolerance_failures(cases, dtype)
    for name in names:
        same = sum(ok[name] for ok in greedy.values())
        checked, equal, ties = (sum(c.sampled[name][i] for c in cases) for i in range(3))
        console.print(f"{name}: greedy identical for {same}/{len(greedy)} prompts; sampled ids equal for "
                      f"{equal}/{checked} rows ({ties} near-ties)")
        if exact and same < len(greedy):
            bad.append(f"{name}: greedy mismatch for {len(greedy) - same} of {len(greedy)} prompts")
        if exact and equal + ties < checked:
            bad.append(f"{name}: {checked - equal - ties} of {checked} sampled ids differ from the reference sampler")
    if bad:
        raise VerificationError(
            "exported step does not match the Hugging Face model (" + "; ".join(bad[:6]) + "); "
            "nothing was written to the model repository"
        )
    return max_diff
