"""The `batchstring` command: one entry point for every stage of the project.

Subcommands import their implementation when they run, so that `batchstring run` or `serve`
never load torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _export(args: argparse.Namespace) -> int:
    from export.exporter import export_model
    from export.layout import MODEL_VERSION_DIR
    from export.step import UnsupportedModel
    from export.verify import VerificationError

    try:
        export_model(args.model, args.out or MODEL_VERSION_DIR)
    except (UnsupportedModel, VerificationError) as exc:
        print(f"batchstring export: {exc}", file=sys.stderr)
        return 1
    return 0


def _train(args: argparse.Namespace) -> int:
    from export.layout import DEFAULT_MODEL_DIR
    from export.train import train

    train(args.out or DEFAULT_MODEL_DIR)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from server.serve import run

    return run(args)


def _run(args: argparse.Namespace) -> int:
    from client.cli import run

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from cli.demo import run

    return run(args)


def _engine_bench(args: argparse.Namespace) -> int:
    from loadtest.engine_bench import main as bench

    return bench(args)


def _bench(args: argparse.Namespace) -> int:
    from loadtest.bench import run

    return run(args)


def _loadtest(args: argparse.Namespace) -> int:
    from loadtest.run_locust import run

    return run(args)


def _genai_perf(args: argparse.Namespace) -> int:
    from loadtest.genai_perf import run

    return run(args)


def _soak(args: argparse.Namespace) -> int:
    from loadtest.soak import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from client.cli import add_arguments as run_arguments
    from loadtest.bench import add_arguments as bench_arguments
    from loadtest.engine_bench import add_arguments as engine_bench_arguments
    from loadtest.genai_perf import add_arguments as genai_perf_arguments
    from loadtest.run_locust import add_arguments as loadtest_arguments
    from loadtest.soak import add_arguments as soak_arguments
    from server.serve import add_arguments as serve_arguments

    parser = argparse.ArgumentParser(prog="batchstring", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("export", help="export a HF Llama-family checkpoint to the model repository, verified")
    p.add_argument("--model", type=Path, help="local HF checkpoint directory (default: the shipped model)")
    p.add_argument("--out", type=Path, help="output directory (default: model_repository/llm/1)")
    p.set_defaults(func=_export)

    p = sub.add_parser("train", help="retrain the shipped default model from the Python stdlib (~10 min)")
    p.add_argument("--out", type=Path, help="checkpoint directory (default: export/default_model)")
    p.set_defaults(func=_train)

    p = sub.add_parser("serve", help="run tritonserver on the model repository (loopback by default)")
    serve_arguments(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("run", help="complete prompts on a running server and print the results")
    run_arguments(p)
    p.set_defaults(func=_run)

    p = sub.add_parser("demo", help="start a local server, batch prompts from concurrent callers, show stats")
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu")
    p.set_defaults(func=_demo)

    p = sub.add_parser("bench", help="served-throughput sweep vs baselines: JSON, markdown table, PNG plots")
    bench_arguments(p)
    p.set_defaults(func=_bench)

    p = sub.add_parser("loadtest", help="Locust, headless and bounded, against the local server (started if needed)")
    loadtest_arguments(p)
    p.set_defaults(func=_loadtest)

    p = sub.add_parser("genai-perf", help="NVIDIA genai-perf against the local server, compared with our client")
    genai_perf_arguments(p)
    p.set_defaults(func=_genai_perf)

    p = sub.add_parser("soak", help="minutes of load with model kills and injected OOM; audits every item")
    soak_arguments(p)
    p.set_defaults(func=_soak)

    p = sub.add_parser("engine-bench", help="in-process engine: static vs continuous, and the runner ceiling")
    engine_bench_arguments(p)
    p.set_defaults(func=_engine_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
