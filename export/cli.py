"""`batchstring export` and `batchstring train`: arguments here, the heavy work imported on use."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, help="local HF checkpoint directory (default: the shipped model)")
    p.add_argument("--out", type=Path, help="output directory (default: model_repository/llm/1)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="weights and KV cache (default: float16 where a GPU is visible, else float32)")
    p.add_argument("--quantize", choices=("int8", "int4"),
                   help="weight-only quantization of the ONNX step (MatMulNBits, blocks of 32 along K, symmetric); "
                        "activations stay in --dtype; measured against the unquantized graph")
    p.add_argument("--accuracy-level", type=int, choices=(0, 4), default=0,
                   help="with --quantize: 4 lets ONNX Runtime's CPU kernel take int8 activations (faster at one "
                        "row; the export measures what it costs); 0: the kernel's default")
    p.add_argument("--quantize-head", action="store_true", help="with --quantize: the LM head too")
    p.add_argument("--max-perplexity-rise", type=float, metavar="PERCENT",
                   help="with --quantize: the largest perplexity rise on the held-out text an export accepts "
                        "(default: 1 for int8, 3 for int4)")
    p.add_argument("--force", action="store_true",
                   help="with --quantize: keep a quantization whose perplexity rises past its bound")


def run_export(args: argparse.Namespace) -> int:
    from batchstring.export.exporter import export_model
    from batchstring.export.layout import MODEL_VERSION_DIR
    from batchstring.export.quantize import Quantization
    from batchstring.export.step import UnsupportedModel
    from batchstring.export.verify import VerificationError

    if not args.quantize and (args.accuracy_level or args.quantize_head or args.force
                              or args.max_perplexity_rise is not None):
        raise SystemExit("--accuracy-level, --quantize-head, --max-perplexity-rise and --force go with --quantize")
    quantization = args.quantize and Quantization(args.quantize, accuracy_level=args.accuracy_level,
                                                  head=args.quantize_head)
    try:
        export_model(args.model, args.out or MODEL_VERSION_DIR, dtype=args.dtype, quantization=quantization or None,
                     force=args.force, max_rise=args.max_perplexity_rise)
    except (UnsupportedModel, VerificationError) as exc:
        print(f"batchstring export: {exc}", file=sys.stderr)
        return 1
    return 0


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
        result = measure_export(model, text.read_text(encoding="utf-8"), args.runtime, args.context, args.tokens)
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"batchstring perplexity: {exc}", file=sys.stderr)
        return 1
    print(f"perplexity {result.value:.4f} over {result.tokens} tokens ({result.windows} windows of {args.context}, "
          f"second halves scored) of {text.name}, {model} on {args.runtime}")
    return 0


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="checkpoint directory (default: export/default_model)")


def run_train(args: argparse.Namespace) -> int:
    from batchstring.export.layout import DEFAULT_MODEL_DIR
    from batchstring.export.train import train

    train(args.out or DEFAULT_MODEL_DIR)
    return 0
