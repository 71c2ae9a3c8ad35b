"""sampling_parameters validation (vLLM-compatible) and the sampling head of the exported step."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from batchstring.engine.errors import InvalidRequest
from batchstring.engine.sampling_params import SamplingParams, parse_sampling_parameters
from batchstring.export.contract import SamplingInputs
from batchstring.export.sampler import SamplingHead
from batchstring.export.verify import NEAR_TIE, Sampling, reference_sample


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


def test_odd_json_gets_a_clear_invalid_argument():
    for raw, message in [
        ('{"max_tokens": ' + "9" * 5000 + "}", "too long to read"),
        ("[" * 4000 + "]" * 4000, "nested too deeply"),
        (json.dumps({"stop": ["x" * 100] * 100}), "at most 8192 bytes"),
        (json.dumps({"stop": ["x" * 100] * 500}), "at most 40960 bytes"),
        ({"temperature": 1e-40}, "0 (greedy) or in [0.01, 100]"),
        ({"logprobs": 21}, "logprobs"),
    ]:
        with pytest.raises(InvalidRequest, match=re.escape(message)):
            parse(raw)


def test_logprobs_and_the_smallest_temperature_are_accepted():
    p = parse({"logprobs": 5, "temperature": 0.01})
    assert (p.logprobs, p.temperature) == (5, 0.01)


# ----- the sampling head of the exported step (run eagerly here; export verifies the graphs) -----

V = 300
EOS_ID = 3


def head_run(logits: np.ndarray, rows: list[Sampling]) -> np.ndarray:
    head = SamplingHead(logits.shape[1], [EOS_ID])
    chosen = [i for i, r in enumerate(rows) if r.temperature > 0 or r.top_k or r.top_p < 1]
    picked = [rows[i] for i in chosen]
    sampling = SamplingInputs.plain(
        ban_rows=np.array([i for i, r in enumerate(rows) if r.ban_eos], np.int64),
        sample_rows=np.array(chosen, np.int64),
        temperature=np.array([r.temperature for r in picked], np.float32),
        top_k=np.array([r.top_k for r in picked], np.int64),
        top_p=np.array([r.top_p for r in picked], np.float32),
        uniform=np.array([r.uniform for r in picked], np.float32))
    with torch.no_grad():
        tokens, *_ = head(torch.from_numpy(logits), *(torch.from_numpy(a) for a in vars(sampling).values()))
    return tokens.numpy()


def random_rows(n: int, seed: int) -> tuple[np.ndarray, list[Sampling]]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, V)) * rng.uniform(0.5, 4, (n, 1))).astype(np.float32)
    kinds = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9), (0.8, 40, 0.95),
             (1.5, 0, 0.5), (1.0, 500, 1.0), (2.0, 1, 1.0)]
    rows = [Sampling(*kinds[i % len(kinds)], ban_eos=bool(i % 4 == 0), uniform=float(1 - rng.random()))
            for i in range(n)]
    return logits, rows


def test_the_head_picks_what_the_reference_sampler_picks_except_near_ties():
    logits, rows = random_rows(900, seed=1)
    tokens = head_run(logits, rows)
    differ = [i for i, r in enumerate(rows) if reference_sample(logits[i], r, [EOS_ID])[0] != tokens[i]]
    near = [i for i in differ if reference_sample(logits[i], rows[i], [EOS_ID])[1] < NEAR_TIE]
    assert differ == near, f"rows {sorted(set(differ) - set(near))} differ beyond a near-tie"
    assert len(differ) <= 2


def test_greedy_rows_are_the_argmax_and_banned_eos_is_never_picked():
    logits, rows = random_rows(200, seed=2)
    logits[:, EOS_ID] = 50.0  # EOS is everyone's favourite
    tokens = head_run(logits, rows)
    for i, r in enumerate(rows):
        if r.ban_eos:
            assert tokens[i] != EOS_ID
        if r.temperature == 0:
            expected = np.argmax(np.where(np.arange(V) == EOS_ID, -np.inf, logits[i])) if r.ban_eos else EOS_ID
            assert tokens[i] == expected


def test_top_k_and_top_p_restrict_the_support_and_temperature_follows_the_distribution():
    probs = np.array([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    logits = np.log(np.maximum(probs, 1e-30)).astype(np.float32)[None].repeat(4000, 0)
    uniform = (np.arange(4000) + 0.5) / 4000
    for (top_k, top_p), support in {(2, 1.0): {0, 1}, (0, 0.7): {0, 1}, (0, 0.85): {0, 1, 2}}.items():
        rows = [Sampling(1.0, top_k, top_p, uniform=float(u)) for u in uniform]
        assert set(head_run(logits, rows).tolist()) == support
    rows = [Sampling(1.0, uniform=float(u)) for u in uniform]
    counts = np.bincount(head_run(logits, rows), minlength=V)[:4] / 4000
    assert np.abs(counts - probs[:4]).max() < 0.01


def test_the_checkpoints_sampling_defaults_apply_only_to_what_a_request_leaves_out():
    from batchstring.engine.sampling_params import parse_sampling_parameters

    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 50}
    left_out = parse_sampling_parameters('{"max_tokens": 4}', 512, 16, defaults=defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 50)
    given = parse_sampling_parameters('{"temperature": 0, "top_k": -1}', 512, 16, defaults=defaults)
    assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0.0, 0.9, -1, 16)
    assert parse_sampling_parameters(None, 512, 16).temperature == 1.0, "no defaults: vLLM's"
