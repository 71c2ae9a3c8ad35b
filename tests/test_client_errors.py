"""Every error the client raises is a BatchstringError of its kind, through a real server where the
kind comes from the server (full queues and broken streams: tests/test_faults.py; API keys:
tests/test_deploy.py and tests/test_openai_api.py)."""

from __future__ import annotations

import asyncio

import pytest

from batchstring.client import (
    AsyncBatchClient,
    BatchClient,
    BatchError,
    BatchstringError,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    RetryPolicy,
    StreamBroken,
    TooLarge,
)
from tests.conftest import FAULT_MARKER


def one(url: str, prompt: str, **options) -> BaseException | str:
    with BatchClient(url, retry=RetryPolicy(max_attempts=1)) as client:
        return client.batchstring([prompt], return_exceptions=True, **options)[0]


def test_bad_input_from_the_server_is_invalid_argument_with_its_message(server):
    error = one(server.grpc_url, "def ", max_tokens=99999)
    assert isinstance(error, InvalidArgument) and isinstance(error, BatchstringError) and not error.retryable
    assert "max_tokens must be an integer in [1, 512]" in error.message and str(error).startswith("INVALID_ARG: ")


def test_a_step_that_fails_for_one_request_is_internal_and_not_retried(server):
    error = one(server.grpc_url, "def poisoned():" + FAULT_MARKER)
    assert isinstance(error, Internal) and not error.retryable and "model step failed" in error.message


def test_a_request_over_the_front_doors_limit_is_too_large_from_either_side(server):
    huge = "x" * (2 * 2**20)
    refused_here = one(server.grpc_url, huge)
    assert isinstance(refused_here, TooLarge) and isinstance(refused_here, InvalidArgument)

    async def past_the_client() -> BaseException:
        async with AsyncBatchClient(server.grpc_url, max_message_bytes=8 * 2**20,
                                    retry=RetryPolicy(max_attempts=3)) as client:
            return (await client.batchstring([huge], return_exceptions=True))[0]

    refused_there = asyncio.run(past_the_client())
    assert isinstance(refused_there, TooLarge) and not refused_there.retryable, refused_there
    assert "RESOURCE_EXHAUSTED" not in type(refused_there).__name__ and "larger than" in refused_there.message


def test_a_deadline_is_deadline_exceeded_and_a_timeout_error(server):
    error = one(server.grpc_url, "def slow():", max_tokens=480, ignore_eos=True, speculative=False, timeout=0.05)
    assert isinstance(error, DeadlineExceeded) and isinstance(error, TimeoutError)
    assert isinstance(error, BatchstringError)


def test_no_server_is_a_broken_stream_retried_until_the_deadline():
    with BatchClient("127.0.0.1:9", retry=RetryPolicy(max_attempts=2, initial_backoff=0.01)) as client:
        error = client.batchstring(["x"], return_exceptions=True, timeout=5)[0]
    assert isinstance(error, StreamBroken) and error.retryable


def test_a_failed_call_raises_batch_error_with_every_items_result(server):
    with BatchClient(server.grpc_url) as client, pytest.raises(BatchError) as failed:
        client.batchstring(["def ok():", "def bad():" + FAULT_MARKER], max_tokens=4)
    assert isinstance(failed.value, BatchstringError)
    assert isinstance(failed.value.results[0], str) and list(failed.value.errors) == [1]
