"""Perplexity of an exported step on a text: the measure of what a quantization costs.

The text is cut into windows of `context` tokens, each run as one prefill row from an empty cache
with every position's next-token logits fetched (the step's `logit_tokens` names them all), and
only the second half of each window is scored, so every scored token has at least context / 2
tokens before it. That is llama.cpp's `llama-perplexity -c N` convention, so the two tools' ratios
on the same weights and text compare.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchstring.export.verify import Row, StepFn, pack

DEFAULT_CONTEXT = 256
DEFAULT_TOKENS = 4096  # tokens of the held-out text an export scores (16 windows of 256)


@dataclass(frozen=True)
class Perplexity:
    value: float
    tokens: int  # tokens scored
    windows: int


def windows(ids: list[int], context: int, limit: int | None = None) -> list[list[int]]:
    """Whole windows of `context` tokens from the start of `ids`, at most `limit` tokens in all."""
    ids = ids[:limit] if limit else ids
    count = len(ids) // context
    if count == 0:
        raise ValueError(f"the text is {len(ids)} tokens long; perplexity needs at least one window of {context} "
                         "tokens: a longer text, or a smaller context")
    return [ids[i * context : (i + 1) * context] for i in range(count)]


def perplexity(run: StepFn, ids: list[int], kv_shape: tuple[int, int, int], dtype: np.dtype = np.float32,
               context: int = DEFAULT_CONTEXT, limit: int | None = None, block_size: int = 16,
               progress: Callable[[Iterator], Iterator] = iter) -> Perplexity:
    """exp(mean negative log-likelihood) of the second half of every window (module docstring)."""
    nll, scored = 0.0, 0
    chunks = windows(ids, context, limit)
    for window in progress(chunks):
        logits = window_logits(run, window, kv_shape, dtype, block_size).astype(np.float64)
        first = context // 2 - 1  # position whose logits predict the first scored token
        rows = logits[first:]
        targets = np.asarray(window[first + 1 :])
        top = rows.max(axis=1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        nll += float((log_z - rows[np.arange(len(targets)), targets]).sum())
        scored += len(targets)
    return Perplexity(float(np.exp(nll / scored)), scored, len(chunks))


def window_logits(run: StepFn, window: list[int], kv_shape: tuple[int, int, int], dtype: np.dtype = np.float32,
                  block_size: int = 16) -> np.ndarray:
    """The logits after every position of `window` but its last, as one prefill row from an empty cache."""
    layers, heads, head_dim = kv_shape
    blocks = -(-len(window) // block_size)
    cache = np.zeros((layers, heads, blocks, block_size, head_dim), dtype)
    inputs, held = pack([Row(window, list(range(blocks)), 0)], cache, cache.copy())
    return run(inputs.replace(logit_tokens=np.arange(len(window) - 1)), held)[4]


def measure_export(model_dir: Path, text: str, runtime: str = "onnxruntime", context: int = DEFAULT_CONTEXT,
                   limit: int | None = None) -> Perplexity:
    """An export directory's perplexity on `text`, on the CPU, with a progress bar."""
    from tqdm import tqdm

    from batchstring.engine.runner import RuntimeSpec
    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import onnx_step, torchscript_step

    spec = RuntimeSpec.load(model_dir / "runtime.json")
    graph = model_dir / ("model.pt" if runtime == "torchscript" else "model.onnx")
    if not graph.is_file():
        raise ValueError(f"{model_dir} has no {graph.name}; measure it with the other --runtime")
    if runtime == "torchscript":
        import torch

        run = torchscript_step(graph, getattr(torch, spec.dtype), spec.adapter_sites)
    else:
        run = onnx_step(graph, spec.dtype)
    ids = TextCodec.from_file(model_dir / "tokenizer.json").encode(text)
    return perplexity(run, ids, (spec.num_layers, spec.num_kv_heads, spec.head_dim), context=context, limit=limit,
                      progress=lambda chunks: tqdm(chunks, desc="perplexity", unit="window"))
