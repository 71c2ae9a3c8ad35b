"""batchstring client: `batchstring(list[str]) -> list[str]` against a batchstring server.

Names are loaded on first use (PEP 562), so that the `batchstring` command can dispatch to a
subcommand that needs no gRPC (the server's `gpu-check` on a bare GPU machine) without loading it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchstring.client.aio import AsyncBatchClient
    from batchstring.client.errors import (
        BatchError,
        BatchstringError,
        DeadlineExceeded,
        Internal,
        InvalidArgument,
        NotFound,
        StreamBroken,
        TooLarge,
        Unauthenticated,
        Unavailable,
    )
    from batchstring.client.protocol import Completion
    from batchstring.client.retry import RetryPolicy
    from batchstring.client.sync import BatchClient, batchstring

_EXPORTS = {
    "AsyncBatchClient": "aio",
    "BatchClient": "sync",
    "BatchError": "errors",
    "Completion": "protocol",
    "DeadlineExceeded": "errors",
    "BatchstringError": "errors",
    "Internal": "errors",
    "InvalidArgument": "errors",
    "NotFound": "errors",
    "TooLarge": "errors",
    "Unauthenticated": "errors",
    "Unavailable": "errors",
    "RetryPolicy": "retry",
    "StreamBroken": "errors",
    "batchstring": "sync",
}
__all__ = ["AsyncBatchClient", "BatchClient", "BatchError", "BatchstringError", "Completion", "DeadlineExceeded",
           "Internal", "InvalidArgument", "NotFound", "RetryPolicy", "StreamBroken", "TooLarge", "Unauthenticated",
           "Unavailable", "batchstring"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
