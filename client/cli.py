"""The `batchstring` command, and its `run` subcommand.

`batchstring run "text" ...`: completions from a running server, one per argument; or, with
`--input FILE --output FILE`, a resumable job over a file (client/jobs.py). Other subcommands come
from the `batchstring.commands` entry point group (the server distribution's serve, export, ...);
only the chosen subcommand's module is imported.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from importlib.metadata import entry_points
from pathlib import Path

from batchstring.client.defaults import DEFAULT_MAX_TOKENS, DEFAULT_URL

ENTRY_POINTS = "batchstring.commands"
# name -> (module, arguments function, run function, help)
COMMANDS = {
    "run": ("batchstring.client.cli", "add_arguments", "run",
            "complete prompts on a running server and print the results"),
    "batches": ("batchstring.client.batches", "add_arguments", "run", "the server's Batch API: submit, status, wait, "
                "download, cancel, list"),
}


def installed_commands() -> dict[str, tuple[str, str, str, str]]:
    """`run`, plus what installed distributions add under the `batchstring.commands` group."""
    found = dict(COMMANDS)
    for entry in entry_points(group=ENTRY_POINTS):
        found.update(entry.load())
    return found


def build_parser(commands: dict[str, tuple[str, str, str, str]], chosen: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchstring", description="batchstring: an LLM batch API on Triton.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, add_arguments, run_name, text) in commands.items():
        p = sub.add_parser(name, help=text)
        if chosen in (None, name):
            module = importlib.import_module(module_name)
            getattr(module, add_arguments)(p)
            p.set_defaults(func=getattr(module, run_name))
    return parser


def main(argv: list[str] | None = None, commands: dict[str, tuple[str, str, str, str]] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    commands = commands or installed_commands()
    chosen = argv[0] if argv and argv[0] in commands else None
    args = build_parser(commands, chosen).parse_args(argv)
    sys.exit(args.func(args))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", metavar="TEXT", help="prompts; use - to read one prompt per line from stdin")
    p.add_argument("--url", default=DEFAULT_URL, help="server gRPC address(es), comma-separated")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--adapter", help="a LoRA adapter the server serves (`batchstring serve --lora`); default: the base")
    p.add_argument("--timeout", type=float, help="seconds for the whole call, retries included")
    p.add_argument("--tls-ca", help="PEM CA certificate: connect over TLS")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of text")
    job = p.add_argument_group("jobs over files (resumable: rerun the same command after an interruption)")
    job.add_argument("--input", type=Path, help="JSONL in the OpenAI batch format, or text with one prompt per line")
    job.add_argument("--output", type=Path, help="JSONL in the OpenAI batch output format; appended to, one line "
                                                 "per input")
    job.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                     help="input format (auto: .jsonl/.json files or a first line with a custom_id are JSONL)")
    job.add_argument("--skip-malformed", action="store_true", help="run the valid lines of a file with malformed ones")
    job.add_argument("--retry-failed", action="store_true", help="run again the items whose output line is an error")
    job.add_argument("--max-in-flight", type=int, default=256, help="items outstanding at once (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.input or args.output:
        return run_file(args)
    if not args.texts:
        raise SystemExit("batchstring run: give prompts as arguments, - for stdin, or --input FILE --output FILE")
    from batchstring.client.errors import BatchError
    from batchstring.client.sync import BatchClient

    texts = [line.rstrip("\n") for line in sys.stdin] if args.texts == ["-"] else args.texts
    with BatchClient(args.url, root_certificates=args.tls_ca) as client:
        try:
            results = client.batchstring(texts, max_tokens=args.max_tokens, temperature=args.temperature,
                                         seed=args.seed, timeout=args.timeout, adapter=args.adapter,
                                         return_exceptions=True)
        except Exception as exc:  # connection-level failure: say so plainly
            print(f"batchstring run: {exc}", file=sys.stderr)
            return 1
    failed = [r for r in results if isinstance(r, BaseException)]
    if args.json:
        print(json.dumps([r if isinstance(r, str) else {"error": str(r)} for r in results], ensure_ascii=False))
    else:
        for text, result in zip(texts, results):
            shown = result if isinstance(result, str) else f"[error] {result}"
            print(f"{text}{shown}" if isinstance(result, str) else f"{text!r}: {shown}")
            print("-" * 40)
    if failed:
        print(f"batchstring run: {BatchError(results)}", file=sys.stderr)
    return 1 if failed else 0


def run_file(args: argparse.Namespace) -> int:
    from batchstring.client.aio import AsyncBatchClient
    from batchstring.client.jobs import is_jsonl, run_job

    if not (args.input and args.output):
        raise SystemExit("batchstring run: --input and --output go together")
    if not args.input.is_file():
        raise SystemExit(f"batchstring run: no such input file: {args.input}")
    jsonl = is_jsonl(args.input) if args.format == "auto" else args.format == "jsonl"
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
                "adapter": args.adapter}

    async def job():
        async with AsyncBatchClient(args.url, root_certificates=args.tls_ca, max_in_flight=args.max_in_flight) as c:
            return await run_job(c, args.input, args.output, defaults, jsonl=jsonl, timeout=args.timeout,
                                 skip_malformed=args.skip_malformed, retry_failed=args.retry_failed,
                                 max_in_flight=args.max_in_flight)

    try:
        summary = asyncio.run(job())
    except KeyboardInterrupt:
        print(f"batchstring run: interrupted; what finished is in {args.output}: rerun the same command to "
              "complete the rest", file=sys.stderr)
        return 130
    print("\n".join(summary.lines()), file=sys.stderr)
    return 1 if summary.failed else 0
