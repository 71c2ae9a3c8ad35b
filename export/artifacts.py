"""Writes the decoder step as ONNX and as TorchScript, and the runtime description beside them."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from batchstring.export.contract import (
    ADAPTER_SITES,
    INPUT_NAMES,
    INPUTS,
    OUTPUT_NAMES,
    STATIC_DIMS,
    AdapterWeights,
    Held,
    SamplingInputs,
    StepInputs,
)
from batchstring.export.step import DecoderStep

# The example step's sizes: every dynamic axis has its own size > 1, so the exporter can neither
# specialise nor merge them (tests/test_export.py checks that they stay distinct).
EXAMPLE = {"tokens": 19, "decode_rows": 6, "decode_pairs": 11, "decode_span": 15, "block_size": 16,
           "prefill_rows": 2, "prefill_new": 9, "prefill_pairs": 12, "prefill_span": 10, "table_rows": 13,
           "table_width": 83, "cache_blocks": 41, "sampled_rows": 5, "rows": 8, "banned_rows": 3,
           "masked_rows": 4, "adjustments": 7, "adapter_groups": 14, "group_width": 23, "adapter_slots": 17,
           "qkv_rank": 18, "o_rank": 20, "gate_up_rank": 21, "down_rank": 22}
EXAMPLE_DECODE_CONTEXT = (500, 240, 0, 400, 600, 239)  # spans of 15 x 16: 3 + 1 + 1 + 2 + 3 + 1 = 11 pairs
EXAMPLE_PREFILL_CONTEXT = (1000, 700)  # spans of 10 x 16: 7 + 5 = 12 pairs


def example_inputs(step: DecoderStep) -> tuple[torch.Tensor, ...]:
    """`example_step` as the step's arguments, the caches in the step's dtype."""
    inputs, held = example_step(step)
    cache = torch.from_numpy(held.key_cache).to(step.dtype)
    adapters = AdapterWeights(*(torch.from_numpy(w).to(step.dtype) for w in held.adapters))
    return tuple(inputs.positional(Held(torch.from_numpy(held.block_table), cache, cache.clone(), adapters),
                                   torch.from_numpy))


def example_step(step: DecoderStep) -> tuple[StepInputs, Held]:
    """A step of EXAMPLE's sizes: 6 decode rows; 2 prefill rows of 9 and 4 new tokens (padded to
    9); 19 tokens in all; 8 rows want a next token, 5 sample, 3 have EOS banned, 4 follow a
    grammar, 7 logit adjustments; 14 groups of adapted tokens (23 wide, padded) over 17 resident
    adapters; a table of 13 rows over 41 cache blocks of 16 tokens (float32)."""
    e = EXAMPLE
    cache = np.zeros((len(step.layers), step.num_kv_heads, e["cache_blocks"], e["block_size"], step.head_dim),
                     np.float32)
    prefill = np.array([list(range(6, 15)), [0] * 5 + [15, 16, 17, 18]])
    table = np.arange(e["table_rows"] * e["table_width"]).reshape(e["table_rows"], -1) % e["cache_blocks"]
    sampling = SamplingInputs(
        ban_rows=np.array([1, 4, 7]), sample_rows=np.array([0, 2, 3, 6, 7]),
        temperature=np.array([0.5, 1.0, 0.0, 2.0, 0.7], np.float32), top_k=np.array([0, 3, 0, 1, 0]),
        top_p=np.array([1.0, 0.9, 1.0, 0.5, 1.0], np.float32), uniform=np.array([0.3, 0.7, 1.0, 0.1, 0.5], np.float32),
        min_p=np.array([0.0, 0.1, 0.0, 0.05, 0.0], np.float32), mask_rows=np.array([0, 2, 5, 7]),
        token_mask=np.full((4, -(-step.vocab_size // 32)), -1, np.int32),
        adjust_rows=np.array([0, 0, 2, 3, 5, 6, 7]), adjust_tokens=np.array([1, 2, 3, 4, 5, 6, 7]),
        adjust_bias=np.full(7, 0.5, np.float32), adjust_scale=np.full(7, 1.2, np.float32),
        adjust_shift=np.full(7, 0.1, np.float32))
    inputs = StepInputs(
        input_ids=np.arange(19) % 7, position_ids=np.arange(19),
        decode_tokens=np.arange(6)[:, None], decode_rows=np.array([3, 0, 7, 1, 12, 5]),
        decode_context=np.array(EXAMPLE_DECODE_CONTEXT), decode_pairs=np.zeros((e["decode_pairs"], e["decode_span"], 0),
                                                                               np.int64),
        prefill_tokens=prefill, prefill_mask=prefill > 0, prefill_rows=np.array([9, 2]),
        prefill_context=np.array(EXAMPLE_PREFILL_CONTEXT),
        prefill_pairs=np.zeros((e["prefill_pairs"], e["prefill_span"], 0), np.int64),
        token_order=np.array([*range(15), 20, 21, 22, 23]), logit_tokens=np.array([0, 1, 2, 3, 4, 5, 14, 18]),
        sampling=sampling,
        adapter_tokens=np.arange(e["adapter_groups"] * e["group_width"]).reshape(e["adapter_groups"], -1) % 19,
        adapter_mask=np.ones((e["adapter_groups"], e["group_width"]), np.float32),
        adapter_index=np.arange(e["adapter_groups"]) % e["adapter_slots"])
    return inputs, Held(table, cache, cache.copy(), example_adapters(step))


def example_adapters(step: DecoderStep) -> AdapterWeights:
    """EXAMPLE's slots and per-site ranks of adapter weights (zeros: the trace needs their shapes)."""
    e, layers, sites = EXAMPLE, len(step.layers), step.adapter_sites()

    def pair(site: str) -> tuple[np.ndarray, np.ndarray]:
        fan_in, fan_out = sites.get(site, (0, 0))
        slots, rank = e["adapter_slots"], e[f"{site}_rank"]
        return np.zeros((layers, slots, fan_in, rank), np.float32), np.zeros((layers, slots, rank, fan_out), np.float32)
    return AdapterWeights(*(w for site in ADAPTER_SITES for w in pair(site)))


def dynamic_shapes() -> tuple[dict[int, Dim], ...]:
    """Each input's dynamic axes, in the step's argument order, from the contract's named dims."""
    dims: dict[str, Dim] = {}
    return tuple({axis: dims.setdefault(name, Dim(name)) for axis, name in enumerate(tensor.dims)
                  if isinstance(name, str) and name not in STATIC_DIMS} for tensor in INPUTS)


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
            dynamic_shapes={"inputs": dynamic_shapes()},
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


def device_constants(model_pt: Path) -> list[str]:
    """Lines of the saved TorchScript code that name a device: each would pin a tensor there
    whatever device the module is loaded on (`map_location` moves only weights and buffers)."""
    with zipfile.ZipFile(model_pt) as archive:
        return [line.strip() for name in archive.namelist() if name.endswith(".py")
                for line in archive.read(name).decode().splitlines() if "torch.device(" in line]


# Arithmetic lifts a CPU scalar tensor beside device tensors (so shape arithmetic may stay on the
# host); comparisons too; every other operator wants all its tensors on one device.
_ARITHMETIC = frozenset({"aten::mul", "aten::add", "aten::sub", "aten::div", "aten::floor_divide",
                         "aten::remainder", "aten::neg"})
_TAKES_HOST_SCALARS = _ARITHMETIC | {"aten::Int", "aten::Float", "aten::ScalarImplicit", "aten::eq", "aten::ne",
                                     "aten::lt", "aten::le", "aten::gt", "aten::ge"}


def host_scalars(model_pt: Path) -> list[str]:
    """Operators of the saved step that take a tensor the trace made from a shape, or a tensor
    constant: either is a CPU tensor wherever the module runs. Arithmetic accepts a CPU scalar
    beside device tensors; any other operator (clamp with a tensor bound, for one) fails on a GPU
    with 'Expected all tensors to be on the same device', and neither the CPU nor the meta device
    notices, so the saved graph is read for it."""
    module = torch.jit.load(str(model_pt))
    graph, _ = torch._C._jit_pass_lower_graph(module.inlined_graph, module._c)
    host: set[int] = set()
    found = []
    for node in graph.nodes():
        args = list(node.inputs())
        fed = [i for i, value in enumerate(args) if value.unique() in host]
        if _makes_host_tensor(node) or (fed and node.kind() in _ARITHMETIC and all(
                value.unique() in host for value in args if isinstance(value.type(), torch._C.TensorType))):
            host.update(value.unique() for value in node.outputs())
        elif fed and node.kind() not in _TAKES_HOST_SCALARS:
            found.append(f"{node.kind()} (argument {fed[0]}) of {node.sourceRange().split(chr(10))[0].strip()}")
    return found


def _makes_host_tensor(node) -> bool:
    """A shape turned into a tensor, or a tensor constant of the saved code (both live on the CPU)."""
    return node.kind() == "prim::NumToTensor" or (
        node.kind() == "prim::Constant" and isinstance(node.output().type(), torch._C.TensorType))


def run_on_meta(model_pt: Path, spec: dict) -> tuple[torch.Tensor, ...]:
    """Runs the saved step with every weight, input and both caches on the `meta` device (shapes
    only, no data, no GPU): any tensor the graph creates on a fixed device meets meta tensors and
    fails, as it would on `cuda:3`. `torch.jit.load(map_location="meta")` itself cannot load a
    module (aten::equal has no meta kernel), so the graph is lowered to a function whose weights
    are arguments."""
    from batchstring.export.verify import Row, Sampling, pack

    module = torch.jit.load(str(model_pt))
    graph, weights = torch._C._jit_pass_lower_graph(module.inlined_graph, module._c)
    function = torch._C._create_function_from_graph("step_on_meta", graph)
    cache = np.zeros((spec["num_layers"], spec["num_kv_heads"], 12, 4, spec["head_dim"]), np.float32)
    rows = [Row([3], [0, 1, 2], 10), Row([5], [3, 4], 7, Sampling(temperature=0.8, top_p=0.9)),
            Row([7, 8, 9, 10], [5, 6], 5, Sampling(temperature=1.0, top_k=5, ban_eos=True))]
    inputs, held = pack(rows, cache, cache)
    dtype = getattr(torch, spec["dtype"])
    meta = Held(torch.from_numpy(held.block_table).to("meta"),
                *(torch.from_numpy(c).to("meta", dtype) for c in (held.key_cache, held.value_cache)))
    meta = meta.without_adapters(adapter_sites(spec), lambda shape: torch.zeros(shape, dtype=dtype, device="meta"))
    with torch.no_grad():
        return function(*inputs.positional(meta, lambda a: torch.from_numpy(a).to("meta")),
                        *(w.to("meta") for w in weights))


def runtime_spec(step: DecoderStep, hf_config, tokenizer_eos: list[int], source: str,
                 sampling_defaults: dict | None = None) -> dict:
    """What the engine needs to size its cache and stop generation, without loading torch."""
    return {
        "source": source,
        "model_type": hf_config.model_type,
        "num_layers": len(step.layers),
        "num_heads": step.num_heads,
        "num_kv_heads": step.num_kv_heads,
        "head_dim": step.head_dim,
        "hidden_size": int(hf_config.hidden_size),  # with intermediate_size: the activation estimate
        "intermediate_size": int(hf_config.intermediate_size),
        "vocab_size": step.vocab_size,  # ids the step can produce: the tokenizer's (padding cut off)
        "checkpoint_vocab_size": int(step.lm_head.out_features),
        "context_length": int(hf_config.max_position_embeddings),
        "sliding_windows": [plan.window for plan in step.plans],  # per layer; null: every past token
        "eos_token_ids": tokenizer_eos,
        "dtype": str(step.dtype).removeprefix("torch."),  # weights and KV cache
        "sampling_defaults": sampling_defaults or {},  # the checkpoint's generation_config
        "adapters": step.adapters,  # exported with LoRA adapters in use (`batchstring export --adapters`)
        "adapter_sites": step.adapter_sites(),  # projections a LoRA adapter may change: (in, out) features
        "inputs": list(INPUT_NAMES),
        "outputs": list(OUTPUT_NAMES),
    }


def adapter_sites(spec: dict) -> dict[str, tuple[int, int]]:
    """runtime.json's adapter sites as (in, out) pairs."""
    return {site: tuple(features) for site, features in spec.get("adapter_sites", {}).items()}


def write_runtime_spec(spec: dict, path: Path) -> None:
    path.write_text(json.dumps(spec, indent=2) + "\n")
