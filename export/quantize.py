"""Weight-only quantization of the exported ONNX step (`batchstring export --quantize int8|int4`).

Decoding on a CPU (and at small batches on a GPU) is bound by reading the weights, so every peer
serves them quantized. ONNX Runtime has the kernel on its CPU and CUDA providers:
`com.microsoft.MatMulNBits`, a matrix multiply whose weight is stored in blocks of `block_size`
values along K, each with its own scale (symmetric: no zero point). Its own quantizer
(`MatMulNBitsQuantizer`, round-to-nearest, no calibration data) rewrites every MatMul whose weight
is a constant; activations stay in the export's dtype. `accuracy_level` 4 lets the CPU kernel
quantize the activations to int8 as well (faster at one row, sometimes a flipped near-tie: the
export measures it). The LM head stays in the export's dtype unless asked (`head`): it is where
the tokens are chosen, and a tied head is the embedding, which is not a MatMul weight.

Quality is measured, not assumed: the export compares the quantized graph's perplexity on a
held-out text with the unquantized graph's (export/perplexity.py) and refuses a rise past
`MAX_PERPLEXITY_RISE` unless forced.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMES = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32
# Largest perplexity rise (percent) over the unquantized graph on the held-out text that an export
# accepts without --force. llama.cpp on the shipped model: Q8_0 +0.04%, Q4_0 +0.19% (docs/).
MAX_PERPLEXITY_RISE = {"int8": 1.0, "int4": 3.0}


@dataclass(frozen=True)
class Quantization:
    """What runtime.json records of a quantized export."""

    scheme: str
    block_size: int = BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = 0  # 0: the kernel's default (activations in the export's dtype); 4: int8
    head: bool = False  # the LM head quantized too

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    def record(self) -> dict:
        return {"method": "MatMulNBits (ONNX Runtime, round to nearest)", "bits": self.bits, **asdict(self)}

    def describe(self) -> str:
        extras = [f"blocks of {self.block_size}", "symmetric" if self.symmetric else "with zero points"]
        if self.accuracy_level:
            extras.append(f"accuracy_level {self.accuracy_level}")
        extras.append("head quantized" if self.head else "head in the export's dtype")
        return f"{self.scheme} ({', '.join(extras)})"


def head_nodes(model, vocab_rows: int) -> list[str]:
    """The MatMul nodes of the LM head: those whose constant weight has the checkpoint's
    vocabulary as its output width."""
    constants = {t.name: t for t in model.graph.initializer}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in constants
            and len(constants[node.input[1]].dims) == 2 and constants[node.input[1]].dims[1] == vocab_rows]


def quantize_graph(path: Path, quantization: Quantization, vocab_rows: int) -> int:
    """Rewrites the ONNX graph at `path` in place; returns how many MatMuls now hold quantized weights."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # a line per node it leaves alone
    model = onnx.load(str(path))
    excluded = [] if quantization.head else head_nodes(model, vocab_rows)
    config = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                          accuracy_level=quantization.accuracy_level or None, bits=quantization.bits)
    quantizer = MatMulNBitsQuantizer(model, bits=quantization.bits, block_size=quantization.block_size,
                                     is_symmetric=quantization.symmetric,
                                     accuracy_level=quantization.accuracy_level or None,
                                     nodes_to_exclude=excluded, algo_config=config)
    quantizer.process()
    quantized = quantizer.model.model
    for stale in path.parent.glob(f"{path.name}.data"):
        stale.unlink()
    large = quantized.ByteSize() > 1_800_000_000  # protobuf's 2 GB limit, as artifacts.write_onnx
    onnx.save_model(quantized, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data")
    return sum(1 for node in quantized.graph.node if node.op_type == "MatMulNBits")
