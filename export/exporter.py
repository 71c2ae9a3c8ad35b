"""`batchstring export`: HF checkpoint -> verified ONNX + TorchScript step in the model repository."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from engine.tokenizer import TextCodec
from export import artifacts
from export.layout import DEFAULT_MODEL_DIR, MODEL_VERSION_DIR
from export.step import DecoderStep, check_supported
from export.verify import TOLERANCE, StepFn, VerificationError, verify_greedy, verify_logits


@dataclass
class ExportResult:
    out_dir: Path
    seconds: float
    max_diff: dict[str, float]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def load_checkpoint(path: Path):
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
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def eos_ids(hf_config) -> list[int]:
    eos = hf_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def _eager(step: DecoderStep) -> StepFn:
    def run(**feeds):
        with torch.no_grad():
            return tuple(t.numpy() for t in step(*(torch.from_numpy(feeds[n]) for n in artifacts.INPUT_NAMES)))

    return run


def _onnx(path: Path) -> StepFn:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda **feeds: tuple(session.run(None, feeds))


def _torchscript(path: Path) -> StepFn:
    with artifacts.quiet():
        module = torch.jit.load(str(path))

    def run(**feeds):
        with torch.no_grad():
            return tuple(t.numpy() for t in module(*(torch.from_numpy(feeds[n]) for n in artifacts.INPUT_NAMES)))

    return run


def export_model(
    source: Path | None = None, out_dir: Path = MODEL_VERSION_DIR, console: Console | None = None
) -> ExportResult:
    """Exports, verifies in a scratch directory, and only then replaces the served files."""
    console = console or Console()
    source = Path(source or DEFAULT_MODEL_DIR).resolve()
    started = time.monotonic()
    hf_model = load_checkpoint(source)
    codec = TextCodec.from_file(source / "tokenizer.json")
    eos = eos_ids(hf_model.config)
    step = DecoderStep(hf_model, eos, *codec.known_ids()).eval()
    with tempfile.TemporaryDirectory(prefix="batchstring-export-") as tmp:
        scratch = Path(tmp)
        with console.status("exporting ONNX (torch.export)..."):
            artifacts.write_onnx(step, scratch / "model.onnx")
        with console.status("exporting TorchScript (trace)..."):
            artifacts.write_torchscript(step, scratch / "model.pt")
        for name in TOKENIZER_FILES:  # the chat template and special tokens travel with the model
            if (source / name).is_file():
                shutil.copyfile(source / name, scratch / name)
        spec = artifacts.runtime_spec(step, hf_model.config, eos, source.name)
        artifacts.write_runtime_spec(spec, scratch / "runtime.json")

        runtimes = {"eager step": _eager(step), "onnxruntime": _onnx(scratch / "model.onnx"),
                    "torchscript": _torchscript(scratch / "model.pt")}
        with console.status("verifying against the Hugging Face forward..."):
            cases = verify_logits(hf_model, runtimes, eos)
            greedy = verify_greedy(hf_model, codec.encode, eos, runtimes)
        max_diff = report(console, cases, greedy)
        out_dir.mkdir(parents=True, exist_ok=True)
        for produced in scratch.iterdir():  # includes ONNX external data, when there is any
            shutil.move(produced, out_dir / produced.name)
    seconds = time.monotonic() - started
    console.print(f"[green]exported and verified[/] {source.name} -> {out_dir} in {seconds:.1f} s")
    return ExportResult(out_dir, seconds, max_diff)


def report(console: Console, cases, greedy: dict[str, dict[str, bool]], dtype: str = "float32") -> dict[str, float]:
    """Prints the verification tables; raises VerificationError past the tolerance."""
    tolerance = TOLERANCE[dtype]
    names = list(cases[0].max_diff)
    table = Table(title=f"max |Δ| vs Hugging Face eager forward (logits and new K/V; {dtype} limit {tolerance:g}); "
                        "sampled ids = reference sampler (equal/rows, near-ties)")
    for col in ("rows", "past", *names, *(f"{n} ids" for n in names)):
        table.add_column(col, justify="right")
    for c in cases:
        cells = [f"[{'red' if d > tolerance else 'green'}]{d:.2e}[/]" for d in c.max_diff.values()]
        ids = [f"{eq}/{n}" + (f" ({ties})" if ties else "") for n, eq, ties in c.sampled.values()]
        table.add_row(str(c.batch), str(c.past), *cells, *ids)
    console.print(table)
    g = Table(title="greedy 32 tokens: identical to HF generate?")
    g.add_column("prompt")
    for name in names:
        g.add_column(name, justify="center")
    for prompt, ok in greedy.items():
        g.add_row(repr(prompt), *("[green]yes[/]" if v else "[red]NO[/]" for v in ok.values()))
    console.print(g)
    max_diff = {n: max(c.max_diff[n] for c in cases) for n in names}
    bad = [f"{n}: max |Δ| {d:.2e}" for n, d in max_diff.items() if not d <= tolerance]  # NaN fails too
    bad += [f"greedy mismatch for {p!r} in {', '.join(n for n, v in ok.items() if not v)}"
            for p, ok in greedy.items() if not all(ok.values())]
    for name in names:
        checked, equal, ties = (sum(c.sampled[name][i] for c in cases) for i in range(3))
        if equal + ties < checked:
            bad.append(f"{name}: {checked - equal - ties} of {checked} sampled ids differ from the reference sampler")
    if bad:
        raise VerificationError(
            "exported step does not match the Hugging Face model (" + "; ".join(bad) + "); "
            "nothing was written to the model repository"
        )
    return max_diff
