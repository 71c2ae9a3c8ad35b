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


def run_export(args: argparse.Namespace) -> int:
    from batchstring.export.exporter import export_model
    from batchstring.export.layout import MODEL_VERSION_DIR
    from batchstring.export.step import UnsupportedModel
    from batchstring.export.verify import VerificationError

    try:
        export_model(args.model, args.out or MODEL_VERSION_DIR, dtype=args.dtype)
    except (UnsupportedModel, VerificationError) as exc:
        print(f"batchstring export: {exc}", file=sys.stderr)
        return 1
    return 0


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="checkpoint directory (default: export/default_model)")


def run_train(args: argparse.Namespace) -> int:
    from batchstring.export.layout import DEFAULT_MODEL_DIR
    from batchstring.export.train import train

    train(args.out or DEFAULT_MODEL_DIR)
    return 0
