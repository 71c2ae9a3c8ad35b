"""Weight-only quantization of the exported ONNX step (`batchstring export --quantize int8|int4`).

Decoding on a CPU (and at small batches on a GPU) is bound by reading the weights, so every peer
serves them quantized. ONNX Runtime has the kernel on its CPU and CUDA providers:
`com.microsoft.MatMulNBits`, a matrix multiply whose weight is stored in blocks of `block_size`
values along K, each with its own scale (symmetric: no zero point). Its own quantizer
(`MatMulNBitsQuantizer`, round-to-nearest, no calibration data) rewrites every MatMul whose weight
is a constant; the graph's activations stay in the export's dtype. `accuracy_level` 4 (the
default) lets the CPU kernel multiply int8 activations, quantized per block as it goes, by the
weights: without it ONNX Runtime 1.32's CPU kernel is slower than the float MatMul it replaces
(int8 by far: docs/quantization.md), and the quality it costs is measured with the rest (CUDA's
kernel ignores it). The LM head stays in the export's dtype unless asked (`head`): it is where the
tokens are chosen, and a tied head is the embedding, which is not a MatMul weight.

Quality is measured, not assumed, against the unquantized graph the quantization was made from
(itself verified against the checkpoint when it was exported): perplexity on a held-out text
(export/perplexity.py; a rise past `MAX_PERPLEXITY_RISE` is refused unless forced), the logits of
every position of its first window, and greedy tokens up to the unquantized graph's first
near-tie. `batchstring export --quantize` quantizes the export it has just verified;
`batchstring quantize` an export made before, without tracing the checkpoint again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from batchstring.export.shared_weights import share_weights, weight_bytes

if TYPE_CHECKING:  # the CLI reads this module's constants for --help: nothing heavy at import
    from batchstring.export.perplexity import Perplexity
    from batchstring.export.prequantized import PreQuantized

SCHEMES = {"int8": 8, "int4": 4}
BLOCK_SIZE = 32  # llama.cpp's Q8_0 and Q4_0 blocks; larger ones run the CPU kernel faster (docs/quantization.md)
BLOCK_SIZES = (16, 32, 64, 128)
# Largest perplexity rise (percent) over the unquantized graph on the held-out text that an export
# accepts without --force; llama.cpp's own rise at the same bits is measured beside ours (docs/benchmarks.md).
MAX_PERPLEXITY_RISE = {"int8": 1.0, "int4": 3.0}


@dataclass(frozen=True)
class Quantization:
    """What runtime.json records of a quantized export."""

    scheme: str
    block_size: int = BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = 4  # 4: int8 activations inside the CPU kernel; 0: the export's dtype (slow on the CPU)
    head: bool = False  # the LM head quantized too
    embedding: bool = False  # the embedding as GatherBlockQuantized, 4 bits (the only width the quantizer writes)

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def rounding(self) -> str:
        """The scheme whose perplexity bound applies (MAX_PERPLEXITY_RISE)."""
        return self.scheme

    def rewrite(self, graph: Path, vocab_rows: int) -> int:
        return quantize_graph(graph, self, vocab_rows)

    def record(self) -> dict:
        return {"method": "MatMulNBits (ONNX Runtime, round to nearest)", "bits": self.bits, **asdict(self)}

    def describe(self) -> str:
        extras = [f"blocks of {self.block_size}", "symmetric" if self.symmetric else "with zero points"]
        if self.accuracy_level:
            extras.append(f"accuracy_level {self.accuracy_level}")
        extras.append("head quantized" if self.head else "head in the export's dtype")
        if self.embedding:
            extras.append("embedding int4")
        return f"{self.scheme} ({', '.join(extras)})"


def head_nodes(model, vocab_rows: int) -> list[str]:
    """The MatMul nodes of the LM head: those whose constant weight has the checkpoint's
    vocabulary as its output width."""
    constants = {t.name: t for t in model.graph.initializer}
    return [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in constants
            and len(constants[node.input[1]].dims) == 2 and constants[node.input[1]].dims[1] == vocab_rows]


def untie_head(model, vocab_rows: int) -> int:
    """A head tied to the embedding reads the embedding through a Transpose, which the quantizer
    cannot see through: give each such MatMul its own transposed constant (the embedding's Gather
    keeps the original). Returns how many it untied."""
    from onnx import numpy_helper

    constants = {t.name: t for t in model.graph.initializer}
    made = {n.output[0]: n for n in model.graph.node}
    untied = 0
    for node in [n for n in model.graph.node if n.op_type == "MatMul"]:
        source = made.get(node.input[1])
        if (source is None or source.op_type != "Transpose" or source.input[0] not in constants
                or constants[source.input[0]].dims[:1] != [vocab_rows]):
            continue
        name = f"{source.input[0]}.transposed"
        if name not in constants:
            weight = numpy_helper.to_array(constants[source.input[0]])
            constants[name] = numpy_helper.from_array(weight.T.copy(), name)
            model.graph.initializer.append(constants[name])
        node.input[1] = name
        untied += 1
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    for transpose in [n for n in model.graph.node if n.op_type == "Transpose" and n.output[0] not in used]:
        model.graph.node.remove(transpose)
    return untied


def quantize_graph(path: Path, quantization: Quantization, vocab_rows: int) -> int:
    """Rewrites the ONNX graph at `path` in place; returns how many MatMuls now hold quantized weights."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)  # a line per node it leaves alone
    model = onnx.load(str(path))
    if quantization.head:
        untie_head(model, vocab_rows)
    excluded = [] if quantization.head else head_nodes(model, vocab_rows)
    config = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                          accuracy_level=quantization.accuracy_level or None, bits=quantization.bits)
    quantizer = MatMulNBitsQuantizer(model, bits=quantization.bits, block_size=quantization.block_size,
                                     is_symmetric=quantization.symmetric,
                                     accuracy_level=quantization.accuracy_level or None,
                                     nodes_to_exclude=excluded, algo_config=config)
    quantizer.process()
    quantized = quantizer.model.model
    if quantization.embedding:
        quantized = _quantize_embedding(quantized, quantization, vocab_rows)
    save_graph(quantized, path)
    return sum(1 for node in quantized.graph.node if node.op_type == "MatMulNBits")


def save_graph(model, path: Path) -> None:
    """A rewritten graph in place of the one it was read from, its weights inside it unless
    protobuf's 2 GB limit forces them into a file beside it (as artifacts.write_onnx)."""
    import onnx

    for stale in path.parent.glob(f"{path.name}.data"):
        stale.unlink()
    large = model.ByteSize() > 1_800_000_000
    onnx.save_model(model, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
                    location=f"{path.name}.data")


def _quantize_embedding(model, quantization: Quantization, vocab_rows: int):
    """The embedding's Gather as GatherBlockQuantized (4 bits, blocks along the hidden size): a
    second pass, since ONNX Runtime's quantizer writes Gather at 4 bits only, and limited to the
    Gathers that read a [vocab, hidden] constant, so no other table is rounded."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    constants = {t.name: t for t in model.graph.initializer}
    embeddings = [n.name for n in model.graph.node if n.op_type == "Gather" and n.input[0] in constants
                  and list(constants[n.input[0]].dims[:1]) == [vocab_rows]]
    axes = (("Gather", 1),)
    config = DefaultWeightOnlyQuantConfig(block_size=quantization.block_size, is_symmetric=quantization.symmetric,
                                          bits=4, op_types_to_quantize=("Gather",), quant_axes=axes)
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=quantization.block_size,
                                     is_symmetric=quantization.symmetric, nodes_to_include=embeddings,
                                     op_types_to_quantize=("Gather",), quant_axes=axes, algo_config=config)
    quantizer.process()
    return quantizer.model.model


@dataclass(frozen=True)
class Measured:
    """What a quantization cost, against the graph it was made from."""

    before: Perplexity
    after: Perplexity
    logits_error: float  # max |Δlogits| over the first window's positions
    greedy_same: int  # prompts whose greedy tokens agree up to the first near-tie
    prompts: int
    bytes_before: int
    bytes_after: int
    quantized: int  # MatMuls now MatMulNBits (in model.onnx)

    @property
    def rise(self) -> float:
        """Perplexity rise, percent."""
        return 100 * (self.after.value / self.before.value - 1)

    def describe(self) -> str:
        return (f"{self.quantized} matrix multiplies quantized; ONNX graphs on disk {self.bytes_before / 2**20:.1f} -> "
                f"{self.bytes_after / 2**20:.1f} MiB ({self.bytes_after / self.bytes_before:.2f}x); perplexity on "
                f"{self.after.tokens} held-out tokens {self.before.value:.3f} -> {self.after.value:.3f} "
                f"({self.rise:+.2f}%); logits within {self.logits_error:.2e} of the unquantized graph; greedy "
                f"identical to it for {self.greedy_same}/{self.prompts} prompts (up to its first near-tie)")


def quantize_export(directory: Path, quantization: Quantization | PreQuantized, text: str, bound: float,
                    force: bool = False) -> Measured:
    """Quantizes the unquantized export in `directory` in place and measures it against itself
    before (module docstring); raises QuantizationRefused past `bound` percent unless `force`,
    leaving the directory for the caller to discard. The TorchScript step is removed: it would
    serve the unquantized weights. A checkpoint published quantized (export/prequantized.py) is
    repacked and measured the same way."""
    import numpy as np
    from tqdm import tqdm

    from batchstring.engine.runner import RuntimeSpec
    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import onnx_step
    from batchstring.export.layout import SMALL_STEP_GRAPH
    from batchstring.export.perplexity import DEFAULT_CONTEXT, DEFAULT_TOKENS, perplexity, window_logits, windows
    from batchstring.export.verify import GREEDY_PROMPTS, GREEDY_TOKENS, greedy_with_step, step_greedy_reference

    spec = RuntimeSpec.load(directory / "runtime.json")
    codec = TextCodec.from_file(directory / "tokenizer.json")
    kv_shape = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    graphs = [directory / name for name in ("model.onnx", SMALL_STEP_GRAPH) if (directory / name).exists()]
    ids = codec.encode(text)
    first = windows(ids, DEFAULT_CONTEXT)[0]
    eos = list(spec.eos_token_ids)

    def progress(what: str):
        return lambda chunks: tqdm(chunks, desc=f"perplexity, {what}", unit="window", leave=False)

    def measure(run):
        greedy = [step_greedy_reference(run, codec.encode(p), GREEDY_TOKENS, kv_shape, eos, np.float32)
                  for p in GREEDY_PROMPTS]
        score = perplexity(run, ids, kv_shape, limit=DEFAULT_TOKENS, progress=progress("unquantized"))
        return score, window_logits(run, first, kv_shape), greedy

    before, reference_logits, references = measure(onnx_step(graphs[0], spec.dtype))
    bytes_before = weight_bytes(directory)
    raw = json.loads((directory / "runtime.json").read_text())
    # The small-step graph first: it may read its weights from model.onnx.data (export/shared_weights.py),
    # which quantizing model.onnx rewrites
    counts = [quantization.rewrite(g, raw.get("checkpoint_vocab_size", spec.vocab_size))
              for g in reversed(graphs)][::-1]
    share_weights(directory)
    (directory / "model.pt").unlink(missing_ok=True)
    quantized = onnx_step(graphs[0], spec.dtype)
    after = perplexity(quantized, ids, kv_shape, limit=DEFAULT_TOKENS, progress=progress(quantization.scheme))
    same = sum(ref.agrees(greedy_with_step(quantized, ref.prompt_ids, len(ref.tokens), kv_shape, eos, np.float32))
               for ref in references)
    error = float(np.abs(window_logits(quantized, first, kv_shape) - reference_logits).max())
    measured = Measured(before, after, error, same, len(references), bytes_before, weight_bytes(directory),
                        counts[0])
    raw["quantization"] = {**quantization.record(), "perplexity_rise_percent": round(measured.rise, 4)}
    (directory / "runtime.json").write_text(json.dumps(raw, indent=2) + "\n")
    if measured.rise > bound and not force:
        raise QuantizationRefused(
            f"{quantization.scheme} raises perplexity on the held-out text by {measured.rise:.2f}%, past the "
            f"{bound:g}% an export accepts ({measured.describe()}): keep more precision (--quantize int8, or an "
            "unquantized export), or pass --force to keep it; nothing was written to the model repository")
    return measured


class QuantizationRefused(RuntimeError):
    """A quantization costs more quality than its bound allows."""


