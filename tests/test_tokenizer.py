"""Tokenizer round trips and byte-exact streaming decode."""

from __future__ import annotations

import pytest

from batchstring.engine.tokenizer import TextCodec

TRICKY = [
    "",
    "def f(x):\n\treturn x  # tab and spaces\n",
    "naïve café — “quotes” ‘and’ ellipsis…",
    "emoji 🐍🚀 and flags 🇫🇷, ZWJ family 👨‍👩‍👧",
    "combining: e\u0301 a\u0308 ñ",
    "right-to-left: שלום עולם / مرحبا بالعالم",
    "CJK 漢字かなカナ 한국어",
    "NUL\x00byte and \x7f DEL",
    "\u2028line separator\u2029",
]


@pytest.fixture(scope="module")
def codec(model_dir) -> TextCodec:
    return TextCodec.from_file(model_dir / "tokenizer.json")


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip(codec, text):
    assert codec.decode(codec.encode(text)) == text


@pytest.mark.parametrize("text", TRICKY)
def test_streaming_pieces_concatenate_to_the_text_and_are_whole_characters(codec, text):
    decoder = codec.stream_decoder()
    pieces = [decoder.push(i) for i in codec.encode(text)] + [decoder.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_multibyte_character_is_held_back_until_complete(codec):
    ids = codec.encode("🐍")
    assert len(ids) > 1, "the byte-level vocabulary should split a rare emoji into byte tokens"
    decoder = codec.stream_decoder()
    pieces = [decoder.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "🐍"


def test_incomplete_bytes_at_the_end_become_a_replacement_character(codec):
    ids = codec.encode("🐍")
    decoder = codec.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd"


def test_lone_surrogate_is_refused_with_a_clear_error(codec):
    with pytest.raises(ValueError, match="lone surrogate"):
        codec.encode("bad \ud800 text")


def test_special_tokens_produce_no_text(codec):
    eot = codec.tokenizer.token_to_id("<|endoftext|>")
    assert eot is not None
    assert codec.token_bytes[eot] == b""
