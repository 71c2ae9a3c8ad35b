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

INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "past_slots", "key_cache", "value_cache")
OUTPUT_NAMES = ("logits", "new_keys", "new_values")


def example_inputs(step: DecoderStep, batch: int = 2, seq: int = 3, past: int = 5,
                   slots: int = 7) -> tuple[torch.Tensor, ...]:
    """Shapes with every dynamic axis distinct and > 1, so the exporter cannot specialise them."""
    cache = torch.zeros(len(step.layers), step.num_kv_heads, slots, step.head_dim)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    past_slots = torch.arange(batch * past).reshape(batch, past) % slots
    return ids, ids.clone(), torch.ones(batch, past + seq, dtype=torch.bool), past_slots, cache, cache.clone()


@contextlib.contextmanager
def quiet():
    """The exporters print pages of progress and deprecation notes; keep the user's screen readable."""
    logging.getLogger("torch").setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def write_onnx(step: DecoderStep, path: Path) -> None:
    batch, seq, past, total, slots = Dim("batch"), Dim("seq"), Dim("past"), Dim("total"), Dim("cache_slots")
    dynamic = {
        "input_ids": {0: batch, 1: seq},
        "position_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "past_slots": {0: batch, 1: past},
        "key_cache": {2: slots},
        "value_cache": {2: slots},
    }
    with quiet():
        torch.onnx.export(
            step,
            example_inputs(step),
            str(path),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_shapes=dynamic,
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
        "vocab_size": int(step.lm_head.out_features),
        "context_length": int(hf_config.max_position_embeddings),
        "eos_token_ids": tokenizer_eos,
        "dtype": "float32",
        "inputs": list(INPUT_NAMES),
        "outputs": list(OUTPUT_NAMES),
    }


def write_runtime_spec(spec: dict, path: Path) -> None:
    path.write_text(json.dumps(spec, indent=2) + "\n")
