"""The bad-input corpus through the real server, concurrently with good requests.

Each case gets either a correct completion or an error that names the field and what is
allowed; good requests sent at the same time are unaffected; the server stays healthy.
`python -m tests.test_bad_inputs URL` prints the table that docs/BAD_INPUTS.md holds.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from tests import raw
from tests.raw import EXCLUDE_INPUT, Tensor, params, text

OK = None  # a completion is the correct outcome
DEFAULT_PARAMS = '{"max_tokens": 8, "temperature": 0}'  # for cases that send no sampling_parameters

# (case, tensors, expected: None for a completion, else substrings the error must contain)
CASES = [
    ("empty string", [text("")], ["text_input is empty"]),
    ("whitespace only", [text("   \n\t ")], OK),
    ("100 kB prompt", [text("x = 1\n" * 17000)], ["text_input is", "at most 16384 bytes"]),
    ("invalid UTF-8 bytes", [text(b"def \xff\xfe(x):")], ["not valid UTF-8", "0xff", "offset 4"]),
    ("NUL bytes", [text("a\x00b\x00c")], OK),
    ("emoji and combining characters", [text("# 🐍 café e\u0301 ñ\n")], OK),
    ("right-to-left text", [text("# שלום עולם مرحبا\n")], OK),
    ("prompt + max_tokens beyond the context", [text("word " * 400), params('{"max_tokens": 300}')],
     ["prompt is", "must be at most 512"]),
    ("malformed JSON sampling_parameters", [text("x"), params('{"max_tokens": 5')], ["not valid JSON"]),
    ("sampling_parameters not an object", [text("x"), params("[5]")], ["must be a JSON object"]),
    ("unknown sampling key", [text("x"), params('{"beam_width": 4}')], ["unknown", "beam_width", "allowed"]),
    ("wrong type for max_tokens", [text("x"), params('{"max_tokens": "many"}')], ["max_tokens", "integer"]),
    ("NaN temperature", [text("x"), params('{"temperature": NaN}')], ["temperature", "[0, 100]"]),
    ("negative max_tokens", [text("x"), params('{"max_tokens": -5}')], ["max_tokens", "[1, 512]"]),
    ("huge max_tokens", [text("x"), params('{"max_tokens": 1000000000000}')], ["max_tokens", "[1, 512]"]),
    ("temperature < 0", [text("x"), params('{"temperature": -1}')], ["temperature", "[0, 100]"]),
    ("top_p > 1", [text("x"), params('{"top_p": 1.5}')], ["top_p", "(0, 1]"]),
    ("top_k < -1", [text("x"), params('{"top_k": -7}')], ["top_k", "-1 or 0 disables"]),
    ("stop is not a string", [text("x"), params('{"stop": 42}')], ["stop", "string"]),
    ("min_tokens > max_tokens", [text("x"), params('{"min_tokens": 9, "max_tokens": 3}')],
     ["min_tokens", "max_tokens"]),
    ("sampling_parameters not UTF-8", [text("x"), params(b'{"stop": "\xff"}')], ["sampling_parameters", "UTF-8"]),
    ("numbers as strings (genai-perf style)", [text("def "), params('{"max_tokens": "4", "temperature": "0"}')], OK),
    ("stream with wrong dtype", [text("x"), Tensor("stream", "INT32", 1)], ["stream", "expects 'BOOL'"]),
    ("text_input with wrong shape", [Tensor("text_input", "BYTES", np.array([[b"a", b"b"]], dtype=np.object_))],
     ["text_input", "shape"]),
    ("two strings in one request", [
        Tensor("text_input", "BYTES", np.array([[b"a"], [b"b"]], dtype=np.object_)),
        Tensor("exclude_input_in_output", "BOOL", np.array([[True], [True]])),
        Tensor("sampling_parameters", "BYTES", np.array([[b"{}"], [b"{}"]], dtype=np.object_)),
    ], ["text_input", "shape [2, 1]", "one string per request"]),
    ("batch dimensions that disagree", [Tensor("text_input", "BYTES", np.array([[b"a"], [b"b"]], dtype=np.object_))],
     ["batch size does not match"]),
    ("missing text_input", [params('{"max_tokens": 2}')], ["text_input"]),
    ("unknown input tensor", [text("x"), Tensor("prompt", "BYTES", b"x")], ["prompt"]),
    ("5000-digit integer", [text("x"), params('{"max_tokens": ' + "9" * 5000 + "}")],
     ["INVALID_ARG", "too long to read", "4300 digits"]),
    ("JSON nested 4000 deep", [text("x"), params("[" * 4000 + "]" * 4000)], ["INVALID_ARG", "nested too deeply"]),
    ("temperature 1e-40", [text("x"), params('{"temperature": 1e-40}')],
     ["INVALID_ARG", "0 (greedy) or in [0.01, 100]"]),
    ("10 kB sampling_parameters", [text("x"), params(json.dumps({"stop": ["s" * 100] * 100}))],
     ["INVALID_ARG", "at most 8192 bytes"]),
    ("logprobs beyond 20", [text("x"), params('{"logprobs": 50}')], ["logprobs", "[0, 20]"]),
    ("logprobs asked for", [text("def "), params('{"logprobs": 3, "max_tokens": 4, "temperature": 0}')], OK),
]


def run_corpus(url: str, good_prompts: list[str]) -> tuple[list, list]:
    """Sends every case and the good prompts at once; returns both outcome lists."""
    def short(tensors: list[Tensor]) -> list[Tensor]:
        """Adds the inputs every case shares, unless the case sets them itself."""
        present = {t.name for t in tensors}
        extra = [t for t in (EXCLUDE_INPUT, params(DEFAULT_PARAMS)) if t.name not in present]
        return [*tensors, *extra]

    bad = [raw.request(f"bad-{i}", *short(tensors)) for i, (_, tensors, _) in enumerate(CASES)]
    good = [raw.request(f"good-{i}", text(p), EXCLUDE_INPUT, params('{"max_tokens": 8, "temperature": 0}'))
            for i, p in enumerate(good_prompts)]
    pieces = asyncio.run(raw.send_all(url, bad + good))
    return [raw.outcome(p) for p in pieces[: len(bad)]], [raw.outcome(p) for p in pieces[len(bad):]]


@pytest.fixture(scope="module")
def outcomes(server, client):
    good_prompts = [f"def good_{i}(x):" for i in range(12)]
    expected_good = client.batchstring(good_prompts, max_tokens=8)
    bad, good = run_corpus(server.grpc_url, good_prompts)
    return bad, good, expected_good


def test_corpus_has_at_least_twenty_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_each_bad_input_gets_a_completion_or_a_clear_error(outcomes, index):
    name, _, expected = CASES[index]
    error, completion = outcomes[0][index]
    if expected is OK:
        assert error is None, f"{name}: expected a completion, got {error}"
    else:
        assert error is not None, f"{name}: expected an error, got completion {completion!r}"
        for fragment in expected:
            assert fragment in error, f"{name}: {fragment!r} not in {error!r}"


def test_inputs_that_should_succeed_get_the_in_process_engines_completion(outcomes, model_dir):
    """The right completion, not only no error: the engine alone on the same text and parameters."""
    from batchstring.engine.sampling_params import parse_sampling_parameters
    from tests.engine_helpers import engine

    eng = engine(model_dir)
    checked = 0
    for (name, tensors, expected), (_, completion) in zip(CASES, outcomes[0]):
        if expected is not OK:
            continue
        found = {t.name: t.value for t in tensors}
        sampling = parse_sampling_parameters(found.get("sampling_parameters", DEFAULT_PARAMS.encode()).decode(),
                                             eng.max_len, 16)
        seq = eng.make_sequence(found["text_input"].decode(), sampling, lambda o: None)
        eng.generate([seq])
        assert completion == eng.codec.decode(seq.output_ids), name
        checked += 1
    assert checked >= 6


def test_good_requests_sent_alongside_are_unaffected(outcomes):
    _, good, expected_good = outcomes
    assert [e for e, _ in good] == [None] * len(good)
    assert [c for _, c in good] == expected_good


def test_server_is_healthy_after_the_corpus(outcomes, server, client):
    assert server.model_ready()
    assert len(server.stub_processes()) == 1
    assert client.batchstring(["def still_ok():"], max_tokens=4)[0]


def markdown(url: str) -> str:
    bad, _ = run_corpus(url, [])
    lines = ["| # | input | outcome |", "|---|---|---|"]
    for i, ((name, _, _), (error, completion)) in enumerate(zip(CASES, bad), 1):
        shown = f"error: {error}" if error else f"completion: {json.dumps(completion)[:60]}"
        shown = shown.replace("|", "\\|")
        lines.append(f"| {i} | {name} | {shown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(sys.argv[1]))
