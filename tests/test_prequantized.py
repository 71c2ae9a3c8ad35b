"""Checkpoints published quantized (GPTQ, AWQ) repacked to MatMulNBits over the same integers.

The checkpoints are built here from the layouts AutoGPTQ and AutoAWQ document, packed by this
file's own code from random integers, so that what export/prequantized.py unpacks is checked
against the integers themselves, and what ONNX Runtime's kernel computes against (code - zero) x
scale.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.export.layout import DEFAULT_MODEL_DIR
from batchstring.export.prequantized import read, repack
from tests.conftest import BATCHSTRING, export_recipe

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def pack_words(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """[R, C] 4-bit values -> int32 [R, C / 8]: position j of each word (bits 4j..4j+3) holds
    column order[j] of its eight."""
    rows, columns = values.shape
    grouped = values.reshape(rows, columns // 8, 8).astype(np.uint32)
    words = np.zeros((rows, columns // 8), np.uint32)
    for j, column in enumerate(order):
        words |= grouped[:, :, column] << np.uint32(4 * j)
    return words.view(np.int32)


def quantized_layer(rng: np.random.Generator, rows: int, columns: int, method: str) -> tuple[dict, np.ndarray]:
    """(the layer's tensors in `method`'s layout, its weight [columns, rows] as (code - zero) x scale).
    "gptq-act-order": each row's group (g_idx) a fixed shuffle per K, as GPTQ's desc_act leaves
    layers that share an input; "gptq-per-column": group_size -1, one group over all of K."""
    size = rows if method == "gptq-per-column" else GROUP
    groups = rows // size
    g_idx = np.arange(rows) // size
    if method == "gptq-act-order":
        g_idx = np.random.default_rng(rows).permutation(g_idx)
    codes = rng.integers(0, 16, (rows, columns))
    zeros = rng.integers(1, 16, (groups, columns))
    scales = rng.uniform(0.002, 0.02, (groups, columns)).astype(np.float16)
    weight = ((codes - zeros[g_idx]) * scales[g_idx].astype(np.float32)).T
    if method == "awq":
        tensors = {"qweight": pack_words(codes, AWQ_ORDER), "qzeros": pack_words(zeros, AWQ_ORDER)}
    else:  # GPTQ: codes packed along K (a word holds 8 consecutive rows), zero points stored minus one
        tensors = {"qweight": pack_words(codes.T).T.copy(), "qzeros": pack_words(zeros - 1),
                   "g_idx": g_idx.astype(np.int32)}
    return {**tensors, "scales": scales}, weight.astype(np.float32)


def published(root: Path, model_dir: Path, method: str, layers: int = 2, family: str = "llama",
              spare_biases: float | None = None) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny random Llama (or Qwen2, whose q/k/v have biases) saved as `method` publishes it;
    returns it and each layer's weight. `spare_biases`: a bias of that value written beside every
    quantized layer the model gives none, as AutoGPTQ writes zeros there."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=4096, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, eos_token_id=0, bos_token_id=0,
                                  tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_()  # not their initial zeros: a bias left out would not show
    rng = np.random.default_rng(1 if method == "awq" else 2)
    tensors, weights = {}, {}
    for name, value in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.split(".", 3)[-1] in TARGETS:
            parts, weights[module] = quantized_layer(rng, value.shape[1], value.shape[0], method)
            tensors.update({f"{module}.{part}": array for part, array in parts.items()})
            if spare_biases is not None and f"{module}.bias" not in model.state_dict():
                tensors[f"{module}.bias"] = np.full(value.shape[0], spare_biases, np.float16)
        elif name != "lm_head.weight" or not config.tie_word_embeddings:
            tensors[name] = value.numpy()
    out = root / method
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"))
    group = -1 if method == "gptq-per-column" else GROUP
    quant = {"quant_method": method.split("-")[0], "bits": 4, "group_size": group}
    quant.update({"version": "gemm", "zero_point": True} if method == "awq" else
                 {"desc_act": method == "gptq-act-order", "sym": False, "checkpoint_format": "gptq"})
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": [type(model).__name__],
                                                 "quantization_config": quant}))
    PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json")).save_pretrained(out)
    return out, weights


@pytest.mark.parametrize(("method", "dtype"), [("gptq", "float32"), ("gptq-act-order", "float32"),
                                               ("gptq-per-column", "float32"), ("awq", "float32"),
                                               ("gptq-act-order", "float16")])
def test_the_published_integers_unpack_and_repack_to_the_same_weights_exactly(tmp_path, model_dir, method, dtype):
    """Unpacked, each layer's weight is (code - zero) x scale of the integers packed; repacked into a
    graph of one MatMul in `dtype`, ONNX Runtime's kernel multiplies the identity into those same
    weights (in float16: the float32 weights rounded once, the kernel's scales in float16)."""
    import dataclasses

    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    checkpoint, weights = published(tmp_path, model_dir, method)
    pre = read(checkpoint)
    assert pre.scheme == f"{method.split('-')[0]}-int4" and set(pre.layers) == set(weights)
    # One group per column: blocks of the largest power of two dividing every K (64 and 128)
    assert (pre.per_column, pre.group_size) == ((True, 64) if method == "gptq-per-column" else (False, GROUP))
    for name, weight in weights.items():
        assert np.array_equal(pre.layers[name].weight(), weight), name
    name = "model.layers.1.mlp.down_proj"  # K 128: four blocks of 32 (per column: two of 64)
    assert (pre.layers[name].order is not None) == (method == "gptq-act-order")
    rows, columns = weights[name].shape[1], weights[name].shape[0]
    expected = np.ascontiguousarray(weights[name].T).astype(dtype)
    element = helper.np_dtype_to_tensor_dtype(expected.dtype)
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "W"], ["Y"], name="down")], "one",
                              [helper.make_tensor_value_info("A", element, [None, rows])],
                              [helper.make_tensor_value_info("Y", element, [None, columns])],
                              [numpy_helper.from_array(expected, "W")])
    path = tmp_path / "one.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    exact = dataclasses.replace(pre, layers={name: pre.layers[name]}, accuracy_level=0)
    assert repack(path, exact) == 1
    gathered = {"Gather"} if method == "gptq-act-order" else set()
    assert {node.op_type for node in onnx.load(str(path)).graph.node} == {"MatMulNBits"} | gathered
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (kernel,) = session.run(None, {"A": np.eye(rows, dtype=dtype)})
    assert kernel.dtype == expected.dtype
    assert np.array_equal(kernel, expected), "ONNX Runtime's dequantization gives the checkpoint's weights"


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_quantized_layers_bias_is_kept_and_a_zero_one_the_model_lacks_is_dropped(tmp_path, model_dir, method):
    """Qwen2's q/k/v biases sit beside their layers' integers and load with them; AutoGPTQ writes
    a zero bias beside every layer, Llama's too, which has none: dropped, and a non-zero one there
    refused (leaving it out would change the model)."""
    from safetensors.numpy import load_file

    from batchstring.export.prequantized import load_dequantized

    checkpoint, weights = published(tmp_path / "qwen2", model_dir, method, layers=1, family="qwen2")
    model = load_dequantized(checkpoint, read(checkpoint))
    saved = load_file(checkpoint / "model.safetensors")
    attention = model.model.layers[0].self_attn
    for projection in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{projection}"
        assert torch.equal(getattr(attention, projection).bias, torch.from_numpy(saved[f"{name}.bias"]).float())
        assert torch.equal(getattr(attention, projection).weight, torch.from_numpy(weights[name]))
    zero, _ = published(tmp_path / "zero", model_dir, method, layers=1, spare_biases=0.0)
    assert load_dequantized(zero, read(zero)).model.layers[0].self_attn.q_proj.bias is None
    nonzero, _ = published(tmp_path / "nonzero", model_dir, method, layers=1, spare_biases=0.5)
    with pytest.raises(ValueError, match=r"tensors the model does not have \['model\.layers\.0\.mlp\.down_proj\.bias'"):
        load_dequantized(nonzero, read(nonzero))


PUBLISHED_EXPORTS = [("gptq-act-order", "float32"), ("awq", "float16")]


def republished(checkpoint: Path, quantization: dict | None = None, edit=None) -> Path:
    """The checkpoint with its quantization_config updated by `quantization` (None values removed;
    a None `quantization`: removed) and `edit(tensors)` applied to its tensors, saved again."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((checkpoint / "config.json").read_text())
    if quantization is None:
        del config["quantization_config"]
    else:
        merged = config["quantization_config"] | quantization
        config["quantization_config"] = {key: value for key, value in merged.items() if value is not None}
    (checkpoint / "config.json").write_text(json.dumps(config))
    if edit:
        tensors = load_file(checkpoint / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(checkpoint / "model.safetensors"))
    return checkpoint


def test_a_v1_zero_point_of_zero_reads_back_from_gptqmodel_and_is_refused_where_autogptq_lost_its_word(
        tmp_path, model_dir):
    """Stored minus one, a zero point of 0 is -1. GPTQModel subtracts one from a whole word,
    borrowing from the next field, and reads it back by the inverse addition: exact. AutoGPTQ ORs
    the sign-extended -1 into the word, overwriting the fields above it: refused, saying why."""
    checkpoint, _ = published(tmp_path, model_dir, "gptq", layers=1)
    name = "model.layers.0.mlp.down_proj"
    zeros = np.random.default_rng(3).integers(0, 16, (128 // GROUP, 64))
    zeros[:, ::8] = 0  # the lowest field of every word: a borrow reaches each word's second field
    borrowed = (pack_words(zeros).view(np.uint32) - np.uint32(0x11111111)).view(np.int32)
    sign_extended = np.zeros((zeros.shape[0], 64 // 8), np.uint32)
    for j in range(8):  # AutoGPTQ's pack: (zeros - 1).astype(uint32), each field shifted and ORed in
        sign_extended |= (zeros[:, j::8] - 1).astype(np.int64).astype(np.uint32) << np.uint32(4 * j)

    def stored(words: np.ndarray):
        def edit(tensors: dict) -> None:
            tensors[f"{name}.qzeros"] = words.view(np.int32)
        return edit

    pre = read(republished(checkpoint, {"meta": {"quantizer": ["gptqmodel:5.0.0"]}}, stored(borrowed)))
    assert np.array_equal(pre.layers[name].zeros, zeros)
    with pytest.raises(ValueError, match=r"a GPTQ v1 zero point of 0 \(stored as -1: \d+ fields of all ones\)"):
        read(republished(checkpoint, {"meta": None}, stored(sign_extended)))


@pytest.mark.parametrize(("quantization", "says"), [
    ({"checkpoint_format": "gptq_p"}, "checkpoint_format 'gptq_p' is not supported; gptq and gptq_v2 are"),
    ({"pack_dtype": "int16"}, "pack_dtype 'int16' is not supported"),
    ({"rotation": "hadamard"}, "quantization_config.rotation (a rotation the activations need"),
    ({"dynamic": {r".*down_proj": {"bits": 8}}}, "quantization_config.dynamic (bits or group sizes that differ"),
    ({"bits": 3}, "gptq with 3 bits is not supported; 4 or 8 are"),
    ({"quant_method": None}, "quantization_config.quant_method None is not supported"),
], ids=["checkpoint_format", "pack_dtype", "rotation", "dynamic", "bits", "no quant_method"])
def test_a_quantization_option_that_changes_what_the_integers_mean_is_refused_by_name(tmp_path, model_dir,
                                                                                     quantization, says):
    checkpoint, _ = published(tmp_path, model_dir, "gptq", layers=1)
    with pytest.raises(ValueError, match=re.escape(says)):
        read(republished(checkpoint, quantization))


def test_a_published_mixture_of_experts_is_refused_by_name(tmp_path, model_dir):
    """The step stacks a layer's experts, so per-expert integers have no weight to become."""
    checkpoint, _ = published(tmp_path, model_dir, "gptq", layers=1)

    def as_expert(tensors: dict) -> None:
        for name in [n for n in tensors if ".mlp.up_proj." in n]:
            tensors[name.replace(".mlp.up_proj.", ".mlp.experts.0.up_proj.")] = tensors.pop(name)

    with pytest.raises(ValueError, match="published gptq mixtures of experts are not supported"):
        read(republished(checkpoint, {}, as_expert))


def test_older_and_bfloat16_uploads_read_and_unlabelled_integers_are_refused(tmp_path, model_dir):
    """An older AutoGPTQ upload names its quantization in quantize_config.json; a bfloat16 model's
    scales are bfloat16 (widened exactly); words packed in int16 are refused, whatever the config
    says; and quantized tensors no config describes are refused rather than read as a float
    checkpoint (whose missing weights transformers would fill with random values)."""
    import torch
    from safetensors.torch import load_file, save_file

    from batchstring.export.prequantized import load_dequantized

    checkpoint, weights = published(tmp_path, model_dir, "gptq", layers=1)
    spec = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    (checkpoint / "quantize_config.json").write_text(json.dumps({k: v for k, v in spec.items() if k != "quant_method"}))
    republished(checkpoint, None)
    tensors = load_file(checkpoint / "model.safetensors")
    save_file({name: value.to(torch.bfloat16) if name.endswith(".scales") else value
               for name, value in tensors.items()}, checkpoint / "model.safetensors")
    pre = read(checkpoint)
    assert pre.scheme == "gptq-int4" and pre.group_size == GROUP
    model = load_dequantized(checkpoint, pre)
    for name in weights:  # the bfloat16 scales exactly (float32 holds every bfloat16)
        scales = tensors[f"{name}.scales"].to(torch.bfloat16).float().numpy()
        assert np.array_equal(pre.layers[name].scales, scales), name
        assert torch.equal(model.get_submodule(name).weight, torch.from_numpy(pre.layers[name].weight()))
    name = "model.layers.0.mlp.up_proj.qzeros"
    save_file({key: value for key, value in tensors.items() if key != name}, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj has a \.qweight but no \.qzeros"):
        read(checkpoint)
    name = "model.layers.0.self_attn.q_proj.qweight"
    save_file({**tensors, name: tensors[name].view(torch.int16)}, checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="packed integers of int16 are not supported"):
        read(checkpoint)
    (checkpoint / "quantize_config.json").unlink()
    with pytest.raises(ValueError, match=r"holds quantized layers \(\.qweight\) but no quantization_config"):
        read(checkpoint)


def test_a_float_checkpoint_that_lacks_weights_is_refused(tmp_path):
    """transformers fills a missing weight with random values; the export would verify against them."""
    from safetensors.numpy import load_file, save_file

    from batchstring.export.exporter import load_checkpoint
    from tests.test_export import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "tiny")
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(SystemExit, match=r"lacks 1 of the model's weights \(model\.layers\.1\.mlp\.down_proj\."):
        load_checkpoint(checkpoint)


def published_recipe(method: str, dtype: str):
    """A `method` checkpoint of one layer (half the tracing) exported in `dtype` (tests/conftest.py:
    exports); AWQ's of Qwen2, whose q/k/v biases sit beside the integers."""
    def recipe(root: Path) -> list[str]:
        family = "qwen2" if method == "awq" else "llama"
        checkpoint, _ = published(root, DEFAULT_MODEL_DIR, method, layers=1, family=family)
        return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export"), "--dtype", dtype]
    return recipe


for source, bits in PUBLISHED_EXPORTS:
    export_recipe(f"{source}-{bits}", published_recipe(source, bits), checkpoint_method=source, export_dtype=bits)


@pytest.mark.parametrize(("checkpoint_method", "export_dtype"), PUBLISHED_EXPORTS)
def test_a_published_checkpoint_exports_with_its_integers_and_generates(exports, tmp_path, checkpoint_method,
                                                                        export_dtype):
    """GPTQ with act-order in float32, AWQ (of Qwen2, with biases) in float16: MatMulNBits over the
    checkpoint's integers with scales in the export's dtype, measured, and the engine decodes what
    the repacked step does."""
    import onnx
    from onnx import numpy_helper

    from batchstring.engine.sampling_params import SamplingParams
    from batchstring.export.exporter import onnx_step
    from batchstring.export.verify import greedy_with_step
    from tests.engine_helpers import engine

    root, result = exports[f"{checkpoint_method}-{export_dtype}"]
    checkpoint, out = root / checkpoint_method, root / "export"
    scheme = f"{checkpoint_method.split('-')[0]}-int4"
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, said
    assert f"{scheme} (the checkpoint's own integers, groups of 32" in said and "4 matrix multiplies" in said
    spec = json.loads((out / "runtime.json").read_text())
    assert spec["dtype"] == export_dtype and spec["quantization"]["scheme"] == scheme
    assert spec["quantization"]["block_size"] == GROUP and not (out / "model.pt").exists()
    graph = onnx.load(str(out / "model.onnx"))
    constants = {t.name: t for t in graph.graph.initializer}
    kernels = [node for node in graph.graph.node if node.op_type == "MatMulNBits"]
    assert len(kernels) == 4 and all(numpy_helper.to_array(constants[k.input[2]]).dtype == export_dtype
                                     for k in kernels), "scales in the activations' dtype"
    eng = engine(out)
    seq = eng.make_sequence("def f(x):", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                            lambda o: None)
    eng.generate([seq])
    kv_shape = (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"])
    assert seq.output_ids == greedy_with_step(onnx_step(out / "model.onnx", export_dtype), seq.prompt_ids, 8,
                                              kv_shape, [], np.dtype(export_dtype))
    for option, says in ((["--quantize", "int8"], "drop --quantize"), (["--dtype", "bfloat16"], "--dtype float16")):
        refused = subprocess.run([*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(tmp_path / "x"),
                                  *option], capture_output=True, text=True, timeout=600)
        words = " ".join((refused.stdout + refused.stderr).split())
        assert refused.returncode != 0 and f"published quantized ({scheme})" in words and says in words, words
