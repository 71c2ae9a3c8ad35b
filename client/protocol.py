"""The `llm` model's wire format: one ModelInferRequest per string, and its stream responses.

Built on tritonclient's generated protobuf classes rather than its streaming helpers, because
those turn an error response into an exception without the request id, and a multiplexed
stream must know which item an error belongs to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from batchstring.client.defaults import MODEL
from batchstring.client.errors import BatchstringError, InvalidArgument, from_server

DEADLINE_PARAMETER = "deadline_us"  # request parameter: microseconds left for this request
ADAPTER_PARAMETER = "adapter"  # request parameter: the served LoRA adapter to run with (absent: the base model)
CACHE_SALT_PARAMETER = "cache_salt"  # request parameter: only requests with the same salt share cached prefixes
INTERACTIVE, BATCH = 1, 2  # Triton priority levels (config.pbtxt dynamic_batching): 1 is served first
# The same level for the engine, which Triton does not pass its reserved `priority` parameter to:
# the engine admits level 1 first and makes running level-2 rows give way to waiting level-1 ones.
ENGINE_PRIORITY_PARAMETER = "engine_priority"


@dataclass(frozen=True)
class GenerationOptions:
    """Per-call sampling settings, sent as the `sampling_parameters` JSON."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logprobs: int | None = None  # top-n log-probabilities per generated token (0: the chosen token's only)
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict | None = None  # {token id: bias in [-100, 100]}
    # Structured output, at most one: the text generated matches it (docs/client.md, "Structured output").
    json_schema: dict | str | None = None
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark or GBNF
    speculative: bool | None = None  # False: no speculative decoding for this request (the server's default: on)

    def to_json(self) -> str | None:
        values = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items() if v is not None}
        return json.dumps(values) if values else None


@dataclass(frozen=True)
class Piece:
    """One response: a text piece, and on the last one the finish reason and token counts."""

    request_id: str
    text: str = ""
    final: bool = False
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: BatchstringError | None = None  # the item failed (a final piece)
    logprobs: list[dict] | None = None  # per token generated in this piece, when requested


@dataclass(frozen=True)
class Completion:
    """One string's whole answer, with how it ended: what `AsyncBatchClient.complete` returns."""

    text: str
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length" (max_tokens: a constrained
    # completion that ends by length may not have completed its grammar)
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[dict] | None = None

    @classmethod
    def join(cls, pieces: list[Piece]) -> Completion:
        last = pieces[-1] if pieces else Piece("")
        logprobs = [e for p in pieces for e in p.logprobs or ()] if any(p.logprobs is not None for p in pieces) \
            else None
        return cls("".join(p.text for p in pieces), last.finish_reason, last.num_input_tokens,
                   last.num_output_tokens, logprobs)


def _bytes_input(request: service_pb2.ModelInferRequest, name: str, value: bytes) -> None:
    request.inputs.add(name=name, datatype="BYTES", shape=[1, 1])
    request.raw_input_contents.append(serialize_byte_tensor(np.array([[value]], dtype=np.object_)).item())


def _bool_input(request: service_pb2.ModelInferRequest, name: str, value: bool) -> None:
    request.inputs.add(name=name, datatype="BOOL", shape=[1, 1])
    request.raw_input_contents.append(np.array([[value]], dtype=bool).tobytes())


def encode_text(text: str) -> bytes:
    if not isinstance(text, str):
        raise InvalidArgument(f"batchstring inputs must be str; got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"input is not encodable as UTF-8 ({exc.reason} at index {exc.start}); "
                              "remove lone surrogates or encode with errors='replace'") from None


def build_request(request_id: str, text: bytes, options: GenerationOptions, stream: bool,
                  timeout_us: int | None = None, priority: int | None = None,
                  cache_salt: str | None = None, adapter: str | None = None) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    _bytes_input(request, "text_input", text)
    _bool_input(request, "stream", stream)
    _bool_input(request, "exclude_input_in_output", True)
    params = options.to_json()
    if params:
        _bytes_input(request, "sampling_parameters", params.encode())
    # Reserved Triton parameter: mark the last response of each request, even an empty one.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    if timeout_us:
        # The engine drops the work once nobody can read it. Not Triton's own "timeout" parameter:
        # Triton 2.51's dynamic batcher holds requests that carry a short one for hundreds of ms.
        request.parameters[DEADLINE_PARAMETER].int64_param = timeout_us
    if priority:  # Triton's reserved parameter: the dynamic batcher's queue level; and the engine's
        request.parameters["priority"].uint64_param = priority
        request.parameters[ENGINE_PRIORITY_PARAMETER].int64_param = priority
    if cache_salt:
        request.parameters[CACHE_SALT_PARAMETER].string_param = cache_salt
    if adapter:
        request.parameters[ADAPTER_PARAMETER].string_param = adapter
    return request


def parse_response(message: service_pb2.ModelStreamInferResponse) -> Piece:
    response = message.infer_response
    if message.error_message:
        return Piece(response.id, final=True, error=from_server(message.error_message))
    final = response.parameters["triton_final_response"].bool_param
    values = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        if tensor.datatype == "BYTES":
            values[tensor.name] = deserialize_bytes_tensor(raw)[0].decode("utf-8")
        else:
            values[tensor.name] = int(np.frombuffer(raw, dtype=np.uint32)[0])
    return Piece(
        response.id,
        text=values.get("text_output", ""),
        final=final,
        finish_reason=values.get("finish_reason", ""),
        num_input_tokens=values.get("num_input_tokens", 0),
        num_output_tokens=values.get("num_output_tokens", 0),
        logprobs=json.loads(values["logprobs"]) if "logprobs" in values else None,
    )
