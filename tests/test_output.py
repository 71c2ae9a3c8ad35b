"""Stop strings and streaming, without a model: the tokenizer's real tokens, its longest ones above all."""

from __future__ import annotations

import random

import pytest

from batchstring.engine.output import OutputStream
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.tokenizer import TextCodec


@pytest.fixture(scope="module")
def codec(model_dir) -> TextCodec:
    return TextCodec.from_file(model_dir / "tokenizer.json")


def longest_tokens(codec: TextCodec, count: int = 60) -> list[int]:
    decodable = [i for i, b in enumerate(codec.token_bytes) if b and b.decode("utf-8", "replace") == b.decode("utf-8",
                                                                                                         "ignore")]
    return sorted(decodable, key=lambda i: -len(codec.token_bytes[i]))[:count]


def reference_cut(codec: TextCodec, ids: list[int], stops: tuple[str, ...]) -> tuple[str, bool]:
    """The obvious way: after every token, look for every stop string in the whole text so far."""
    for n in range(1, len(ids) + 1):
        text = codec.decode(ids[:n])
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return codec.decode(ids), False


def run_stream(codec: TextCodec, ids: list[int], stops: tuple[str, ...], stream: bool) -> tuple[str, bool]:
    pieces: list[str] = []
    out = OutputStream("r", "", 0, lambda o: pieces.append(o.text), codec,
                       SamplingParams(max_tokens=len(ids), stop=stops), stream=stream)
    for n, token in enumerate(ids, 1):
        if out.push(token, n, None):
            final = out.final(ids[:n], "stop", cut=True)
            return "".join(pieces) + final.text if stream else final.text, True
    final = out.final(ids, "length")
    return "".join(pieces) + final.text if stream else final.text, False


def test_stop_strings_are_found_wherever_they_fall_in_long_tokens(codec):
    rng = random.Random(0)
    long = longest_tokens(codec)
    assert len(codec.token_bytes[long[0]]) >= 10, "the tokenizer has long tokens (newline + indentation, ...)"
    cases = found = 0
    for _ in range(300):
        ids = [rng.choice(long) if rng.random() < 0.5 else rng.randrange(len(codec.token_bytes) - 1)
               for _ in range(rng.randint(3, 20))]
        text = codec.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 4)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 24)])
        stops = tuple(s for s in stops if s.strip("\ufffd")) or ("never-appears",)
        expected = reference_cut(codec, ids, stops)
        for stream in (False, True):
            assert run_stream(codec, ids, stops, stream) == expected, (ids, stops, stream)
        cases += 1
        found += expected[1]
    assert found > cases * 0.8, "most cases must actually hit a stop string"


def test_a_stop_string_inside_one_long_token_cuts_there(codec):
    token = longest_tokens(codec, 1)[0]
    text = codec.token_bytes[token].decode()
    stop = text[len(text) // 2 :]  # found only once the whole long piece is there
    prefix = codec.encode("result=compute(value)")  # shares no character with the stop string
    assert not set(codec.decode(prefix)) & set(stop)
    ids = [*prefix, token]
    expected_text = codec.decode(prefix) + text[: text.find(stop)]
    for stream in (False, True):
        assert run_stream(codec, ids, (stop,), stream) == (expected_text, True)
