"""Writes the decoder step as ONNX and as TorchScript, and the runtime description beside them."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import torch
from torch.export import Dim

from export.step import DecoderStep

INPUT_NAMES = (
    "input_ids", "position_ids",
    "decode_tokens", "decode_slots", "decode_mask",
    "prefill_tokens", "prefill_slots", "prefill_mask", "token_order",
    "logit_tokens", "ban_eos", "sample_rows", "temperature", "top_k", "top_p", "uniform",
    "key_cache", "value_cache",
)
OUTPUT_NAMES = ("next_tokens", "token_logprobs", "top_ids", "top_logprobs", "logits", "new_keys", "new_values")


def example_inputs(step: DecoderStep, slots: int = 23) -> tuple[torch.Tensor, ...]:
    """A step whose every dynamic axis has its own size > 1, so the exporter cannot specialise or
    merge them: 2 decode rows over 7 past tokens; 3 prefill rows of 6, 3 and 1 new tokens (padded to
    6) over 9 past; 12 tokens in all; 5 rows want a next token, 4 of them sample."""
    cache = torch.zeros(len(step.layers), step.num_kv_heads, slots, step.head_dim, dtype=step.dtype)
    prefill = torch.tensor([[2, 3, 4, 5, 6, 7], [0, 0, 0, 8, 9, 10], [0, 0, 0, 0, 0, 11]])
    order = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 19])
    return (
        torch.arange(12) % 5, torch.arange(12),
        torch.tensor([[0], [1]]), torch.arange(14).reshape(2, 7), torch.ones(2, 8, dtype=torch.bool),
        prefill, torch.arange(27).reshape(3, 9) % slots, torch.ones(3, 15, dtype=torch.bool), order,
        torch.tensor([0, 1, 7, 10, 11]), torch.tensor([False, True, False, True, False]), torch.tensor([0, 1, 3, 4]),
        torch.tensor([0.5, 1.0, 0.0, 2.0]), torch.tensor([0, 3, 0, 1]), torch.tensor([1.0, 0.9, 1.0, 0.5]),
        torch.tensor([0.3, 0.7, 1.0, 0.1]),
        cache, cache.clone(),
    )


def dynamic_shapes() -> dict[str, dict[int, Dim]]:
    tokens, rows, sampled, slots = Dim("tokens"), Dim("rows"), Dim("sampled_rows"), Dim("cache_slots")
    decode, decode_past = Dim("decode_rows"), Dim("decode_past")
    prefill, prefill_new, prefill_past = Dim("prefill_rows"), Dim("prefill_new"), Dim("prefill_past")
    prefill_keys = Dim("prefill_keys")  # = prefill_past + prefill_new (Dim algebra cannot say so)
    return {
        "input_ids": {0: tokens}, "position_ids": {0: tokens},
        "decode_tokens": {0: decode}, "decode_slots": {0: decode, 1: decode_past},
        "decode_mask": {0: decode, 1: decode_past + 1},
        "prefill_tokens": {0: prefill, 1: prefill_new}, "prefill_slots": {0: prefill, 1: prefill_past},
        "prefill_mask": {0: prefill, 1: prefill_keys}, "token_order": {0: tokens},
        "logit_tokens": {0: rows}, "ban_eos": {0: rows},
        "sample_rows": {0: sampled}, "temperature": {0: sampled}, "top_k": {0: sampled}, "top_p": {0: sampled},
        "uniform": {0: sampled},
        "key_cache": {2: slots}, "value_cache": {2: slots},
    }


@contextlib.contextmanager
def quiet():
    """The exporters print pages of progress and deprecation notes; keep the user's screen readable."""
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def write_onnx(step: DecoderStep, path: Path) -> None:
    with quiet():
        torch.onnx.export(
            step,
            example_inputs(step),
            str(path),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_shapes=dynamic_shapes(),
            # One self-contained file unless protobuf's 2 GB limit forces weights out of it.
            external_data=sum(t.numel() * t.element_size() for t in step.state_dict().values()) > 1_800_000_000,
            verbose=False,
        )


def write_torchscript(step: DecoderStep, path: Path) -> None:
    """Traced rather than scripted: the step has no data-dependent control flow.

    torch 2.13 marks `torch.jit.trace` deprecated, but TorchScript is still what Triton 24.10's
    PyTorch backend and `torch.jit.load` consume, so it stays until a successor is loadable there.
    """
    with quiet(), torch.no_grad():
        traced = torch.jit.trace(step, example_inputs(step), check_trace=False)
        torch.jit.save(traced, str(path))


def runtime_spec(step: DecoderStep, hf_config, tokenizer_eos: list[int], source: str) -> dict:
    """What the engine needs to size its cache and stop generation, without loading torch."""
    return {
        "source": source,
        "model_type": hf_config.model_type,
        "num_layers": len(step.layers),
        "num_heads": step.num_heads,
        "num_kv_heads": step.num_kv_heads,
        "head_dim": step.head_dim,
        "vocab_size": step.vocab_size,  # ids the step can produce: the tokenizer's (padding cut off)
        "checkpoint_vocab_size": int(step.lm_head.out_features),
        "context_length": int(hf_config.max_position_embeddings),
        "eos_token_ids": tokenizer_eos,
        "dtype": "float32",
        "inputs": list(INPUT_NAMES),
        "outputs": list(OUTPUT_NAMES),
    }


def write_runtime_spec(spec: dict, path: Path) -> None:
    path.write_text(json.dumps(spec, indent=2) + "\n")
