"""The server's `batchstring` subcommands: every stage of the project but `run` (the client's).

Installed, they join the `batchstring` command of batchstring-client through the
`batchstring.commands` entry point group. Each lives beside what it drives, in a module with
`add_arguments`-style and `run`-style functions; only the chosen subcommand's module is imported,
so `batchstring serve` never loads torch and `gpu-check` never loads gRPC.
"""

from __future__ import annotations

from batchstring.client import cli as client_cli

# name -> (module, arguments function, run function, help)
COMMANDS = {
    "export": ("batchstring.export.cli", "add_export_arguments", "run_export",
               "export a HF decoder checkpoint (see docs/models.md's families) to the model repository, verified"),
    "quantize": ("batchstring.export.cli", "add_quantize_arguments", "run_quantize",
                 "an export's weights to int8 or int4 (ONNX MatMulNBits), measured against it: perplexity, "
                 "logits, greedy tokens"),
    "perplexity": ("batchstring.export.cli", "add_perplexity_arguments", "run_perplexity",
                   "an export's perplexity on a text file (what a quantization costs, on your own data)"),
    "train": ("batchstring.export.cli", "add_train_arguments", "run_train",
              "retrain the shipped default model from the Python stdlib (~11 min)"),
    "serve": ("batchstring.server.serve", "add_arguments", "run",
              "run tritonserver on the model repository (loopback by default), supervised"),
    "demo": ("batchstring.cli.demo", "add_arguments", "run",
             "start a local server, batch prompts from concurrent callers, show what the server did"),
    "bench": ("batchstring.loadtest.bench", "add_arguments", "run",
              "served-throughput sweep vs baselines: JSON, markdown table, PNG plots"),
    "loadtest": ("batchstring.loadtest.run_locust", "add_arguments", "run",
                 "Locust, headless and bounded, against the local server (started if needed)"),
    "genai-perf": ("batchstring.loadtest.genai_perf", "add_arguments", "run",
                   "NVIDIA genai-perf against the local server, compared with our client"),
    "gpu-check": ("batchstring.cli.gpu_check", "add_arguments", "run",
                  "the device check from a plain checkout: steps traced on the CPU, checked and benchmarked on "
                  "the GPU (--device cpu --quick: on the CPU; --full: ONNX Runtime CUDA and tritonserver)"),
    "job-bench": ("batchstring.loadtest.job_bench", "add_arguments", "run",
                  "memory of `batchstring run --input` over files of growing length"),
    "batch-bench": ("batchstring.loadtest.batch_bench", "add_arguments", "run",
                    "interactive latency and batch throughput, alone and with a Batch API batch running"),
    "structured-bench": ("batchstring.loadtest.structured_bench", "add_arguments", "run",
                         "constrained decoding's cost: free, JSON-schema and mixed traffic in runs of their own, "
                         "and new schemas arriving while others decode"),
    "replica-bench": ("batchstring.loadtest.replica_bench", "add_arguments", "run",
                      "one large Batch API batch on two replicas sharing PostgreSQL, against one replica"),
    "soak": ("batchstring.loadtest.soak", "add_arguments", "run",
             "minutes of load with model kills and injected OOM; audits every item"),
    "peer-bench": ("batchstring.loadtest.peer_bench", "add_arguments", "run",
                   "ours beside llama.cpp's server and HF generate on the same weights, 1-64 callers"),
    "engine-bench": ("batchstring.loadtest.engine_bench", "add_arguments", "run",
                     "in-process engine: static vs continuous, the runner ceiling, host time, long contexts"),
    "long-bench": ("batchstring.loadtest.long_served", "add_arguments", "run",
                   "one long prompt served beside 16 short streaming callers: their inter-token latency, its TTFT"),
}


def main(argv: list[str] | None = None) -> None:
    """The full command from a checkout (`python3 -m batchstring.cli`), without installing."""
    client_cli.main(argv, {**client_cli.COMMANDS, **COMMANDS})
