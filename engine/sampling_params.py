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
from functools import cached_property

from batchstring.engine.errors import InvalidRequest

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MIN_TEMPERATURE = 0.01  # below this (but above 0), logits / temperature overflows float32
MAX_TEMPERATURE = 100.0
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top-n log-probabilities per token (the step computes at most this many)
MAX_PARAMETERS_BYTES = 8192  # 16 stop strings of 128 characters fit many times over
MAX_GUIDE_BYTES = 32768  # a JSON schema, regex, grammar or the choices together, besides the above
MAX_CHOICES = 256
MAX_LOGIT_BIAS = 300  # entries (OpenAI's own limit)
GUIDE_KEYS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Guide:
    """What a constrained request's output must match (engine/grammar.py compiles it). `kind` is
    the sampling_parameters key it came from (named in errors); `text` is the grammar text: a JSON
    schema (keys sorted, so equal schemas share a cache entry), a regex, the choices as a JSON list,
    or a Lark / GBNF grammar."""

    kind: str
    text: str


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
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    guide: Guide | None = None  # constrained decoding
    speculative: bool = True  # false: never speculative drafts for this request (engine/speculation.py)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def adjusts(self) -> bool:
        """Whether the step changes this row's logits (logit_bias or a penalty)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @cached_property
    def plain(self) -> bool:
        """Neither constrained nor adjusted: what the per-step host work asks of most rows, once."""
        return self.guide is None and not self.adjusts


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


def _as_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's shape: {"token id": bias}, bias in [-100, 100]. Ids are checked against the
    vocabulary when the request is tokenised (EngineCore.make_sequence), where its size is known."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"sampling_parameters.logit_bias must be an object of at most {MAX_LOGIT_BIAS} "
                             f'token ids to biases, as {{"50256": -100}}; got {_short(value)}')
    entries = {}
    for key, bias in value.items():
        token = _as_int("logit_bias", key, 0, 2**31 - 1, " (a token id)")
        entries[token] = _as_float("logit_bias", bias, -100.0, 100.0)
    return tuple(sorted(entries.items()))


def _as_guide(key: str, value: object) -> Guide | None:
    """The constrained-decoding keys; each names its own field in errors (json_object: false is no constraint)."""
    if key == "json_object":
        return Guide("json_object", '{"type": "object"}') if _as_bool(key, value) else None
    if key == "json_schema":
        if isinstance(value, str):
            value = _load_json(value, f"sampling_parameters.{key}", MAX_GUIDE_BYTES)
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(
                f"sampling_parameters.json_schema must be a JSON schema (an object); got {_short(value)}")
        text = json.dumps(value, sort_keys=True)
    elif key == "choice":
        if not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"sampling_parameters.choice must be a list of 1 to {MAX_CHOICES} non-empty "
                                 f"strings; got {_short(value)}")
        text = json.dumps(value)
    elif not isinstance(value, str) or not value:
        what = "a regular expression (Rust regex syntax)" if key == "regex" else "a Lark or GBNF grammar"
        raise InvalidRequest(f"sampling_parameters.{key} must be a non-empty string: {what}; got {_short(value)}")
    else:
        text = value
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > MAX_GUIDE_BYTES:
        raise InvalidRequest(f"sampling_parameters.{key} is {size} bytes; at most {MAX_GUIDE_BYTES} bytes are allowed")
    return Guide(key, text)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
        obj = _load_json(raw, limit=MAX_PARAMETERS_BYTES + MAX_GUIDE_BYTES)
    if not isinstance(obj, dict):
        raise InvalidRequest(f"sampling_parameters must be a JSON object; got {type(obj).__name__}")
    _check_size(raw, obj)
    obj.update({k: v for k, v in (request_parameters or {}).items() if k in _PARSERS})
    unknown = sorted(set(obj) - set(_PARSERS))
    if unknown:
        raise InvalidRequest(
            f"unknown sampling_parameters key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(_PARSERS)}"
        )
    guides = [k for k in GUIDE_KEYS if k in obj and not (k == "json_object" and obj[k] in (False, "false"))]
    if len(guides) > 1:
        raise InvalidRequest(f"sampling_parameters may hold one of {', '.join(GUIDE_KEYS)}; got {', '.join(guides)}")
    values = {"max_tokens": default_max_tokens, **(defaults or {})}
    for key, value in obj.items():
        parsed = _PARSERS[key](key, value, context_length)
        if key not in GUIDE_KEYS:
            values[key] = parsed
        elif parsed is not None:
            values["guide"] = parsed
    params = SamplingParams(**values)
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"sampling_parameters.min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})"
        )
    return params


def _check_size(raw: str | None, obj: dict) -> None:
    """At most MAX_PARAMETERS_BYTES besides a structured-output constraint (bounded on its own)."""
    size = len((raw or "").encode("utf-8", errors="surrogatepass"))
    guides = [k for k in GUIDE_KEYS if k in obj]
    if guides and size > MAX_PARAMETERS_BYTES:
        size = len(json.dumps({k: v for k, v in obj.items() if k not in GUIDE_KEYS}).encode())
    if size > MAX_PARAMETERS_BYTES:
        besides = f" besides its {guides[0]}" if guides else ""
        raise InvalidRequest(f"sampling_parameters is {size} bytes{besides}; at most {MAX_PARAMETERS_BYTES} bytes "
                             f"are allowed (and {MAX_GUIDE_BYTES} for a json_schema, regex, choice or grammar)")


def _load_json(raw: str, name: str = "sampling_parameters", limit: int = MAX_PARAMETERS_BYTES) -> object:
    """json.loads, with every way it can fail (size, nesting, huge integers) made a clear error."""
    size = len(raw.encode("utf-8", errors="surrogatepass"))
    if size > limit:
        raise InvalidRequest(f"{name} is {size} bytes; at most {limit} bytes are allowed")
    try:
        return json.loads(raw, parse_constant=lambda c: float(c))  # NaN/Infinity reach the range checks
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid JSON ({exc.msg} at position {exc.pos})") from None
    except ValueError:  # an integer of more than 4300 digits
        raise InvalidRequest(f"{name} has a number too long to read (over 4300 digits); "
                             "every field has a small range, named in the error for that field") from None
    except RecursionError:
        flat = "; a flat JSON object is expected" if name == "sampling_parameters" else ""
        raise InvalidRequest(f"{name} is nested too deeply{flat}") from None


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
    "min_p": lambda k, v, ctx: _as_float(k, v, 0.0, 1.0),
    "presence_penalty": lambda k, v, ctx: _as_float(k, v, -2.0, 2.0),
    "frequency_penalty": lambda k, v, ctx: _as_float(k, v, -2.0, 2.0),
    "repetition_penalty": lambda k, v, ctx: _as_float(k, v, 0.0, 2.0, open_low=True),
    "logit_bias": lambda k, v, ctx: _as_logit_bias(v),
    "speculative": lambda k, v, ctx: _as_bool(k, v),
    **{key: (lambda k, v, ctx: _as_guide(k, v)) for key in GUIDE_KEYS},
}
