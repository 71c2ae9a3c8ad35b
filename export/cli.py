"""`batchstring export` and `batchstring train`: arguments here, the heavy work imported on use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchstring.export.quantize import BLOCK_SIZE, BLOCK_SIZES


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a Hugging Face checkpoint: a local directory, or a Hub id (owner/name) "
                                   "downloaded into the Hugging Face cache, HF_TOKEN from the environment for a "
                                   "gated one (default: the shipped model)")
    p.add_argument("--revision", help="with a Hub id: its branch, tag or commit (default: main)")
    p.add_argument("--out", type=Path, help="output directory (default: model_repository/llm/1)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="weights and KV cache (default: float16 where a GPU is visible, else float32)")
    p.add_argument("--adapters", action="store_true",
                   help="a step that applies LoRA adapters chosen per request (`batchstring serve --lora`); a step "
                        "with no adapter row pays one branch per projection")
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantization of the ONNX step (MatMulNBits, blocks of --block-size along K, "
                        "symmetric); activations stay in --dtype; measured against the unquantized graph")
    add_quantization_arguments(p, "with --quantize: ")


def add_quantization_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=BLOCK_SIZE,
                   help=f"{prefix}weights per scale along K: {BLOCK_SIZE} (default; llama.cpp's Q8_0 and Q4_0 "
                        "blocks) keeps the most quality; 128 makes ONNX Runtime's CPU kernel faster for a "
                        "measured quality cost (docs/quantization.md)")
    p.add_argument("--accuracy-level", type=int, choices=(0, 4), default=4,
                   help=f"{prefix}4 (default): ONNX Runtime's CPU kernel multiplies int8 activations (its cost "
                        "is measured); 0: activations in the export's dtype, many times slower on the CPU")
    p.add_argument("--quantize-head", action="store_true", help=f"{prefix}the LM head too")
    p.add_argument("--quantize-embedding", action="store_true",
                   help=f"{prefix}the embedding too, as GatherBlockQuantized at 4 bits")
    p.add_argument("--heldout", type=Path, metavar="FILE",
                   help=f"{prefix}UTF-8 text the quantization's perplexity is measured on, at least 256 tokens "
                        "(default: Python source shipped with batchstring, export/heldout/python.txt)")
    p.add_argument("--max-perplexity-rise", type=float, metavar="PERCENT",
                   help=f"{prefix}the largest perplexity rise on the held-out text an export accepts "
                        "(default: 1 for int8, 3 for int4)")
    p.add_argument("--force", action="store_true",
                   help=f"{prefix}keep a quantization whose perplexity rises past its bound")


def quantization_of(args: argparse.Namespace, scheme: str):
    from batchstring.export.quantize import Quantization

    return Quantization(scheme, block_size=args.block_size, accuracy_level=args.accuracy_level,
                        head=args.quantize_head, embedding=args.quantize_embedding)


def run_export(args: argparse.Namespace) -> int:
    from batchstring.export.exporter import export_model
    from batchstring.export.layout import MODEL_VERSION_DIR
    from batchstring.export.quantize import QuantizationRefused
    from batchstring.export.step import UnsupportedModel
    from batchstring.export.verify import VerificationError

    if not args.quantize and (args.accuracy_level != 4 or args.quantize_head or args.quantize_embedding or args.force
                              or args.max_perplexity_rise is not None or args.heldout
                              or args.block_size != BLOCK_SIZE):
        raise SystemExit("--block-size, --accuracy-level, --quantize-head, --quantize-embedding, "
                         "--max-perplexity-rise, --heldout and --force go with --quantize")
    quantization = args.quantize and quantization_of(args, args.quantize)
    try:
        export_model(args.model, args.out or MODEL_VERSION_DIR, dtype=args.dtype, quantization=quantization or None,
                     force=args.force, max_rise=args.max_perplexity_rise, heldout=args.heldout, adapters=args.adapters,
                     revision=args.revision)
    except (UnsupportedModel, VerificationError, QuantizationRefused, ValueError, OSError) as exc:
        print(f"batchstring export: {exc}", file=sys.stderr)
        return 1
    return 0


def add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scheme", choices=("int8", "int4"),
                   help="weight-only: MatMulNBits, blocks of --block-size, symmetric")
    p.add_argument("--model", type=Path, required=True, help="an unquantized export directory")
    p.add_argument("--out", type=Path, required=True, help="where the quantized export goes (not --model)")
    add_quantization_arguments(p)


def run_quantize(args: argparse.Namespace) -> int:
    import shutil
    import tempfile

    from batchstring.export.exporter import install
    from batchstring.export.layout import HELDOUT_TEXT
    from batchstring.export.quantize import MAX_PERPLEXITY_RISE, QuantizationRefused, quantize_export

    source, out = args.model.resolve(), args.out.resolve()
    if out == source:
        raise SystemExit("--out must not be --model: the quantization is measured against the export it is made from")
    quantization = quantization_of(args, args.scheme)
    bound = MAX_PERPLEXITY_RISE[args.scheme] if args.max_perplexity_rise is None else args.max_perplexity_rise
    try:
        check_unquantized_export(source)
        text = (args.heldout or HELDOUT_TEXT).read_text(encoding="utf-8")
        with tempfile.TemporaryDirectory(prefix="batchstring-quantize-") as tmp:
            scratch = Path(tmp)
            for produced in source.iterdir():
                if produced.is_file() and produced.name != "model.pt":
                    shutil.copyfile(produced, scratch / produced.name)
            measured = quantize_export(scratch, quantization, text, bound, args.force)
            install(scratch, out)
    except (QuantizationRefused, ValueError, OSError) as exc:
        print(f"batchstring quantize: {exc}", file=sys.stderr)
        return 1
    print(f"{quantization.describe()}: {measured.describe()}\nquantized {source} -> {out}")
    return 0


def check_unquantized_export(directory: Path) -> None:
    """Refuses, saying why, a directory that is not an unquantized ONNX export."""
    import json

    if not (directory / "runtime.json").is_file() or not (directory / "model.onnx").is_file():
        raise ValueError(f"{directory} is not an ONNX export (no runtime.json and model.onnx); make one with "
                         "`batchstring export --model CHECKPOINT --out DIR`")
    done = json.loads((directory / "runtime.json").read_text()).get("quantization")
    if done:
        raise ValueError(f"{directory} is already quantized ({done['scheme']}); quantize the unquantized export "
                         "it was made from")


def add_perplexity_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="export directory (default: model_repository/llm/1)")
    p.add_argument("--text", type=Path, help="UTF-8 text to score (default: the held-out Python source the export "
                                              "measures quantizations on)")
    p.add_argument("--context", type=int, default=256, help="tokens per window; the second half of each is scored")
    p.add_argument("--tokens", type=int, help="score at most the first N tokens of the text (default: all)")
    p.add_argument("--runtime", choices=("onnxruntime", "torchscript"), default="onnxruntime")


def run_perplexity(args: argparse.Namespace) -> int:
    from batchstring.export.layout import HELDOUT_TEXT, MODEL_VERSION_DIR
    from batchstring.export.perplexity import measure_export

    model = args.model or MODEL_VERSION_DIR
    text = args.text or HELDOUT_TEXT
    if args.context < 4:
        raise SystemExit(f"--context must be at least 4; got {args.context}")
    try:
        if not (model / "runtime.json").is_file():
            raise ValueError(f"{model} is not an export (no runtime.json); pass --model an export's directory, made "
                             "with `batchstring export --model CHECKPOINT --out DIR`")
        result = measure_export(model, _utf8(text), args.runtime, args.context, args.tokens)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"batchstring perplexity: {exc}", file=sys.stderr)
        return 1
    print(f"perplexity {result.value:.4f} over {result.tokens} tokens ({result.windows} windows of {args.context}, "
          f"second halves scored) of {text.name}, {model} on {args.runtime}")
    return 0


def _utf8(path: Path) -> str:
    """The text, or a ValueError that says where it is not UTF-8 (a text in another encoding is
    the likely mistake, and the position finds it)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); --text "
                         "takes a UTF-8 text file") from None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="checkpoint directory (default: export/default_model)")


def run_train(args: argparse.Namespace) -> int:
    from batchstring.export.layout import DEFAULT_MODEL_DIR
    from batchstring.export.train import train

    train(args.out or DEFAULT_MODEL_DIR)
    return 0
