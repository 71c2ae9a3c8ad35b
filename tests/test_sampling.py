"""sampling_parameters validation (vLLM-compatible) and the sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import InvalidRequest
from engine.sampling import Sampler, SamplingParams, parse_sampling_parameters


def parse(obj) -> SamplingParams:
    raw = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_sampling_parameters(raw, context_length=512, default_max_tokens=16)


def test_defaults_are_vllms():
    p = parse_sampling_parameters(None, 512, 16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.ignore_eos) == (16, 1.0, 1.0, -1, False)


def test_numeric_and_boolean_strings_are_accepted_as_genai_perf_sends_them():
    p = parse({"max_tokens": "32", "temperature": "0.5", "top_k": "5", "ignore_eos": "true", "seed": "7"})
    assert (p.max_tokens, p.temperature, p.top_k, p.ignore_eos, p.seed) == (32, 0.5, 5, True, 7)


def test_stop_accepts_a_string_or_a_list():
    assert parse({"stop": "\n\n"}).stop == ("\n\n",)
    assert parse({"stop": ["a", "b"]}).stop == ("a", "b")


@pytest.mark.parametrize(
    ("raw", "names"),
    [
        ("{not json", ["not valid JSON"]),
        ("[1, 2]", ["must be a JSON object"]),
        ({"max_token": 5}, ["unknown", "max_token", "allowed", "max_tokens"]),
        ({"max_tokens": -1}, ["max_tokens", "[1, 512]"]),
        ({"max_tokens": 0}, ["max_tokens", "[1, 512]"]),
        ({"max_tokens": 10**9}, ["max_tokens", "[1, 512]"]),
        ({"max_tokens": "lots"}, ["max_tokens", "integer", "got 'lots'"]),
        ({"max_tokens": 1.5}, ["max_tokens", "integer"]),
        ({"max_tokens": True}, ["max_tokens", "integer"]),
        ('{"temperature": NaN}', ["temperature", "[0, 100]"]),
        ({"temperature": -0.1}, ["temperature", "[0, 100]"]),
        ({"temperature": "hot"}, ["temperature"]),
        ({"top_p": 1.5}, ["top_p", "(0, 1]"]),
        ({"top_p": 0}, ["top_p", "(0, 1]"]),
        ({"top_k": -2}, ["top_k", "-1 or 0 disables"]),
        ({"seed": -1}, ["seed"]),
        ({"stop": 5}, ["stop", "string"]),
        ({"stop": [""]}, ["stop", "non-empty"]),
        ({"ignore_eos": "maybe"}, ["ignore_eos", "true or false"]),
        ({"min_tokens": 20, "max_tokens": 10}, ["min_tokens", "max_tokens"]),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_range(raw, names):
    with pytest.raises(InvalidRequest) as info:
        parse(raw)
    for name in names:
        assert name in str(info.value)


def test_greedy_picks_the_argmax_and_respects_bans():
    logits = np.array([0.1, 3.0, 2.0, -1.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0))
    assert sampler(logits, []) == 1
    assert sampler(logits, [1]) == 2


def test_same_seed_same_tokens_and_different_seed_differs():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((40, 50)).astype(np.float32)

    def draw(seed):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [sampler(row, []) for row in rows]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_top_k_and_top_p_restrict_the_support():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    top_k = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=1))
    assert {top_k(logits, []) for _ in range(300)} == {0, 1}
    top_p = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert {top_p(logits, []) for _ in range(300)} == {0, 1}  # 0.5 + 0.3 reaches 0.7
