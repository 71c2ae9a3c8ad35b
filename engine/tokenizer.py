"""Tokenizer wrapper with byte-exact, incremental detokenization.

Streaming must never emit half of a multi-byte UTF-8 character, and `decode(ids)` of a prefix
is not a prefix of `decode(ids + more)` for byte-level BPE. So each token is mapped to the raw
bytes it stands for, and bytes go through an incremental UTF-8 decoder that holds back an
incomplete character until its last byte arrives.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import cache
from pathlib import Path

from tokenizers import Tokenizer

_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_chars() -> list[str]:
    """GPT-2's reversible byte -> printable-character map: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict(zip(printable, printable))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


@cache
def _byte_level_table() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_level_chars())}


def _decoder_types(spec: dict | None) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return {t for d in spec.get("decoders", []) for t in _decoder_types(d)}
    return {spec["type"]}


def token_byte_table(tokenizer: Tokenizer, size: int = 0) -> list[bytes]:
    """The bytes each token id contributes to the output text (special tokens: none).

    `size` pads the table to the model's vocabulary, which may exceed the tokenizer's.

    Supports the two families Llama-like checkpoints ship: byte-level BPE (GPT-2, Llama 3,
    Qwen2) and SentencePiece-style ("▁" for space, "<0xNN>" byte fallback, Llama 2, Mistral).
    """
    spec = json.loads(tokenizer.to_str())
    kinds = _decoder_types(spec.get("decoder"))
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = [b""] * max(size, max(vocab.values()) + 1)
    if "ByteLevel" in kinds:
        char_to_byte = _byte_level_table()
        for piece, i in vocab.items():
            if i not in special:
                table[i] = bytes(char_to_byte[c] for c in piece if c in char_to_byte)
    elif kinds & {"Metaspace", "Replace", "ByteFallback"}:
        for piece, i in vocab.items():
            if i in special:
                continue
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            table[i] = bytes([int(fallback[1], 16)]) if fallback else piece.replace("▁", " ").encode()
    else:
        raise ValueError(
            f"unsupported tokenizer decoder {sorted(kinds) or 'none'}: batchstring streams "
            "byte-level BPE or SentencePiece-style (byte fallback) tokenizers"
        )
    return table


class TextCodec:
    """Encodes prompts and hands out incremental decoders for completions."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int = 0) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_byte_table(tokenizer, vocab_size)

    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int = 0) -> TextCodec:
        return cls(Tokenizer.from_file(str(path)), vocab_size)

    def known_ids(self) -> tuple[int, list[int]]:
        """(one past the largest id the tokenizer has, the ids below it that it lacks).

        A checkpoint's vocabulary is often padded beyond its tokenizer's; those ids have no text.
        """
        ids = set(self.tokenizer.get_vocab(with_added_tokens=True).values())
        end = max(ids) + 1
        return end, sorted(set(range(end)) - ids)

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`, with the tokenizer's own special tokens (e.g. a BOS)."""
        if _SURROGATE.search(text):
            raise ValueError(
                "text contains lone surrogate code points (U+D800..U+DFFF), which are not "
                "Unicode characters and cannot be encoded; remove them or encode with "
                "errors='replace'"
            )
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        """Whole-sequence decode with the same byte semantics as streaming."""
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token on its own (a piece of a multi-byte character shows as U+FFFD)."""
        return self.token_bytes[token_id].decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self.token_bytes)


class StreamDecoder:
    """Turns token ids into text pieces, holding back incomplete UTF-8 characters."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._bytes[token_id])

    def flush(self) -> str:
        """Emits whatever is held back (as U+FFFD if it never became a character)."""
        return self._utf8.decode(b"", final=True)
