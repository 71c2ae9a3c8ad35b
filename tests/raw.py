"""Sends hand-built (possibly malformed) requests to the llm model over a real gRPC stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from batchstring.client.connection import Connection
from batchstring.client.defaults import MODEL
from batchstring.client.protocol import Piece


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    value: object  # bytes / bool / int, or a numpy array for odd shapes

    def array(self) -> np.ndarray:
        if isinstance(self.value, np.ndarray):
            return self.value
        dtype = {"BYTES": np.object_, "BOOL": bool, "INT32": np.int32, "FP32": np.float32}[self.datatype]
        return np.array([[self.value]], dtype=dtype)


def request(request_id: str, *tensors: Tensor) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=MODEL, id=request_id)
    for t in tensors:
        arr = t.array()
        req.inputs.add(name=t.name, datatype=t.datatype, shape=list(arr.shape))
        raw = serialize_byte_tensor(arr).item() if t.datatype == "BYTES" else arr.tobytes()
        req.raw_input_contents.append(raw)
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    return req


def text(value: bytes | str) -> Tensor:
    return Tensor("text_input", "BYTES", value.encode() if isinstance(value, str) else value)


def params(value: str | bytes) -> Tensor:
    return Tensor("sampling_parameters", "BYTES", value.encode() if isinstance(value, str) else value)


EXCLUDE_INPUT = Tensor("exclude_input_in_output", "BOOL", True)


async def send_all(url: str, requests: list[service_pb2.ModelInferRequest]) -> list[list[Piece]]:
    """All requests concurrently on one shared stream; the responses of each, in request order."""
    conn = Connection(url)
    stream = conn.open_stream()

    async def one(req):
        return [p async for p in stream.request(req)]

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await conn.close()


def outcome(pieces: list[Piece]) -> tuple[str | None, str]:
    """(error message or None, completion text)."""
    errors = [str(p.error) for p in pieces if p.error is not None]
    return (errors[0] if errors else None), "".join(p.text for p in pieces)
