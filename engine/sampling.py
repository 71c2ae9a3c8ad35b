"""Sampling parameters: the vLLM-compatible JSON a request carries, validated.

Parameters arrive as the vLLM Triton backend receives them: a JSON object whose numbers may be
numeric strings (genai-perf sends `"max_tokens": "16"`) and whose booleans may be "true"/"false".
Defaults are vLLM's, so existing clients see the behaviour they expect. The sampling itself runs
inside the exported step (export/sampler.py); the engine only hands it these values per row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from batchstring.engine.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MIN_TEMPERATURE = 0.01  # below this (but above 0), logits / temperature overflows float32
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top-n log-probabilities per token (the step computes at most this many)
MAX_PARAMETERS_BYTES = 8192  # 16 stop strings of 128 characters fit many times over


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = no limit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probabilities per generated token (0 = the chosen one only)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _as_int(key: str, value: object, low: int, high: int, extra: str = "") -> int:
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or not low <= number <= high:
        raise InvalidRequest(f"sampling_parameters.{key} must be an integer in [{low}, {high}]{extra}; got {value!r}")
    return number


def _as_float(key: str, value: object, low: float, high: float, open_low: bool = False) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    above_low = number is not None and (low < number if open_low else low <= number)
    if not (above_low and math.isfinite(number) and number <= high):
        bracket = "(" if open_low else "["
        raise InvalidRequest(
            f"sampling_parameters.{key} must be a number in {bracket}{low:g}, {high:g}]; got {value!r}"
        )
    return number


def _as_temperature(key: str, value: object) -> float:
    number = _as_float(key, value, 0.0, MAX_TEMPERATURE)
    if 0.0 < number < MIN_TEMPERATURE:
        raise InvalidRequest(
            f"sampling_parameters.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]; "
            f"got {value!r}"
        )
    return number


def _as_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise InvalidRequest(f"sampling_parameters.{key} must be true or false; got {value!r}")


def _as_stop(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)
    ):
        raise InvalidRequest(
            f"sampling_parameters.stop must be a string or a list of at most {MAX_STOP_STRINGS} non-empty "
            f"strings of at most {MAX_STOP_CHARS} characters; got {value!r}"
        )
    return tuple(items)


def parse_sampling_parameters(raw: str | None, context_length: int, default_max_tokens: int,
                              request_parameters: dict | None = None, defaults: dict | None = None) -> SamplingParams:
    """Validates the JSON object; every error names the field and the allowed values.

    `request_parameters` are Triton request parameters (what the generate endpoint makes of extra
    JSON keys, as in `{"text_input": "def ", "max_tokens": 16}`); known sampling keys among them
    apply as the vLLM backend applies them, the others (Triton's own) are not ours to judge.
    `defaults` are the checkpoint's own (its generation_config), for the keys a request leaves out.
    """
    obj: object = {}
    if raw is not None and raw.strip():
        obj = _load_json(raw)
    if not isinstance(obj, dict):
        raise InvalidRequest(f"sampling_parameters must be a JSON object; got {type(obj).__name__}")
    obj.update({k: v for k, v in (request_parameters or {}).items() if k in _PARSERS})
    unknown = sorted(set(obj) - set(_PARSERS))
    if unknown:
        raise InvalidRequest(
            f"unknown sampling_parameters key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_PARSERS)}"
        )
    values = {"max_tokens": default_max_tokens, **(defaults or {})}
    for key, value in obj.items():
        values[key] = _PARSERS[key](key, value, context_length)
    params = SamplingParams(**values)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"sampling_parameters.min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    return params


def _load_json(raw: str) -> object:
    """json.loads, with every way it can fail (size, nesting, huge integers) made a clear error."""
    size = len(raw.encode("utf-8", errors="surrogatepass"))
    if size > MAX_PARAMETERS_BYTES:
        raise InvalidRequest(f"sampling_parameters is {size} bytes; at most {MAX_PARAMETERS_BYTES} bytes are allowed")
    try:
        return json.loads(raw, parse_constant=lambda c: float(c))  # NaN/Infinity reach the range checks
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"sampling_parameters is not valid JSON ({exc.msg} at position {exc.pos})") from None
    except ValueError:  # an integer of more than 4300 digits
        raise InvalidRequest("sampling_parameters has a number too long to read (over 4300 digits); "
                             "every field has a small range, named in the error for that field") from None
    except RecursionError:
        raise InvalidRequest("sampling_parameters is nested too deeply; a flat JSON object is expected") from None


_PARSERS: dict[str, Callable[[str, object, int], object]] = {
    "max_tokens": lambda k, v, ctx: _as_int(k, v, 1, ctx, f" (the model's context is {ctx} tokens)"),
    "min_tokens": lambda k, v, ctx: _as_int(k, v, 0, ctx),
    "temperature": lambda k, v, ctx: _as_temperature(k, v),
    "top_p": lambda k, v, ctx: _as_float(k, v, 0.0, 1.0, open_low=True),
    "top_k": lambda k, v, ctx: _as_int(k, v, -1, 2**31 - 1, " (-1 or 0 disables it)"),
    "seed": lambda k, v, ctx: _as_int(k, v, 0, MAX_SEED),
    "stop": lambda k, v, ctx: _as_stop(v),
    "ignore_eos": lambda k, v, ctx: _as_bool(k, v),
    "logprobs": lambda k, v, ctx: _as_int(k, v, 0, MAX_LOGPROBS),
}
