"""Triton adapter for the batchstring engine: requests in, responses out, nothing else.

Triton's dynamic batcher hands `execute` a batch of requests. Each one is validated (a bad one
gets its own error response and its batch-mates carry on) and submitted to the engine, which
runs on its own thread; its outputs go back through each request's response sender (decoupled
mode, so streaming is one response per text piece), on the responder thread (responder.py).
`execute` returns as soon as the engine has room for the batch: while the engine is saturated,
new requests wait in Triton's queue, where the queue policy of config.pbtxt bounds them and
Triton's queue-time metrics see the saturation.

The engine is the `engine` package, imported from the environment (as the Triton vLLM backend
imports `vllm`): installed with this project, or on PYTHONPATH in the image.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import signal
import site
import subprocess
import time
from pathlib import Path

# The Python backend's embedded interpreter ignores PYTHONPATH. `batchstring serve` sets it to
# the virtualenv holding numpy/onnxruntime/tokenizers, so honour it here, before those imports.
# (In the Docker image they are installed system-wide and PYTHONPATH is unset.)
for _entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    site.addsitedir(_entry)

import triton_python_backend_utils as pb_utils  # noqa: E402
from metrics import MetricsPublisher  # noqa: E402
from responder import Responder, error  # noqa: E402

from batchstring.engine.config import EngineConfig  # noqa: E402
from batchstring.engine.errors import InvalidRequest  # noqa: E402
from batchstring.engine.faults import fault_kind  # noqa: E402
from batchstring.engine.sampling_params import parse_sampling_parameters  # noqa: E402
from batchstring.engine.serving import ServingEngine  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _exit_with_tritonserver()
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the llm model must be decoupled (model_transaction_policy)")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        gpu = args["model_instance_kind"] == "GPU"
        engine_config = EngineConfig.from_parameters(
            params,
            model_dir=Path(args["model_repository"]) / args["model_version"],
            device=f"cuda:{args['model_instance_device_id']}" if gpu else "cpu",
        )
        self.engine = ServingEngine(engine_config, on_broken=self._broken)
        self.engine.core.warm_up()
        self.responder = Responder(pb_utils, self.engine.abandon)
        self.responder.start()
        self.engine.start()
        self.groups = itertools.count()
        self.metrics = MetricsPublisher(pb_utils, self.engine.core.stats, args["model_name"],
                                        args["model_instance_name"], engine_config.speculative_tokens)
        self.metrics.start()
        cache = self.engine.core.cache
        pb_utils.Logger.log_info(
            f"batchstring engine ready: {engine_config.runtime} on {engine_config.device}, "
            f"{engine_config.scheduling} scheduling, KV cache {cache.tokens} tokens "
            f"({cache.tokens * self.engine.core.spec.bytes_per_token / 2**20:.0f} MiB; {cache.reason})"
        )

    def execute(self, requests: list) -> None:
        self.engine.wait_for_room()
        group = next(self.groups)
        accepted = []
        for request in requests:
            sender = request.get_response_sender()
            ticket = self.responder.ticket(sender)
            try:
                ticket.seq = self._sequence(request, ticket, group)
            except InvalidRequest as exc:
                _refuse(sender, str(exc), getattr(exc, "code", "INVALID_ARG"))
            except Exception as exc:  # a bug must fail this request alone, never its batch-mates
                _refuse(sender, f"internal error while reading the request: {type(exc).__name__}: {exc}", "INTERNAL")
            else:
                ticket.send_fault = fault_kind(self.engine.config.fault_marker, ticket.seq.output.prompt) == "send"
                self.responder.track(ticket)
                accepted.append(ticket.seq)
        # Submitted together, after parsing: the whole Triton batch joins the same engine
        # iteration, and the engine thread is not woken (competing for the GIL) mid-batch.
        self.engine.submit(*accepted)
        return None

    def _sequence(self, request, sink, group: int):
        text = _scalar(request, "text_input")
        if text is None:
            raise InvalidRequest("text_input is required: a BYTES tensor of shape [1, 1] holding UTF-8 text")
        try:
            prompt = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"text_input is not valid UTF-8 (byte 0x{text[exc.start]:02x} at offset {exc.start}); "
                "send UTF-8 encoded text"
            ) from None
        raw_params = _scalar(request, "sampling_parameters")
        try:
            params_text = None if raw_params is None else raw_params.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest("sampling_parameters is not valid UTF-8; send a UTF-8 JSON object") from None
        cfg = self.engine.config
        request_parameters = json.loads(request.parameters() or "{}")
        params = parse_sampling_parameters(params_text, self.engine.core.spec.context_length, cfg.default_max_tokens,
                                           request_parameters, self.engine.core.spec.sampling_defaults)
        stream = bool(_scalar(request, "stream") or False)
        include_input = not bool(_scalar(request, "exclude_input_in_output") or False)
        # Microseconds the caller will wait (our client sends them): the engine drops the work after.
        deadline_us = request_parameters.get("deadline_us")
        return self.engine.core.make_sequence(
            prompt,
            params,
            sink,
            request_id=request.request_id() or None,
            stream=stream,
            include_input=include_input,
            group=group,
            deadline=time.monotonic() + deadline_us / 1e6 if isinstance(deadline_us, int) and deadline_us > 0 else None,
            cache_salt=_cache_salt(request),
            priority=_priority(request_parameters),
            adapter=_adapter(request_parameters),
        )

    def _broken(self, why: str) -> None:
        """The engine cannot serve any more: answer every request with a retryable error, then end
        this model process. Triton then reports the model unready, and whatever supervises the
        server (`batchstring serve`, the image's entrypoint, a Kubernetes probe) restarts it."""
        pb_utils.Logger.log_error(f"batchstring engine broken: {why}; failing in-flight requests and exiting")
        self.responder.fail_all(f"the model's engine failed ({why}); it is being restarted: retry")
        self.responder.stop(timeout=5.0)
        os._exit(1)

    def finalize(self) -> None:
        self.engine.stop()
        self.responder.stop()
        self.metrics.stop()


def _priority(request_parameters: dict) -> int:
    """The engine's admission level (the client sends its Triton priority level here too, because
    Triton keeps its reserved `priority` parameter to itself): 1 interactive, 2 background."""
    level = request_parameters.get("engine_priority", 1)
    return level if isinstance(level, int) and level >= 1 else 1


def _adapter(request_parameters: dict) -> str | None:
    """The request's `adapter` parameter: the name of a served LoRA adapter (absent: the base model)."""
    name = request_parameters.get("adapter")
    if name is None or name == "":
        return None
    if not isinstance(name, str):
        raise InvalidRequest(f"parameter adapter must be a string, the name of a served LoRA adapter; got {name!r}")
    return name


def _cache_salt(request) -> bytes:
    """The request's `cache_salt` parameter (the front door's, per API key): only requests with
    the same salt share cached prefix blocks."""
    salt = json.loads(request.parameters() or "{}").get("cache_salt")
    return salt.encode() if isinstance(salt, str) else b""


# Kills the model process ($1) once its parent is no longer tritonserver ($2), reaped or not.
_WATCH_PARENT = 'while [ "$(cut -d " " -f 4 /proc/$1/stat 2>/dev/null)" = "$2" ]; do sleep 0.5; done; kill -9 "$1"'


def _exit_with_tritonserver() -> None:
    """Ends this model process within a second of its tritonserver's end; on a GPU it holds device
    memory a restarted server needs. The stub's own check does not: it asks `kill(parent, 0)`,
    which succeeds while the dead server is not yet reaped, and once that fails its clean-up
    blocks (gdb: in `Stub::TerminateStubToParentQueueMonitor`) behind our calls into Triton: one in
    progress when the server dies (`Metric.set`, a response) waits forever for an answer, holding
    the GIL, so no thread in here could act either (a model without such threads does exit). So
    a shell outside the interpreter watches; it dies with this process (the kernel's parent-death
    signal, armed from this thread, which lives as long as the process)."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    subprocess.Popen(["/bin/sh", "-c", _WATCH_PARENT, "watch", str(os.getpid()), str(os.getppid())],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     preexec_fn=lambda: prctl(1, signal.SIGKILL))  # PR_SET_PDEATHSIG


def _scalar(request, name: str):
    """The single element of an optional [1, 1] input, or None when it was not sent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    array = tensor.as_numpy()
    if array.size != 1:
        raise InvalidRequest(
            f"{name} has shape {list(array.shape)}; send one string per request "
            "(shape [1, 1]: batch size 1) and let the server batch requests"
        )
    return array.reshape(-1)[0]


def _refuse(sender, message: str, code: str) -> None:
    """An error response for one request; if even that fails, its batch-mates still go ahead."""
    try:
        sender.send(pb_utils.InferenceResponse(error=error(pb_utils, message, code)), flags=FINAL)
    except Exception as exc:
        pb_utils.Logger.log_warn(f"could not send an error response ({exc}): {message}")
