"""Locust load test: virtual users calling batchstring(list[str]) against the llm model.

Each task is one `batchstring` call: a list of prompts, sent as one Triton request per string,
concurrently, reassembled in order, and reported to Locust as one request named
`batchstring[<list size>]` whose time is the whole call. With streaming on, each string's time
to first token is also reported, as `ttft`.

Two kinds of users share the load: `BatchstringUser` calls Triton's generate endpoints, one
request per string; `OpenAIUser` sends each call as one `POST /v1/completions` whose prompt is the
list (the OpenAI-compatible API; streamed as server-sent events with --stream);
`StructuredUser` sends the same calls with a JSON schema (`response_format`, one of a few
schemas) and fails a call whose finished completion does not parse. Run one kind only by naming
it: `locust -f loadtest/locustfile.py OpenAIUser`. With API keys on the server, set
BATCHSTRING_API_KEY.

Transport: Triton's HTTP generate endpoints through Locust's own gevent-native client
(FastHttpUser). The project's Python client speaks gRPC through asyncio (grpc.aio), which does
not run under gevent's monkey-patching; the generate endpoint is the same model and contract.

Knobs (command-line options of `locust`, or the environment variables in brackets):
  --list-size A-B      strings per call, uniform          [BATCHSTRING_LIST_SIZE, default 1-8]
  --max-tokens A-B     max_tokens per string, uniform     [BATCHSTRING_MAX_TOKENS, default 16-64]
  --prompts SET        "stdlib" (real code windows, 8-200 tokens) or a file, one prompt per line
                                                          [BATCHSTRING_PROMPTS, default stdlib]
  --stream             stream tokens and report TTFT      [BATCHSTRING_STREAM=1]
Run it with `make loadtest` (headless, bounded) or `locust -f loadtest/locustfile.py` (web UI).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import gevent
from locust import FastHttpUser, between, events, task
from locust.exception import ResponseError


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    env = os.environ.get
    parser.add_argument("--list-size", default=env("BATCHSTRING_LIST_SIZE", "1-8"), help="strings per call, A-B")
    parser.add_argument("--max-tokens", default=env("BATCHSTRING_MAX_TOKENS", "16-64"), help="max_tokens, A-B")
    parser.add_argument("--prompts", default=env("BATCHSTRING_PROMPTS", "stdlib"), help="stdlib or a file path")
    parser.add_argument("--stream", action="store_true", default=env("BATCHSTRING_STREAM", "0") == "1",
                        help="stream tokens and report time to first token")


PROMPTS: list[str] = []


@events.test_start.add_listener
def _load_prompts(environment, **_) -> None:
    source = environment.parsed_options.prompts
    if source == "stdlib":
        from batchstring.loadtest.workload import mixed

        PROMPTS[:] = [item.prompt for item in mixed(256, seed=1)]
    else:
        PROMPTS[:] = [line for line in Path(source).read_text().splitlines() if line.strip()]


class _Caller(FastHttpUser):
    """What both kinds of users share: pacing, timeouts, and the shape of one call."""

    abstract = True
    wait_time = between(0.0, 0.5)
    network_timeout = 120.0
    connection_timeout = 10.0

    def next_call(self) -> tuple[list[str], int]:
        """The prompts of one call (--list-size of them) and its max_tokens (--max-tokens)."""
        opts = self.environment.parsed_options
        return random.choices(PROMPTS, k=random.randint(*_range(opts.list_size))), \
            random.randint(*_range(opts.max_tokens))


class BatchstringUser(_Caller):
    @task
    def batchstring(self) -> None:
        opts = self.environment.parsed_options
        prompts, max_tokens = self.next_call()
        size = len(prompts)
        began = time.perf_counter()
        jobs = [gevent.spawn(self._one, prompt, max_tokens, opts.stream) for prompt in prompts]
        gevent.joinall(jobs)
        errors = [job.exception or job.value for job in jobs if job.exception or isinstance(job.value, Exception)]
        self.environment.events.request.fire(
            request_type="call", name=f"batchstring[{size}]",
            response_time=(time.perf_counter() - began) * 1000,
            response_length=sum(len(job.value) for job in jobs if isinstance(job.value, str)),
            exception=errors[0] if errors else None, context={},
        )

    def _one(self, prompt: str, max_tokens: int, stream: bool) -> str | Exception:
        body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0, "exclude_input_in_output": True,
                "stream": stream}
        path = "/v2/models/llm/generate_stream" if stream else "/v2/models/llm/generate"
        began = time.perf_counter()
        try:
            with self.client.post(path, name="string", json=body, catch_response=True, stream=stream) as response:
                if response.status_code != 200:
                    message = _error_message(response)
                    response.success()  # reported once, for the whole batchstring call
                    return ResponseError(f"HTTP {response.status_code}: {message}")
                if not stream:
                    return json.loads(response.content)["text_output"]
                pieces, first = [], None
                for event in _sse_events(response):
                    if "error" in event:
                        return ResponseError(event["error"])
                    if first is None:
                        first = time.perf_counter()
                        self.environment.events.request.fire(
                            request_type="stream", name="ttft", response_time=(first - began) * 1000,
                            response_length=0, exception=None, context={})
                    pieces.append(event.get("text_output", ""))
                response.success()
                return "".join(pieces)
        except Exception as exc:  # connection errors: reported with the call
            return exc


class OpenAIUser(_Caller):
    name = "openai"

    def body(self) -> dict:
        return {}

    @task
    def completions(self) -> None:
        opts = self.environment.parsed_options
        prompts, max_tokens = self.next_call()
        size = len(prompts)
        body = {"model": "llm", "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "stream": opts.stream,
                **self.body()}
        key = os.environ.get("BATCHSTRING_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with self.client.post("/v1/completions", name=f"{self.name}[{size}]", json=body, headers=headers,
                              catch_response=True, stream=opts.stream) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {_error_message(response)}")
                return
            if not opts.stream:
                choices = json.loads(response.content)["choices"]
            else:
                events = list(_sse_events(response, done=b"[DONE]"))
                errors = [e["error"] for e in events if "error" in e]
                if errors:
                    response.failure(str(errors[0]))
                    return
                choices = [c for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
            if len(choices) != size:
                response.failure(f"{len(choices)} completions for {size} prompts")
            elif not opts.stream and not self.valid(choices):
                response.failure("a finished completion does not match its schema")

    def valid(self, choices: list[dict]) -> bool:
        return True


SCHEMAS = [  # small extraction shapes, as batch jobs use them
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "kind": {"enum": ["function", "class", "module"]}}, "required": ["name", "kind"]},
    {"type": "object", "properties": {"lines": {"type": "integer", "minimum": 0, "maximum": 500},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "maxItems": 3}}, "required": ["lines", "tags"]},
]


class StructuredUser(OpenAIUser):
    """OpenAIUser's calls with a JSON schema: the structured-output load."""

    name = "structured"

    def body(self) -> dict:
        schema = random.choice(SCHEMAS)
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "extract", "schema": schema}}}

    def valid(self, choices: list[dict]) -> bool:
        try:
            return all(isinstance(json.loads(c["text"]), dict) for c in choices if c["finish_reason"] == "stop")
        except ValueError:
            return False


def _error_message(response) -> str:
    try:
        error = json.loads(response.content)["error"]
        return error["message"] if isinstance(error, dict) else error  # OpenAI's shape, or Triton's
    except (ValueError, KeyError, TypeError):
        return (response.text or "")[:200]


def _sse_events(response, done: bytes | None = None):
    """Parses server-sent events: `data: {json}` blocks (until `data: <done>`, for OpenAI's)."""
    buffer = b""
    for chunk in response.iter_content(chunk_size=512, decode_content=False):
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.splitlines():
                if line.startswith(b"data:") and line[5:].strip() != done:
                    yield json.loads(line[5:])
