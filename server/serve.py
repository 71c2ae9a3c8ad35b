"""`batchstring serve`: a real tritonserver on this repository behind its bounded front door,
supervised until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from batchstring.export.layout import STEP_FILES
from batchstring.frontdoor.batch_api.store import default_data_dir
from batchstring.server.local import DRAIN_SECONDS, LocalServer, ServerError
from batchstring.server.repository import parameters, repository_for
from batchstring.server.supervisor import Supervisor
from batchstring.server.triton import DEFAULT_REPOSITORY, TLS, Ports, TritonNotFound


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: configs/cpu.pbtxt (KIND_CPU); gpu: config.pbtxt (KIND_GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address the front door binds (default: loopback only)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--repository", type=Path, default=DEFAULT_REPOSITORY, help="model repository")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="serve this export (`batchstring export --out DIR`) with the repository's configs")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override an engine parameter of config.pbtxt (repeatable)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve the LoRA adapter `peft` saved in DIR as NAME (repeatable); requests choose it by name")
    p.add_argument("--lora-dir", type=Path, metavar="DIR",
                   help="watch DIR for adapters: each subdirectory is one, named as it is, added and removed live")
    p.add_argument("--max-loras", type=int, metavar="N", help="adapter slots resident at once (default 8)")
    p.add_argument("--max-body-bytes", type=int, help="largest HTTP request body (default 1 MiB)")
    p.add_argument("--max-message-bytes", type=int, help="largest gRPC message (default 1 MiB)")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate: serve gRPC over TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    p.add_argument("--no-openai", action="store_true", help="do not serve the OpenAI-compatible /v1 routes")
    p.add_argument("--served-model-name", help="model name of the /v1 routes (default: llm)")
    p.add_argument("--chat-template", type=Path, help="Jinja chat template for /v1/chat/completions, instead of "
                                                      "the checkpoint's own")
    p.add_argument("--api-key-file", type=Path, help="require one of these keys (one per line) on every inference "
                                                     "route; or set BATCHSTRING_API_KEYS in the environment")
    p.add_argument("--data-dir", type=Path, default=default_data_dir(),
                   help="where the Batch API keeps its files and batches across restarts (default: %(default)s)")
    p.add_argument("--batch-store", metavar="URL",
                   help="keep the Batch API's batches and files in this PostgreSQL database "
                        "(postgresql://USER@HOST:PORT/DB, shared by replicas behind one address; the password in "
                        "PGPASSWORD or ~/.pgpass, or the whole URL in BATCHSTRING_BATCH_STORE); default: SQLite "
                        "in --data-dir")
    p.add_argument("--no-supervise", action="store_true", help="do not restart a dead model")
    p.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                   help="on Ctrl-C/SIGTERM: readiness goes off and new requests are refused (retryable) at once; "
                        "requests already admitted may finish for this long (default: %(default)s)")
    p.add_argument("--log", type=Path, help="log file of tritonserver and the front door (default: a temporary file)")


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--param expects KEY=VALUE; got {item!r}")
        params[key] = value
    return params


def adapter_params(args: argparse.Namespace) -> dict[str, str]:
    """--lora, --lora-dir and --max-loras as the engine's parameters (engine/config.py)."""
    params = {}
    named = parse_params(args.lora) if args.lora else {}
    for name, path in named.items():
        if "," in name or "," in path or not Path(path).is_dir():
            raise SystemExit(f"--lora {name}={path}: give a name and the directory `peft` saved the adapter in "
                             "(neither may contain a comma)")
    if named:
        params["adapters"] = ",".join(f"{name}={Path(path).resolve()}" for name, path in named.items())
    if args.lora_dir is not None:
        if not args.lora_dir.is_dir():
            raise SystemExit(f"--lora-dir {args.lora_dir}: not a directory")
        params["adapter_dir"] = str(args.lora_dir.resolve())
    if args.max_loras is not None:
        params["max_adapters"] = str(args.max_loras)
    return params


def front_door_options(args: argparse.Namespace) -> tuple[str, ...]:
    options = ["--no-openai"] if args.no_openai else []
    for flag, value in (("--served-model-name", args.served_model_name), ("--chat-template", args.chat_template),
                        ("--api-key-file", args.api_key_file), ("--batch-store", args.batch_store)):
        if value is not None:
            options += [flag, str(Path(value).resolve()) if isinstance(value, Path) else value]
    return tuple(options)


def run(args: argparse.Namespace) -> int:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    if args.drain_seconds < 0:
        raise SystemExit(f"--drain-seconds must be 0 or more; got {args.drain_seconds:g}")
    tls = TLS(args.tls_cert, args.tls_key) if args.tls_cert else None
    if args.model is None:
        return _serve(args, args.repository, tls)
    with tempfile.TemporaryDirectory(prefix="batchstring-serve-") as scratch:  # its configs and links
        return _serve(args, export_repository(args.model, args.repository, Path(scratch)), tls)


def export_repository(exported: Path, repository: Path, scratch: Path) -> Path:
    """A repository serving the export in `exported`, or a refusal that says how to make one."""
    missing = [name for name in ("runtime.json", "tokenizer.json") if not (exported / name).is_file()]
    if not any((exported / name).is_file() for name in STEP_FILES.values()):
        missing.append(" or ".join(STEP_FILES.values()))
    if missing:
        raise SystemExit(f"batchstring serve: {exported} is not an export (it lacks {', '.join(missing)}); make one "
                         f"with `batchstring export --model CHECKPOINT --out {exported}`")
    return repository_for(exported, scratch / "repository", repository)


def _serve(args: argparse.Namespace, repository: Path, tls: TLS | None) -> int:
    server = LocalServer(config=args.config, host=args.host, repository=repository, tls=tls,
                         ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
                         params={**parse_params(args.param), **adapter_params(args)}, log_path=args.log,
                         max_body_bytes=args.max_body_bytes, max_message_bytes=args.max_message_bytes,
                         front_door_options=front_door_options(args), data_dir=args.data_dir,
                         drain_seconds=args.drain_seconds)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
    except (ServerError, TritonNotFound, ValueError) as exc:
        print(f"batchstring serve: {exc}", file=sys.stderr)
        server.close()
        return 1
    print(banner(server), flush=True)
    try:
        if args.no_supervise:
            stop.wait()
        else:
            Supervisor(server, report=lambda line: print(line, flush=True)).run(stop)
    finally:
        stopping = time.monotonic()
        server.close()
        print(f"batchstring: stopped in {time.monotonic() - stopping:.1f} s", flush=True)
    return 0


def banner(server: LocalServer) -> str:
    from batchstring.server.repository import load_config

    config = load_config(server.repository, "cpu" if server.config == "cpu" else None)
    engine = {**parameters(config), **server.params}
    scheme = "grpcs" if server.tls else "grpc"
    return (f"batchstring: llm ready ({server.config}, {engine['runtime']}, {engine['scheduling']}) | "
            f"{scheme} {server.grpc_url} | http {server.http_url} | metrics {server.metrics_url} | "
            f"{'' if '--no-openai' in server.front_door_options else f'OpenAI API http://{server.http_url}/v1 | '}"
            f"log {server.log_path} | Ctrl-C to stop")
