"""`batchstring run "text" ...`: completions from a running server, one per argument."""

from __future__ import annotations

import argparse
import json
import sys

from client.aio import DEFAULT_MAX_TOKENS, DEFAULT_URL
from client.errors import BatchError
from client.sync import BatchClient


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="+", metavar="TEXT", help="prompts; use - to read one prompt per line from stdin")
    p.add_argument("--url", default=DEFAULT_URL, help="server gRPC address(es), comma-separated")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--timeout", type=float, help="seconds for the whole call, retries included")
    p.add_argument("--tls-ca", help="PEM CA certificate: connect over TLS")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of text")


def run(args: argparse.Namespace) -> int:
    texts = [line.rstrip("\n") for line in sys.stdin] if args.texts == ["-"] else args.texts
    with BatchClient(args.url, root_certificates=args.tls_ca) as client:
        try:
            results = client.batchstring(texts, max_tokens=args.max_tokens, temperature=args.temperature,
                                         seed=args.seed, timeout=args.timeout, return_exceptions=True)
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
