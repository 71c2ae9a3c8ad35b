"""OpenAI's wire format: what a request body asks for, and the shapes of completions, usage,
log-probabilities and errors.

It is the protocol both sides speak, so it lives with the client (which installs alone): the
client's file jobs write their output lines in it, and the server's `/v1` routes and Batch API
answer in it, so a line of a job's output and a response of the HTTP API are the same object.
What only a server does (routing, HTTP responses, streamed chunks, chat templates) is in
frontdoor/.
"""

from __future__ import annotations

import time
import uuid

from batchstring.client.errors import BatchstringError, DeadlineExceeded, InvalidArgument, NotFound, TooLarge
from batchstring.client.protocol import Completion

MAX_LOGPROBS = 20  # as the engine
MAX_N = 16  # choices per prompt (/v1 routes only)
UNSUPPORTED = {  # what the engine does not do: field -> the only value it may have (empty also passes)
    "n": 1, "best_of": 1, "suffix": None, "tools": None, "tool_choice": None, "functions": None,
    "guided_whitespace_pattern": None, "structural_tag": None,
}
WHY = {"best_of": "best_of is not supported: it generates best_of sequences and returns the most likely; "
                  "ask for n choices and pick among them yourself",
       "n": "n is not supported here: a batch line or file job is one completion (n > 1 works on the "
            "/v1/completions and /v1/chat/completions routes)"}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "min_tokens", "ignore_eos", "min_p",
                   "presence_penalty", "frequency_penalty", "repetition_penalty")
# vLLM's structured_outputs keys and its older guided_* fields -> the engine's sampling_parameters key
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class BodyError(ValueError):
    """A request body field this server cannot honour; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def sampling_options(body: dict, chat: bool = False) -> dict:
    """The client options a completion (or chat) body sets, and only those; the server checks
    ranges. Raises BodyError for what the engine does not do or a field of the wrong shape."""
    for field, allowed in UNSUPPORTED.items():
        if body.get(field) not in (None, allowed, {}, []):
            raise BodyError(field, WHY.get(field, f"{field} is not supported by this server (allowed: {allowed!r})"))
    options = {"max_tokens": body.get("max_completion_tokens", body.get("max_tokens")) if chat
               else body.get("max_tokens"),
               "stop": _stop(body.get("stop")), "logprobs": _logprobs(body, chat),
               "logit_bias": _logit_bias(body.get("logit_bias")),
               **{k: body.get(k) for k in SAMPLING_FIELDS}, **structured_output(body)}
    return {k: v for k, v in options.items() if v is not None}


def choices_per_prompt(body: dict) -> int:
    """`n`: how many completions of each prompt (they share the prompt's cached blocks)."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise BodyError("n", f"n must be an integer in [1, {MAX_N}]; got {n!r}")
    return n


def structured_output(body: dict) -> dict:
    """The one output constraint a body asks for, from OpenAI's `response_format` or vLLM's
    `structured_outputs` / `guided_*` fields, as the client's option; two at once are refused."""
    found = {}  # field as the caller wrote it -> (option, value)
    response_format = body.get("response_format")
    if response_format is not None:
        found.update(_response_format(response_format))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - set(STRUCTURED):
            raise BodyError("structured_outputs", "structured_outputs must be an object with one of "
                            f"{', '.join(STRUCTURED)}; got {outputs!r}"[:300])
        found.update({f"structured_outputs.{k}": (STRUCTURED[k], v) for k, v in outputs.items() if v is not None})
    found.update({k: (option, body[k]) for k, option in GUIDED.items() if body.get(k) is not None})
    if len(found) > 1:
        raise BodyError(next(iter(found)), f"ask for one output constraint at a time; got {', '.join(found)}")
    return {option: value for option, value in found.values()}


def _response_format(value) -> dict:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": ("json_object", True)}
    schema = (value.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
    if isinstance(schema, dict):
        return {"response_format": ("json_schema", schema)}
    raise BodyError("response_format", 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                    '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}; '
                    f"got {value!r}"[:300])


def _logit_bias(value) -> dict | None:
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise BodyError("logit_bias", f'logit_bias must be an object of token ids to biases, as {{"50256": -100}}; '
                                      f"got {value!r}"[:300])
    return value


def _stop(stop) -> list[str] | None:
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise BodyError("stop", "stop must be a string or a list of strings")


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: `logprobs` is the top-n count. Chat: `logprobs` is a flag, `top_logprobs` the count."""
    field = "top_logprobs" if chat else "logprobs"
    value = (body.get("top_logprobs", 0) if body.get("logprobs") else None) if chat else body.get("logprobs")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 0 <= value <= MAX_LOGPROBS):
        raise BodyError(field, f"{field} must be an integer in [0, {MAX_LOGPROBS}]; got {value!r}")
    return value


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error"}.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object, which its SDK turns into the matching exception class."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def failure(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, code, message) for a failed item: 400 for what the request got wrong, 503 for
    what is worth retrying later, 504 for a deadline, 500 for the rest."""
    if isinstance(exc, DeadlineExceeded):
        return 504, "timeout", exc.message
    if isinstance(exc, TooLarge):
        return 413, "too_large", exc.message
    if isinstance(exc, NotFound):
        return 404, "model_not_found", exc.message
    if isinstance(exc, InvalidArgument):
        return 400, "invalid_value", exc.message
    if isinstance(exc, BatchstringError) and exc.retryable:
        return 503, "unavailable", f"{exc}; retry with backoff"
    return 500, "internal_error", str(exc)


def head(model: str, chat: bool) -> dict:
    kind = "chat.completion" if chat else "text_completion"
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind,
            "created": int(time.time()), "model": model}


def choice(index: int, c: Completion, chat: bool = False, echo: str | None = None) -> dict:
    """One choice of a completion; `echo` is the prompt, when it is returned in front of the text."""
    lp = logprobs(c.logprobs, chat, len(echo) if echo else 0)
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                "finish_reason": c.finish_reason}
    return {"index": index, "text": (echo or "") + c.text, "logprobs": lp, "finish_reason": c.finish_reason}


def completion(model: str, results: list[Completion], chat: bool = False, echo: list[str] | None = None) -> dict:
    choices = [choice(i, c, chat, echo[i] if echo else None) for i, c in enumerate(results)]
    return {**head(model, chat), "choices": choices, "usage": usage(results)}


def logprobs(entries: list[dict] | None, chat: bool, offset: int = 0) -> dict | None:
    """The engine's per-token entries in the completions shape (parallel lists, text offsets) or
    the chat shape (a list of token objects with their bytes)."""
    if entries is None:
        return None
    if chat:
        def item(e: dict) -> dict:
            return {"token": e["token"], "logprob": e["logprob"], "bytes": list(e["token"].encode())}

        return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top_logprobs"]]} for e in entries]}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def usage(results: list[Completion]) -> dict:
    prompt = sum(r.prompt_tokens for r in results)
    generated = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
