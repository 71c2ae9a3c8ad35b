"""Weight-only quantized exports: `batchstring export --quantize`, `batchstring quantize` on an
export, their measurements and refusals, serving one, the perplexity command; and the greedy
reference judged on the step's vocabulary.

The quantizations are measured on a tiny Llama trained until it knows a 512-token text by heart:
near a minimum of that text's loss any change of the weights raises its perplexity there, so a
strict bound is crossed for certain. Families with q/k norms and experts are quantized in
tests/test_families.py, from the exports those tests make anyway.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.export.synthetic import random_checkpoint, tiny_family_config
from tests.conftest import BATCHSTRING, export_recipe, made, serve, stop


def batchstring(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*BATCHSTRING, *args], capture_output=True, text=True, timeout=timeout)


def said(result: subprocess.CompletedProcess) -> str:
    return " ".join((result.stdout + result.stderr).split())


def op_types(graph: Path) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node}


def learnt_recipe(root: Path) -> list[str]:
    """The unquantized export of `learnt_checkpoint` (tests/conftest.py: exports)."""
    checkpoint = learnt_checkpoint(root / "checkpoint")
    return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export")]


def qk_norm_recipe(root: Path) -> list[str]:
    """Qwen3 (q/k norms) with 4096 embedding rows and a 512-token tokenizer, `export --quantize int4`."""
    config = tiny_family_config("qwen3")
    config.vocab_size = 4096
    checkpoint = random_checkpoint(root / "checkpoint", config, seed=3, tokenizer_vocab=512)
    return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export"), "--quantize", "int4"]


export_recipe("learnt", learnt_recipe)
export_recipe("qk-norm-int4", qk_norm_recipe)


@pytest.fixture(scope="module")
def learnt(exports) -> tuple[Path, Path, Path]:
    """(checkpoint, its text, its unquantized export)."""
    root, _ = made(exports, "learnt")
    return root / "checkpoint", root / "checkpoint" / "text.txt", root / "export"


def learnt_checkpoint(root: Path) -> Path:
    """A tiny Llama trained until it knows a 512-token held-out text (`root`/text.txt, kept
    beside its weights) by heart."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.layout import DEFAULT_MODEL_DIR, HELDOUT_TEXT

    root.mkdir()
    codec = TextCodec.from_file(DEFAULT_MODEL_DIR / "tokenizer.json")
    (root / "text.txt").write_text(codec.decode(codec.encode(HELDOUT_TEXT.read_text())[:540]))
    ids = codec.encode((root / "text.txt").read_text())[:512]  # as the export reads it back
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=0, bos_token_id=0)
    model = LlamaForCausalLM(config)
    batch = torch.tensor(ids).reshape(2, 256)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5, f"not learnt by heart: loss {loss.item():.2f}"
    model.save_pretrained(root)
    PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json")).save_pretrained(root)
    return root


def test_a_quantization_past_its_perplexity_bound_is_refused_and_forced_it_is_kept(learnt, tmp_path):
    _, text, export = learnt
    out = tmp_path / "int4"
    strict = ("quantize", "int4", "--model", str(export), "--out", str(out), "--heldout", str(text),
              "--max-perplexity-rise", "0.01")
    refused = batchstring(*strict)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    words = said(refused)
    assert "int4 raises perplexity on the held-out text by" in words and "past the 0.01% an export accepts" in words
    assert "--quantize int8" in words and "--force" in words and "nothing was written" in words
    assert not out.exists()
    forced = batchstring(*strict, "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    record = json.loads((out / "runtime.json").read_text())["quantization"]
    assert (record["bits"], record["block_size"], record["symmetric"], record["head"]) == (4, 32, True, False)
    assert record["accuracy_level"] == 4
    assert record["perplexity_rise_percent"] > 0.01
    for graph in ("model.onnx", "model.small.onnx"):
        assert "MatMulNBits" in op_types(out / graph), graph
    assert not (out / "model.pt").exists(), "a TorchScript step would hold the unquantized weights"
    assert (export / "model.pt").exists() and "MatMulNBits" not in op_types(export / "model.onnx"), "source kept"
    described = "int4 (blocks of 32, symmetric, accuracy_level 4, head in the export's dtype)"
    assert f"{described}: 8 matrix multiplies quantized" in said(forced)


def test_quantize_refuses_what_it_cannot_quantize(learnt, tmp_path):
    checkpoint, _, export = learnt
    same = batchstring("quantize", "int8", "--model", str(export), "--out", str(export))
    assert same.returncode != 0 and "--out must not be --model" in said(same)
    not_export = batchstring("quantize", "int8", "--model", str(checkpoint), "--out", str(tmp_path / "a"))
    assert not_export.returncode == 1 and "is not an ONNX export" in said(not_export)
    assert "batchstring export --model CHECKPOINT --out DIR" in said(not_export)
    twice = tmp_path / "b"
    assert batchstring("quantize", "int8", "--model", str(export), "--out", str(twice)).returncode == 0
    again = batchstring("quantize", "int4", "--model", str(twice), "--out", str(tmp_path / "c"))
    assert again.returncode == 1 and "is already quantized (int8)" in said(again)
    alone = batchstring("export", "--model", str(checkpoint), "--out", str(tmp_path / "d"), "--block-size", "64")
    assert alone.returncode != 0 and "--block-size" in said(alone) and "go with --quantize" in said(alone)
    odd = batchstring("quantize", "int4", "--model", str(export), "--out", str(tmp_path / "e"), "--block-size", "48")
    assert odd.returncode != 0 and "invalid choice: 48" in said(odd)


def test_serve_model_serves_a_quantized_export_as_its_step_decodes(learnt, tmp_path):
    """`batchstring serve --model DIR` on an int8 export: a real server's greedy text is the
    quantized graph's own greedy loop's."""
    from batchstring.client import BatchClient
    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import onnx_step
    from batchstring.export.verify import greedy_with_step

    _, text, export = learnt
    out = tmp_path / "int8"
    assert batchstring("quantize", "int8", "--model", str(export), "--out", str(out)).returncode == 0
    codec = TextCodec.from_file(out / "tokenizer.json")
    ids = codec.encode(text.read_text())
    prompts = [codec.decode(ids[:40]), codec.decode(ids[300:330])]
    proc, ports, banner = serve(tmp_path, "--model", str(out))
    try:
        assert "llm ready" in banner, banner + proc.stdout.read()
        with BatchClient(f"127.0.0.1:{ports[1]}") as client:
            texts = client.batchstring(prompts, max_tokens=12, ignore_eos=True, temperature=0)
    finally:
        stop(proc)
    spec = json.loads((out / "runtime.json").read_text())
    step = onnx_step(out / "model.onnx", "float32")
    kv_shape = (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"])
    for prompt, served in zip(prompts, texts):
        assert served == codec.decode(greedy_with_step(step, codec.encode(prompt), 12, kv_shape, [], np.float32))


def test_perplexity_is_the_same_through_either_runtime_and_rises_with_int4(learnt, tmp_path):
    import onnx

    _, text, export = learnt
    low = tmp_path / "int4"
    assert batchstring("quantize", "int4", "--model", str(export), "--out", str(low), "--force",
                       "--block-size", "128").returncode == 0
    assert json.loads((low / "runtime.json").read_text())["quantization"]["block_size"] == 128
    kernels = [n for n in onnx.load(str(low / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    assert kernels and all(onnx.helper.get_node_attr_value(n, "block_size") == 128 for n in kernels)

    def measured(model: Path, runtime: str) -> float:
        result = batchstring("perplexity", "--model", str(model), "--text", str(text), "--runtime", runtime,
                             "--context", "128")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "windows of 128, second halves scored" in result.stdout
        return float(result.stdout.split()[1])

    onnx, torchscript = measured(export, "onnxruntime"), measured(export, "torchscript")
    assert abs(onnx / torchscript - 1) < 1e-4
    assert measured(low, "onnxruntime") > onnx
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    result = batchstring("perplexity", "--model", str(export), "--text", str(short))
    assert result.returncode == 1 and "perplexity needs at least one window of 256" in said(result)
    result = batchstring("perplexity", "--model", str(low), "--runtime", "torchscript")
    assert result.returncode == 1 and "has no model.pt; measure it with the other --runtime" in said(result)
    short.write_bytes(b"x = 1\n\xe9t\xe9\n")  # Latin-1, not UTF-8
    result = batchstring("perplexity", "--model", str(export), "--text", str(short))
    assert result.returncode == 1 and "is not UTF-8 text (byte 0xe9 at offset 6)" in said(result)
    result = batchstring("perplexity", "--model", str(tmp_path), "--text", str(text))
    assert result.returncode == 1 and "is not an export (no runtime.json)" in said(result)


def test_export_quantize_exports_verifies_and_quantizes_a_qk_norm_family_with_a_padded_vocabulary(exports):
    """Qwen3 (q/k norms) with 4096 embedding rows and a 512-token tokenizer, `export --quantize int4`:
    the unquantized runtimes verify against HF judged on the tokenizer's ids, then the graphs are
    quantized and measured against them."""
    root, stdout = made(exports, "qk-norm-int4")
    out = root / "export"
    words = " ".join(stdout.split())
    for runtime in ("eager step", "torchscript", "onnxruntime", "onnxruntime, small steps"):
        assert f"{runtime}: greedy identical for 3/3 prompts" in words, runtime
    assert "int4 (blocks of 32, symmetric, accuracy_level 4, head in the export's dtype):" in words
    assert "(float32, int4 weights)" in words
    spec = json.loads((out / "runtime.json").read_text())
    assert spec["quantization"]["bits"] == 4 and spec["vocab_size"] == 512
    assert "MatMulNBits" in op_types(out / "model.onnx")


def test_the_greedy_reference_chooses_among_the_ids_the_step_samples(tmp_path):
    """A random checkpoint whose 4096-row head is padded past a 512-token tokenizer: HF `generate`
    picks padding ids the step never samples, unless judged on the step's vocabulary."""
    from transformers import AutoModelForCausalLM

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import _eager, decoder_step
    from batchstring.export.verify import greedy_references, verify_greedy

    config = tiny_family_config("llama")
    config.vocab_size = 4096
    checkpoint = random_checkpoint(tmp_path / "checkpoint", config, seed=3, tokenizer_vocab=512)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    step, eos = decoder_step(model, checkpoint)
    codec = TextCodec.from_file(checkpoint / "tokenizer.json")
    vocabulary = codec.known_ids()
    assert vocabulary[0] == step.vocab_size == 512
    plain = greedy_references(model, codec.encode, eos)
    assert any(max(ref.tokens) >= 512 for ref in plain.values()), "HF chose padding ids"
    judged = verify_greedy(model, codec.encode, eos, {"eager step": _eager(step)}, vocabulary=vocabulary)
    assert all(ok["eager step"] for ok in judged.values())


def test_a_tied_head_is_untied_exactly_and_quantized_when_asked(model_dir, tmp_path):
    """The shipped model ties its head to its embedding (a Transpose the quantizer cannot see
    through): untied, the graph computes the same logits; `--quantize-head` then quantizes it."""
    import shutil

    import onnx

    from batchstring.export.exporter import onnx_step
    from batchstring.export.perplexity import window_logits
    from batchstring.export.quantize import Quantization, quantize_graph, untie_head

    model = onnx.load(str(model_dir / "model.onnx"))
    assert untie_head(model, 4096) == 1
    heads = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1].endswith(".transposed")]
    assert len(heads) == 1 and not any(n.op_type == "Transpose" and n.input[0] == "lm_head.weight"
                                       for n in model.graph.node)
    onnx.save(model, str(tmp_path / "untied.onnx"))
    window = list(range(5, 69))
    spec = json.loads((model_dir / "runtime.json").read_text())
    kv_shape = (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"])
    before = window_logits(onnx_step(model_dir / "model.onnx", "float32"), window, kv_shape)
    after = window_logits(onnx_step(tmp_path / "untied.onnx", "float32"), window, kv_shape)
    assert np.abs(before - after).max() < 1e-5
    shutil.copyfile(model_dir / "model.onnx", tmp_path / "model.onnx")
    assert quantize_graph(tmp_path / "model.onnx", Quantization("int4", head=True), 4096) == 17
    shutil.copyfile(model_dir / "model.onnx", tmp_path / "model.onnx")
    assert quantize_graph(tmp_path / "model.onnx", Quantization("int4"), 4096) == 16


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_embedding_quantizes_as_gather_block_quantized_and_only_the_embedding(model_dir, tmp_path, scheme):
    """`--quantize-embedding`: the one Gather that reads the [vocab, hidden] table becomes
    GatherBlockQuantized (4 bits whatever the scheme); every other Gather stays; the graph runs and
    its logits stay near the unquantized graph's."""
    import shutil

    import onnx

    from batchstring.export.exporter import onnx_step
    from batchstring.export.perplexity import window_logits
    from batchstring.export.quantize import Quantization, quantize_graph

    gathers = sum(n.op_type == "Gather" for n in onnx.load(str(model_dir / "model.onnx")).graph.node)
    shutil.copyfile(model_dir / "model.onnx", tmp_path / "model.onnx")
    assert quantize_graph(tmp_path / "model.onnx", Quantization(scheme, head=True, embedding=True), 4096) == 17
    graph = onnx.load(str(tmp_path / "model.onnx")).graph
    quantized = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert len(quantized) == 1 and sum(n.op_type == "Gather" for n in graph.node) == gathers - 1
    bits = {a.name: a.i for a in quantized[0].attribute}.get("bits", 4)
    assert bits == 4
    spec = json.loads((model_dir / "runtime.json").read_text())
    kv_shape = (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"])
    window = list(range(5, 69))
    before = window_logits(onnx_step(model_dir / "model.onnx", "float32"), window, kv_shape)
    after = window_logits(onnx_step(tmp_path / "model.onnx", "float32"), window, kv_shape)
    assert np.isfinite(after).all() and 0 < np.abs(before - after).max() < 5.0
