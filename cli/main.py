"""The `batchstring` command: one entry point for every stage of the project.

Each subcommand lives beside what it drives, in a module with `add_arguments`-style and
`run`-style functions; those modules import their heavy dependencies (torch, servers) only when
the subcommand runs, so `batchstring run` or `serve` never load torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, arguments function, run function, help)
COMMANDS = {
    "export": ("export.cli", "add_export_arguments", "run_export",
               "export a HF Llama-family checkpoint to the model repository, verified"),
    "train": ("export.cli", "add_train_arguments", "run_train",
              "retrain the shipped default model from the Python stdlib (~11 min)"),
    "serve": ("server.serve", "add_arguments", "run",
              "run tritonserver on the model repository (loopback by default), supervised"),
    "run": ("client.cli", "add_arguments", "run", "complete prompts on a running server and print the results"),
    "demo": ("cli.demo", "add_arguments", "run",
             "start a local server, batch prompts from concurrent callers, show what the server did"),
    "bench": ("loadtest.bench", "add_arguments", "run",
              "served-throughput sweep vs baselines: JSON, markdown table, PNG plots"),
    "loadtest": ("loadtest.run_locust", "add_arguments", "run",
                 "Locust, headless and bounded, against the local server (started if needed)"),
    "genai-perf": ("loadtest.genai_perf", "add_arguments", "run",
                   "NVIDIA genai-perf against the local server, compared with our client"),
    "gpu-check": ("cli.gpu_check", "add_arguments", "run",
                  "the GPU acceptance run: export float16, numerics on the device, host time, serving"),
    "job-bench": ("loadtest.job_bench", "add_arguments", "run",
                  "memory of `batchstring run --input` over files of growing length"),
    "soak": ("loadtest.soak", "add_arguments", "run",
             "minutes of load with model kills and injected OOM; audits every item"),
    "engine-bench": ("loadtest.engine_bench", "add_arguments", "run",
                     "in-process engine: static vs continuous, and the runner ceiling"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchstring", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, add_arguments, run, text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=text)
        getattr(module, add_arguments)(p)
        p.set_defaults(func=getattr(module, run))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))
