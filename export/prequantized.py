"""Checkpoints published already quantized (GPTQ, AWQ), served as the integers they hold.

Such a checkpoint stores each linear layer's weight as `bits`-bit integers in groups of
`group_size` input rows, each group with a scale and a zero point per output column (`qweight`,
`qzeros`, `scales`, and for GPTQ `g_idx`, each input row's group), named in config.json's
`quantization_config`. Rounding those weights again would lose what the publisher's calibration
chose, so the export keeps the integers:

1. the checkpoint is loaded with every such weight dequantized exactly, (q - zero) x scale in
   float32 (a 4- or 8-bit integer times a float16 scale is exact there; a float16 export rounds
   that product once, as the publishers' own float16 kernels do), and exported and verified like
   any checkpoint;
2. each graph MatMul whose constant is one of those dequantized weights (found by its bytes) is
   rewritten to ONNX Runtime's `MatMulNBits` holding the same integers, zero points and scales
   (in the export's dtype: the kernel's activations and scales share it), repacked from the
   checkpoint's layout to the kernel's (`repack`), so the kernel's own dequantization,
   (code - zero_point) x scale, gives the same weights bit for bit;
3. the result is measured against the graph of step 1 (export/quantize.py `quantize_export`):
   what differs is only the kernel's arithmetic (`accuracy_level` 4 multiplies int8 activations).

Layouts (documented by AutoGPTQ and AutoAWQ, read by transformers):
- GPTQ: `qweight` int32 [K / (32 / bits), N], 32 / bits values per int32 along K, low bits first;
  `qzeros` int32 [G, N / (32 / bits)] packed along N the same way, stored minus one unless
  `checkpoint_format` is "gptq_v2"; `scales` float16 [G, N]; `g_idx` int32 [K]. With act-order
  (`desc_act`) a group's rows are scattered over K, while MatMulNBits' blocks are contiguous: the
  rows are sorted by group and the activations' K gathered in the same order before the kernel
  (x[:, p] @ W[p, :] = x @ W, exactly).
- AWQ (`version` "gemm"): `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], 8 values per
  int32 along N, in the interleaved order AWQ_ORDER; `scales` float16 [G, N]; 4 bits only.
- Either: `group_size` -1 is one group over all of K (G = 1); a layer's `bias` is an ordinary
  float tensor beside its integers (AutoGPTQ writes zeros there for layers that have none).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_ORDER[i] of its eight
GPTQ_FORMATS = ("gptq", "gptq_v2")  # zero points stored minus one (v1), or as they are
MAX_BLOCK = 128  # the largest block a per-column checkpoint is repacked in (batchstring quantize's largest too)


@dataclass(frozen=True)
class Packed:
    """One linear layer's integers in one layout: codes [K, N], zero points and scales [G, N]
    (float32, exact from float16), and each input row's group [K]."""

    codes: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    groups: np.ndarray

    @property
    def order(self) -> np.ndarray | None:
        """The rows sorted by group, where act-order scattered them (None: already in order)."""
        if np.all(self.groups[1:] >= self.groups[:-1]):
            return None
        return np.argsort(self.groups, kind="stable")

    def weight(self) -> np.ndarray:
        """The float32 weight, [N, K] (torch's Linear layout): (code - zero) x scale, exactly."""
        levels = self.codes.astype(np.float32) - self.zeros[self.groups].astype(np.float32)
        return np.ascontiguousarray((levels * self.scales[self.groups]).T)


@dataclass(frozen=True)
class PreQuantized:
    """A checkpoint's quantization, as export/quantize.py's `quantize_export` rewrites and records it."""

    method: str
    bits: int
    group_size: int  # MatMulNBits' block: the checkpoint's group, or for one group per column see `per_column`
    layers: dict[str, Packed]  # by module name (model.layers.0.self_attn.q_proj)
    accuracy_level: int = 4
    per_column: bool = False  # group_size -1 in the checkpoint: one zero point and scale per column

    @property
    def scheme(self) -> str:
        return f"{self.method}-int{self.bits}"

    @property
    def rounding(self) -> str:
        """The scheme of round-to-nearest quantization with the same bits (its perplexity bound)."""
        return f"int{self.bits}"

    def record(self) -> dict:
        return {"method": f"{self.method.upper()} checkpoint repacked to MatMulNBits", "scheme": self.scheme,
                "bits": self.bits, "block_size": self.group_size, "accuracy_level": self.accuracy_level,
                "checkpoint_group_size": -1 if self.per_column else self.group_size}

    def describe(self) -> str:
        groups = f"one group per column, in blocks of {self.group_size}" if self.per_column \
            else f"groups of {self.group_size}"
        return f"{self.scheme} (the checkpoint's own integers, {groups}, accuracy_level {self.accuracy_level})"

    def rewrite(self, graph: Path, vocab_rows: int) -> int:
        return repack(graph, self)


def read(checkpoint: Path) -> PreQuantized | None:
    """The checkpoint's quantization, or None for a float checkpoint; ValueError naming what is
    not supported."""
    spec = _spec(checkpoint)
    if not spec:
        return None
    method, bits, group = spec.get("quant_method"), int(spec.get("bits", 0)), int(spec.get("group_size", 0))
    _check(spec, method, bits, group)
    tensors = _tensors(checkpoint)
    names = [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]
    if not names:
        raise ValueError(f"{checkpoint} names {method} quantization but holds no .qweight tensors")
    if any(".experts." in name for name in names):
        raise ValueError(f"published {method} mixtures of experts are not supported (the step stacks each layer's "
                         "experts); export the float checkpoint with --quantize int8|int4")
    unpack = _gptq if method == "gptq" else _awq
    layers = {name: unpack(tensors, name, bits, group, spec) for name in names}
    if group == -1:
        return PreQuantized(method, bits, *_in_blocks(layers), per_column=True)
    return PreQuantized(method, bits, group, layers)


def _spec(checkpoint: Path) -> dict | None:
    """config.json's quantization_config; else an older AutoGPTQ upload's quantize_config.json (GPTQ
    by definition). A checkpoint holding quantized tensors with neither is refused: read as a
    float one, its quantized layers would load as random weights."""
    spec = json.loads((checkpoint / "config.json").read_text()).get("quantization_config")
    if not spec and (checkpoint / "quantize_config.json").is_file():
        spec = {"quant_method": "gptq", **json.loads((checkpoint / "quantize_config.json").read_text())}
    if spec:
        return spec
    if any(name.endswith(".qweight") for name in _names(checkpoint)):
        raise ValueError(f"{checkpoint} holds quantized layers (.qweight) but no quantization_config in config.json "
                         "(nor quantize_config.json) says how they were quantized; add the one its publisher "
                         "documents")
    return None


def _check(spec: dict, method: str, bits: int, group: int) -> None:
    """ValueError naming what the checkpoint's quantization_config asks for that is not read here:
    every option that changes what the integers mean is either handled or refused by name."""
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; GPTQ and AWQ checkpoints "
                         "are (or export the float checkpoint with --quantize int8|int4)")
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise ValueError(f"{method} with {bits} bits is not supported; {'4 or 8' if method == 'gptq' else '4'} are")
    if group != -1 and (group < 16 or group & (group - 1)):
        raise ValueError(f"quantization_config.group_size {group} is not supported: MatMulNBits takes blocks of a "
                         "power of two of at least 16 along K (or -1, one group per column)")
    if method == "awq" and str(spec.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {spec.get('version')!r} is not supported; the GEMM layout is")
    if method == "gptq" and spec.get("checkpoint_format", "gptq") not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ checkpoint_format {spec['checkpoint_format']!r} is not supported; "
                         f"{' and '.join(GPTQ_FORMATS)} are")
    if str(spec.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise ValueError(f"pack_dtype {spec['pack_dtype']!r} is not supported; integers packed in int32 are")
    for option, why in (("dynamic", "bits or group sizes that differ per layer"),
                        ("rotation", "a rotation the activations need before the quantized matrix multiply")):
        if spec.get(option):
            raise ValueError(f"quantization_config.{option} ({why}) is not supported")


def _in_blocks(layers: dict[str, Packed]) -> tuple[int, dict[str, Packed]]:
    """One group per column (group_size -1, common for 8 bits) as MatMulNBits blocks: the largest
    power of two up to MAX_BLOCK that divides every layer's K, each column's one zero point and
    scale repeated in each of its blocks, so the kernel's weights are the checkpoint's exactly."""
    rows = math.gcd(*(packed.codes.shape[0] for packed in layers.values()))
    block = min(rows & -rows, MAX_BLOCK)
    if block < 16:
        raise ValueError(f"one group per column (group_size -1) needs every layer's input size to be a multiple "
                         f"of 16 (MatMulNBits' smallest block); their common divisor is {rows}")
    return block, {name: Packed(packed.codes, *(np.repeat(part, packed.codes.shape[0] // block, axis=0)
                                                for part in (packed.zeros, packed.scales)),
                                _in_order(packed.codes.shape[0], block))
                   for name, packed in layers.items()}


def load_dequantized(checkpoint: Path, pre: PreQuantized, dtype: str = "float32"):
    """The checkpoint as a Hugging Face model in `dtype`, every quantized weight dequantized exactly
    in float32 first (one rounding to a 16-bit dtype after)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from batchstring.export.step import check_supported

    config = AutoConfig.from_pretrained(checkpoint)
    config.__dict__.pop("quantization_config", None)  # absent where quantize_config.json named it
    check_supported(config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = {name: torch.from_numpy(np.asarray(value, np.float32) if value.dtype == np.float16 else value)
             for name, value in _tensors(checkpoint).items() if not _quantized_part(name, pre)}
    state.update({f"{name}.weight": torch.from_numpy(packed.weight()) for name, packed in pre.layers.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    # AutoGPTQ writes a bias for every quantized layer, zeros where the model has none (Llama's)
    unexpected = [name for name in unexpected if not (
        name.endswith(".bias") and name.removesuffix(".bias") in pre.layers and not state[name].any())]
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{checkpoint}: tensors the model does not have {sorted(unexpected)[:4]}, "
                         f"weights missing {sorted(set(missing) - tied)[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if (checkpoint / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    return model.to(getattr(torch, dtype)).eval()


def _quantized_part(name: str, pre: PreQuantized) -> bool:
    module, _, part = name.rpartition(".")
    return module in pre.layers and part in ("qweight", "qzeros", "scales", "g_idx")


def _files(checkpoint: Path) -> list[Path]:
    """The weights' files: the shards its index lists (a repository may hold other copies beside
    them, as Mistral's consolidated.safetensors), else every .safetensors file."""
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        return [checkpoint / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{checkpoint} has no .safetensors weights")
    return files


def _names(checkpoint: Path) -> list[str]:
    """The tensors' names, from the files' headers alone (no weights read)."""
    from safetensors import safe_open

    names = []
    for path in sorted(checkpoint.glob("*.safetensors")):  # every file: quantized tensors anywhere are refused
        with safe_open(path, framework="pt") as file:
            names += list(file.keys())
    return names


def _tensors(checkpoint: Path) -> dict[str, np.ndarray]:
    """Every tensor as numpy; bfloat16 ones (scales, norms of a bfloat16 model) widened to float32,
    exactly (numpy has no bfloat16)."""
    import torch
    from safetensors.torch import load_file

    return {name: (value.float() if value.dtype == torch.bfloat16 else value).numpy()
            for path in _files(checkpoint) for name, value in load_file(path).items()}


def _unpack(packed: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 values holding 32 / bits codes each, low bits first, spread along `axis` (0: rows,
    1: columns; `order`: the column each position holds)."""
    if packed.dtype != np.int32:
        raise ValueError(f"packed integers of {packed.dtype} are not supported; int32 words (pack_dtype int32) are")
    per, mask = 32 // bits, (1 << bits) - 1
    words = packed.view(np.uint32)
    codes = (words[..., None] >> (np.arange(per, dtype=np.uint32) * bits)) & mask  # [R, C, per]
    if order is not None:
        codes = codes[..., np.argsort(order)]
    if axis == 0:
        codes = codes.transpose(0, 2, 1)  # [R, per, C]: the per codes of a word are consecutive rows
        return codes.reshape(-1, packed.shape[1]).astype(np.uint8)
    return codes.reshape(packed.shape[0], -1).astype(np.uint8)


def _part(tensors: dict, name: str, part: str) -> np.ndarray:
    """A quantized layer's tensor; ValueError naming it where the checkpoint lacks it (incomplete)."""
    if f"{name}.{part}" not in tensors:
        raise ValueError(f"{name} has a .qweight but no .{part}: the checkpoint is incomplete")
    return tensors[f"{name}.{part}"]


def _gptq(tensors: dict, name: str, bits: int, group: int, spec: dict) -> Packed:
    codes = _unpack(_part(tensors, name, "qweight"), bits, axis=0)
    stored = _part(tensors, name, "qzeros")
    zeros = _unpack(stored, bits, axis=1) if spec.get("checkpoint_format", "gptq") == "gptq_v2" else \
        _v1_zeros(stored, bits, spec)
    contiguous = _in_order(codes.shape[0], group)
    groups = np.asarray(tensors.get(f"{name}.g_idx", contiguous), np.int64)
    if not np.array_equal(np.sort(groups), contiguous):
        raise ValueError(f"{name}: g_idx does not give each group {group} rows (group_size), so its groups cannot "
                         "become MatMulNBits blocks")
    return Packed(codes, zeros, _part(tensors, name, "scales").astype(np.float32), groups)


def _v1_zeros(stored: np.ndarray, bits: int, spec: dict) -> np.ndarray:
    """GPTQ v1 zero points, stored minus one. A zero point of 0 is stored as -1, which the writers
    pack differently: GPTQModel subtracts one from every field of a word at once, borrowing from
    the next field, and its readers undo it by the inverse addition (done here where its
    meta.quantizer names it); AutoGPTQ ORs the sign-extended -1 into the word, overwriting every
    field above it, whose values are then lost: refused (its kernels and GPTQModel's read such a
    word differently)."""
    if "gptqmodel" in json.dumps(spec.get("meta") or {}).lower():
        ones = sum(1 << shift for shift in range(0, 32, bits))  # 0x11111111 for 4 bits, 0x01010101 for 8
        return _unpack((stored.view(np.uint32) + np.uint32(ones)).view(np.int32), bits, axis=1)
    fields = _unpack(stored, bits, axis=1)
    if (fields == (1 << bits) - 1).any():
        raise ValueError(f"a GPTQ v1 zero point of 0 (stored as -1: {int((fields == (1 << bits) - 1).sum())} fields "
                         "of all ones), which AutoGPTQ's packing spreads over the zero points above it in the same "
                         "int32, so they cannot be read back; a checkpoint saved as gptq_v2 keeps them")
    return fields + np.uint8(1)


def _awq(tensors: dict, name: str, bits: int, group: int, spec: dict) -> Packed:
    codes = _unpack(_part(tensors, name, "qweight"), bits, axis=1, order=AWQ_ORDER)
    zeros = _unpack(_part(tensors, name, "qzeros"), bits, axis=1, order=AWQ_ORDER)
    return Packed(codes, zeros, _part(tensors, name, "scales").astype(np.float32), _in_order(codes.shape[0], group))


def _in_order(rows: int, group: int) -> np.ndarray:
    """Each input row's group where groups of `group` rows follow each other (-1: one group)."""
    return np.arange(rows) // (group if group > 0 else rows)


def repack(graph: Path, pre: PreQuantized) -> int:
    """Rewrites every MatMul of the graph at `graph` whose constant is made of the checkpoint's
    dequantized weights to MatMulNBits over the same integers; returns how many. A constant is a
    layer's weight transposed ([K, N]) or several side by side (the step fuses q/k/v and gate/up
    into one projection, export/step.py), found column block by column block."""
    import onnx
    from onnx import helper, numpy_helper

    from batchstring.export.quantize import save_graph

    model = onnx.load(str(graph))
    find = _Layers(pre)
    constants = {t.name: t for t in model.graph.initializer}
    nodes, replaced = [], 0
    for node in model.graph.node:
        constant = constants.get(node.input[1]) if node.op_type == "MatMul" else None
        weight = numpy_helper.to_array(constant) if constant is not None else None
        packed = find.made_of(weight) if weight is not None else None
        if packed is None:
            nodes.append(node)
            continue
        blob, scales, zeros = matmul_nbits(packed, pre.bits, pre.group_size, weight.dtype)
        stem = f"{node.input[1]}.{pre.scheme}"
        model.graph.initializer.extend([numpy_helper.from_array(blob, f"{stem}.blob"),
                                        numpy_helper.from_array(scales, f"{stem}.scales"),
                                        numpy_helper.from_array(zeros, f"{stem}.zeros")])
        activations, gather = node.input[0], []
        if packed.order is not None:  # act-order: K gathered in the rows' sorted order
            model.graph.initializer.append(numpy_helper.from_array(packed.order, f"{stem}.order"))
            activations = f"{stem}.gathered"
            gather = [helper.make_node("Gather", [node.input[0], f"{stem}.order"], [activations],
                                       name=f"{node.name}.{pre.scheme}.order", axis=-1)]
        rows, columns = packed.codes.shape
        nodes += [*gather, helper.make_node(
            "MatMulNBits", [activations, f"{stem}.blob", f"{stem}.scales", f"{stem}.zeros"], list(node.output),
            name=f"{node.name}.{pre.scheme}", domain="com.microsoft", K=rows, N=columns, bits=pre.bits,
            block_size=pre.group_size, accuracy_level=pre.accuracy_level)]
        replaced += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = _inputs(model.graph)
    kept = [t for t in model.graph.initializer if t.name in used]  # the float weights replaced are not
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    if not any(opset.domain == "com.microsoft" for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    save_graph(model, graph)
    return replaced


def _inputs(graph) -> set[str]:
    """Every name a node reads, in the graph and in the branches of its If nodes."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attribute in node.attribute:
            for branch in [attribute.g] * attribute.HasField("g") + list(attribute.graphs):
                names |= _inputs(branch)
    return names


class _Layers:
    """The checkpoint's layers by their dequantized weight's first column, to find them in a
    constant of the graph's dtype (float32, or float16: the weight rounded once)."""

    FLOATS = (np.dtype(np.float32), np.dtype(np.float16))

    def __init__(self, pre: PreQuantized) -> None:
        self.pre = pre
        self.by_dtype: dict[np.dtype, dict[tuple[int, bytes], list[tuple[Packed, np.ndarray]]]] = {}

    def _by_column(self, dtype: np.dtype) -> dict[tuple[int, bytes], list[tuple[Packed, np.ndarray]]]:
        if dtype not in self.by_dtype:
            index = self.by_dtype[dtype] = {}
            for packed in self.pre.layers.values():
                transposed = packed.weight().T.astype(dtype)  # [K, N], as the graph holds it
                index.setdefault((transposed.shape[0], transposed[:, 0].tobytes()), []).append((packed, transposed))
        return self.by_dtype[dtype]

    def made_of(self, constant: np.ndarray) -> Packed | None:
        """The layers side by side that `constant` [K, N] is exactly, as one Packed; else None."""
        if constant.ndim != 2 or constant.dtype not in self.FLOATS:
            return None
        by_column = self._by_column(constant.dtype)
        parts, offset = [], 0
        while offset < constant.shape[1]:
            candidates = by_column.get((constant.shape[0], constant[:, offset].tobytes()), [])
            part = next((p for p, w in candidates if np.array_equal(constant[:, offset : offset + w.shape[1]], w)),
                        None)
            if part is None:
                return None
            parts.append(part)
            offset += part.codes.shape[1]
        if any(not np.array_equal(p.groups, parts[0].groups) for p in parts):
            raise ValueError("layers fused into one projection (q/k/v or gate/up) have different act-order row "
                             "orders (g_idx); their one input cannot be gathered in both")
        return Packed(*(np.concatenate([getattr(p, f) for p in parts], axis=1) for f in ("codes", "zeros", "scales")),
                      parts[0].groups)


def matmul_nbits(packed: Packed, bits: int, block_size: int,
                 dtype: np.dtype = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' inputs for one layer: codes [N, blocks, block_size x bits / 8] packed low bits
    first along K, scales [N x blocks] in the activations' `dtype` (float16 scales stay exact),
    zero points [N x ceil(blocks x bits / 8)] packed likewise along each column's blocks."""
    rows, columns = packed.codes.shape
    blocks = rows // block_size
    per = 8 // bits
    ordered = packed.codes if packed.order is None else packed.codes[packed.order]
    codes = ordered.T.reshape(columns, blocks, block_size // per, per).astype(np.uint8)
    blob = np.bitwise_or.reduce(codes << (np.arange(per, dtype=np.uint8) * bits), axis=-1).astype(np.uint8)
    zeros = packed.zeros.T.astype(np.uint8)  # [N, blocks]
    padded = -(-blocks // per) * per
    zeros = np.pad(zeros, ((0, 0), (0, padded - blocks))).reshape(columns, -1, per)
    zero_bytes = np.bitwise_or.reduce(zeros << (np.arange(per, dtype=np.uint8) * bits), axis=-1).astype(np.uint8)
    return blob, packed.scales.T.reshape(-1).astype(dtype), zero_bytes.reshape(-1)
