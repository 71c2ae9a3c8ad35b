"""Benchmark workloads: real Python prompts with controlled token lengths, seeded.

Every benchmark (in-process engine, served sweep, Locust, baselines) draws from here, so that
all of them run the same prompts with the same max_tokens.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.engine.tokenizer import TextCodec
from batchstring.export.layout import MODEL_VERSION_DIR

SOURCE_FILES = ("argparse.py", "textwrap.py", "json/decoder.py", "csv.py", "dataclasses.py")


@dataclass(frozen=True)
class Item:
    prompt: str
    prompt_tokens: int
    max_tokens: int


def source_tokens(codec: TextCodec) -> list[int]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / name).read_text() for name in SOURCE_FILES)
    return codec.encode(text)


def mixed(count: int, prompt_tokens: tuple[int, int] = (8, 200), max_tokens: tuple[int, int] = (8, 256),
          seed: int = 0, model_dir: Path = MODEL_VERSION_DIR) -> list[Item]:
    """`count` items: prompt lengths and max_tokens drawn uniformly from the given ranges.

    Each prompt is a window of real stdlib source, cut at a token boundary so that its length in
    tokens is exactly the drawn one (re-encoding the decoded text can merge differently, so the
    actual count is re-measured and recorded).
    """
    codec = TextCodec.from_file(model_dir / "tokenizer.json")
    source = source_tokens(codec)
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(count):
        n = int(rng.integers(prompt_tokens[0], prompt_tokens[1] + 1))
        start = int(rng.integers(0, len(source) - n))
        prompt = codec.decode(source[start : start + n])
        items.append(Item(prompt, len(codec.encode(prompt)), int(rng.integers(max_tokens[0], max_tokens[1] + 1))))
    return items


def extraction_schema(i: int) -> dict:
    """Distinct small JSON schemas for structured traffic: field names, enums and bounds vary with i."""
    return {"type": "object", "additionalProperties": False, "required": [f"name_{i}", "kind", "size"],
            "properties": {f"name_{i}": {"type": "string", "maxLength": 12 + i % 7},
                           "kind": {"enum": [f"k{i}", "function", "class"]},
                           "size": {"type": "integer", "minimum": 0, "maximum": 100 + i},
                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}}}
