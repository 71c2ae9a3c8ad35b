"""batchstring client: `batchstring(list[str]) -> list[str]` against the Triton `llm` model."""

from client.aio import AsyncBatchClient
from client.errors import BatchError, DeadlineExceeded, ItemError, StreamBroken
from client.protocol import Completion
from client.retry import RetryPolicy
from client.sync import BatchClient, batchstring

__all__ = [
    "AsyncBatchClient",
    "BatchClient",
    "BatchError",
    "Completion",
    "DeadlineExceeded",
    "ItemError",
    "RetryPolicy",
    "StreamBroken",
    "batchstring",
]
