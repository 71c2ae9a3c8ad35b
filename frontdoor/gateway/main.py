"""`python -m batchstring.frontdoor`: the front door process (HTTP, gRPC and metrics ports) for one tritonserver.

It also watches the model: if `/v2/models/llm/ready` stays false (or Triton unreachable) for
`--exit-when-unready` seconds after it was first ready, it exits with status 3, so that a container restart policy or a
Kubernetes liveness probe acts (Docker restarts a container only when its process exits).

On SIGTERM or SIGINT it drains (health.py `Drain`): readiness off and new requests refused with a
retryable UNAVAILABLE at once, admitted requests finish within `--drain-seconds`, then its ports
and every connection to Triton close, so that tritonserver, stopped next, finds nothing to wait for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web

from batchstring.client import AsyncBatchClient
from batchstring.client.defaults import MODEL
from batchstring.frontdoor.batch_api.routes import BatchRoutes
from batchstring.frontdoor.batch_api.runner import CHUNK_LINES, LEASE_SECONDS, BatchRunner
from batchstring.frontdoor.batch_api.share import DEFAULT_SHARE, Admission
from batchstring.frontdoor.batch_api.store import STORE_ENV, StoreLimits, default_data_dir, open_store, store_url
from batchstring.frontdoor.gateway import grpc as grpc_side
from batchstring.frontdoor.gateway.auth import ApiKeys
from batchstring.frontdoor.gateway.health import Drain
from batchstring.frontdoor.gateway.http import Upstream, make_app, make_metrics_app
from batchstring.frontdoor.gateway.limits import Limits
from batchstring.frontdoor.openai_api.adapters import AdapterNames
from batchstring.frontdoor.openai_api.chat import ChatTemplate
from batchstring.frontdoor.openai_api.routes import OpenAIRoutes

UNREADY_EXIT = 3
DRAIN_SECONDS = 5.0  # with the stop after it (<= 3 s), within `docker stop`'s default 10 s


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m batchstring.frontdoor", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="address of the public ports (default: loopback only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--triton-http", required=True, help="tritonserver's HTTP endpoint: a Unix socket path or host:port")
    p.add_argument("--triton-grpc", required=True, help="tritonserver's gRPC target (unix:PATH or host:port)")
    p.add_argument("--triton-metrics", required=True, help="tritonserver's metrics endpoint, as --triton-http")
    p.add_argument("--max-body-bytes", type=int,
                   help="largest HTTP request body (default: 1 MiB, or room for the model's longest text_input)")
    p.add_argument("--max-message-bytes", type=int,
                   help="largest gRPC message (default: 1 MiB, or room for the model's longest text_input)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate: serve gRPC over TLS")
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--triton-pid", type=int, help="tritonserver's process id: readiness also requires its model "
                                                   "process (the Python backend's stub) to be alive")
    p.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI-compatible /v1 routes")
    p.add_argument("--served-model-name", default=MODEL, help="the model name of the /v1 routes (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, help="the exported model directory (its chat template, if any)")
    p.add_argument("--adapters", default="", metavar="NAME=DIR,...",
                   help="the engine's configured LoRA adapters (engine parameter adapters): /v1 names them as models")
    p.add_argument("--adapter-dir", type=Path, help="the engine's watched adapter directory (parameter adapter_dir)")
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file, instead of the model's own")
    p.add_argument("--api-key-file", type=Path,
                   help="require one of these API keys (one per line) on every inference route; keys may also "
                        "come from the BATCHSTRING_API_KEYS environment variable (never from the command line)")
    batches = p.add_argument_group("the Batch API (/v1/files, /v1/batches; on with the OpenAI API)")
    batches.add_argument("--batch-store", metavar="URL",
                         help="where batches and their files are kept: postgresql://USER@HOST:PORT/DB, shared by every "
                              f"replica behind one address (no password here: {STORE_ENV} carries a URL with one, or "
                              "PGPASSWORD / ~/.pgpass the password); default: SQLite and files in --data-dir, one node")
    batches.add_argument("--batch-lease-seconds", type=float, default=LEASE_SECONDS,
                         help="how long a replica's claim on a chunk of a batch lasts unless renewed; a dead "
                              "replica's chunks are taken over after it (default: %(default)s)")
    batches.add_argument("--batch-chunk-lines", type=int, default=CHUNK_LINES,
                         help="requests per chunk of a batch, the unit replicas claim (default: %(default)s)")
    batches.add_argument("--data-dir", type=Path, default=default_data_dir(),
                         help="where batches and their files are kept across restarts (default: %(default)s)")
    batches.add_argument("--batch-max-file-bytes", type=int, default=StoreLimits.max_file_bytes)
    batches.add_argument("--batch-max-lines", type=int, default=StoreLimits.max_lines)
    batches.add_argument("--batch-max-active", type=int, default=StoreLimits.max_active_batches,
                         help="unfinished batches per API key (default: %(default)s)")
    batches.add_argument("--batch-min-free-bytes", type=int, default=StoreLimits.min_free_bytes,
                         help="free space the data volume keeps: uploads that would eat into it are refused")
    batches.add_argument("--batch-max-in-flight", type=int,
                         help="a fixed bound on batch lines in flight, all batches together (default: the engine's "
                              "max_num_seqs while nobody else calls, a share of the interactive load otherwise)")
    batches.add_argument("--batch-interactive-share", type=float, default=DEFAULT_SHARE,
                         help="while interactive requests run, batch lines in flight per interactive request "
                              "(default: %(default)s)")
    p.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                   help="on SIGTERM, how long requests already admitted may run on (default: %(default)s)")
    p.add_argument("--exit-when-unready", type=float, default=0.0,
                   help="exit (status 3) when the model, once ready, stays unready this many seconds (0: never)")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> int:
    limits = Limits.for_model(args.model_dir, args.max_body_bytes, args.max_message_bytes)
    credentials = None
    if args.tls_cert:
        credentials = grpc.ssl_server_credentials([(args.tls_key.read_bytes(), args.tls_cert.read_bytes())])
    runners = []
    keys = ApiKeys.load(args.api_key_file)
    upstream = Upstream(args.triton_http, args.triton_pid)
    openai, client = None, None
    if not args.no_openai:  # requests go to Triton's gRPC socket through the batchstring client
        client = AsyncBatchClient(args.triton_grpc, max_in_flight=4096, max_message_bytes=limits.max_message_bytes)
        openai = OpenAIRoutes(client, args.served_model_name, ChatTemplate.find(args.model_dir, args.chat_template),
                              keys, AdapterNames(args.adapters, args.adapter_dir))
    drain = Drain()
    http_app = make_app(upstream, limits, openai, keys, drain)
    batches = None if openai is None else _batch_api(args, openai, keys, lambda: drain.pending)
    if batches is not None:
        batches.add_to(http_app)
    for app, port in ((http_app, args.http_port),
                      (make_metrics_app(Upstream(args.triton_metrics)), args.metrics_port)):
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)  # drained by then
        await runner.setup()
        await web.TCPSite(runner, args.host, port).start()
        runners.append(runner)
    server, passthrough = await grpc_side.serve(args.host, args.grpc_port, args.triton_grpc, limits, credentials,
                                                keys, drain, upstream.model)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"frontdoor: http {args.host}:{args.http_port} grpc {args.host}:{args.grpc_port} "
          f"metrics {args.host}:{args.metrics_port} -> triton {args.triton_grpc}; "
          f"OpenAI API {'off' if openai is None else 'on'}, chat {'on' if openai and openai.chat else 'off'}, "
          f"API keys {'required' if keys.enabled else 'off'}, "
          f"batches {'off' if batches is None else f'kept in {args.data_dir}'}", flush=True)
    watch = asyncio.create_task(_watch_readiness(upstream, args.exit_when_unready, stop))
    await stop.wait()
    watch.cancel()
    started, admitted = time.monotonic(), drain.pending
    print(f"frontdoor: draining: readiness off, new requests refused; {admitted} admitted requests get up to "
          f"{args.drain_seconds:g} s", flush=True)
    if batches is not None:
        batches.runner.admission.pause()  # no new batch lines; those in flight finish within the drain
    left = await drain.wait(args.drain_seconds)
    if batches is not None:
        left += await batches.runner.admission.settled(max(0.0, started + args.drain_seconds - time.monotonic()))
    print(f"frontdoor: drained in {time.monotonic() - started:.1f} s"
          f"{f'; {left} requests cut at the deadline, their clients retry' if left else ''}", flush=True)
    await server.stop(grace=0.5 if left else None)  # streams cut at the deadline send their UNAVAILABLE
    await passthrough.close()
    if batches is not None:
        await batches.runner.close()
        batches.store.close()
    if client is not None:
        await client.close()
    for runner in runners:
        await runner.cleanup()
    with contextlib.suppress(asyncio.CancelledError):
        return UNREADY_EXIT if await watch else 0


def _batch_api(args: argparse.Namespace, openai: OpenAIRoutes, keys: ApiKeys,
               interactive: Callable[[], int] | None = None) -> BatchRoutes:
    """The Batch API's routes, store and runner; `interactive` counts the requests in flight that
    are not batch lines, whose share of the engine the batch runner leaves them."""
    limits = StoreLimits(args.batch_max_file_bytes, args.batch_max_lines, args.batch_max_active,
                         args.batch_min_free_bytes)
    store = open_store(store_url(args.batch_store), args.data_dir, limits)
    admission = Admission(args.batch_interactive_share, args.batch_max_in_flight, args.triton_http, interactive)
    runner = BatchRunner(store, openai.client, openai, admission, args.batch_lease_seconds, args.batch_chunk_lines)
    return BatchRoutes(store, runner, keys)


async def _watch_readiness(upstream: Upstream, limit: float, stop: asyncio.Event) -> bool:
    """True (and `stop` set) when the model has been unready for `limit` seconds, counted once it
    has been ready: a model still loading (minutes, for a large one) is the startup probe's affair."""
    if limit <= 0:
        await asyncio.Event().wait()
    unready_since = None
    while True:
        now = time.monotonic()
        ready = await upstream.ready()
        unready_since = None if ready or not upstream.model.has_been_ready else unready_since or now
        if unready_since is not None and now - unready_since >= limit:
            print(f"frontdoor: the model has not been ready for {limit:g} s; exiting so that it is restarted",
                  file=sys.stderr, flush=True)
            stop.set()
            return True
        await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> None:
    sys.exit(asyncio.run(run(parse(argv))))


if __name__ == "__main__":
    main()
