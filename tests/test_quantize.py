"""Weight-only quantized exports (`batchstring export --quantize`): written, measured, refused past
their bound, and served; the perplexity command; and the greedy reference on the step's vocabulary.

Tiny random checkpoints of three families: a dense Llama whose embedding is padded past its
tokenizer (the greedy reference must choose among the tokenizer's ids, as the step does), Qwen3
(q/k norms) and Mixtral (experts); and a tiny Llama trained until it fits its text, on which any
perturbation of the weights raises perplexity, so a strict bound is crossed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.export.synthetic import random_checkpoint, tiny_family_config
from tests.conftest import BATCHSTRING, serve, stop


def export(checkpoint: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(out), *options],
                          capture_output=True, text=True, timeout=600)


def said(result: subprocess.CompletedProcess) -> str:
    return " ".join((result.stdout + result.stderr).split())


def op_types(graph: Path) -> set[str]:
    import onnx

    return {node.op_type for node in onnx.load(str(graph), load_external_data=False).graph.node}


@pytest.fixture(scope="module")
def padded_int8(tmp_path_factory):
    """A dense checkpoint with 4096 embedding rows and a 512-token tokenizer, exported in int8."""
    config = tiny_family_config("llama")
    config.vocab_size = 4096
    root = tmp_path_factory.mktemp("padded-int8")
    checkpoint = random_checkpoint(root / "checkpoint", config, seed=3, tokenizer_vocab=512)
    result = export(checkpoint, root / "out", "--quantize", "int8")
    assert result.returncode == 0, result.stdout + result.stderr
    return checkpoint, root / "out", said(result)


def test_a_padded_vocabulary_verifies_greedy_against_hf_on_the_tokenizers_ids(padded_int8):
    """HF `generate` over 4096 logits would pick padding rows the step never samples; judged on the
    step's 512 ids, every runtime's greedy tokens are HF's."""
    _, _, stdout = padded_int8
    for runtime in ("eager step", "torchscript", "onnxruntime", "onnxruntime, small steps"):
        assert f"{runtime}: greedy identical for 3/3 prompts" in stdout, stdout


def test_an_int8_export_holds_quantized_graphs_and_says_what_it_cost(padded_int8):
    _, out, stdout = padded_int8
    spec = json.loads((out / "runtime.json").read_text())
    assert spec["quantization"]["bits"] == 8 and spec["quantization"]["block_size"] == 32
    assert spec["quantization"]["symmetric"] and not spec["quantization"]["head"]
    for graph in ("model.onnx", "model.small.onnx"):
        assert "MatMulNBits" in op_types(out / graph), graph
    assert not (out / "model.pt").exists(), "a TorchScript step would hold the unquantized weights"
    assert "int8 (blocks of 32, symmetric, head in the export's dtype): 8 matrix multiplies quantized" in stdout
    assert "perplexity on" in stdout and "held-out tokens" in stdout and "greedy identical to HF for" in stdout
    assert "(float32, int8 weights)" in stdout


def test_serve_model_serves_a_quantized_export_as_its_step_decodes(padded_int8, tmp_path):
    """`batchstring serve --model DIR` on the int8 export: a real server's greedy text is the
    quantized graph's own greedy loop's."""
    from batchstring.client import BatchClient
    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import onnx_step
    from batchstring.export.verify import greedy_with_step

    _, out, _ = padded_int8
    proc, ports, banner = serve(tmp_path, "--model", str(out))
    prompts = ["def parse(text):", "import os\n"]
    try:
        assert "llm ready" in banner, banner + proc.stdout.read()
        with BatchClient(f"127.0.0.1:{ports[1]}") as client:
            texts = client.batchstring(prompts, max_tokens=10, ignore_eos=True, temperature=0)
    finally:
        stop(proc)
    codec = TextCodec.from_file(out / "tokenizer.json")
    spec = json.loads((out / "runtime.json").read_text())
    step = onnx_step(out / "model.onnx", "float32")
    for prompt, text in zip(prompts, texts):
        tokens = greedy_with_step(step, codec.encode(prompt), 10, (spec["num_layers"], spec["num_kv_heads"],
                                                                    spec["head_dim"]), [], np.float32)
        assert text == codec.decode(tokens), prompt


@pytest.mark.parametrize(("model_type", "scheme"), [("qwen3", "int4"), ("mixtral", "int8")])
def test_families_with_qk_norms_and_experts_export_quantized_and_decode_in_the_engine(model_type, scheme, tmp_path):
    from batchstring.engine.sampling import SamplingParams
    from tests.engine_helpers import engine

    checkpoint = random_checkpoint(tmp_path / "checkpoint", tiny_family_config(model_type), seed=4)
    result = export(checkpoint, tmp_path / "out", "--quantize", scheme)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{scheme} (blocks of 32" in said(result)
    assert "MatMulNBits" in op_types(tmp_path / "out" / "model.onnx")
    eng = engine(tmp_path / "out")
    seqs = [eng.make_sequence(p, SamplingParams(max_tokens=8, ignore_eos=True), lambda out: None)
            for p in ("def f(x):", "class A:", "import sys")]
    eng.generate(seqs)
    assert all(len(s.output_ids) == 8 for s in seqs)


@pytest.fixture(scope="module")
def overfit(tmp_path_factory, model_dir):
    """A tiny Llama trained on the held-out text's first windows until it fits them: at a minimum
    of that text's loss, perturbing the weights raises its perplexity."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.layout import HELDOUT_TEXT

    path = tmp_path_factory.mktemp("overfit")
    ids = TextCodec.from_file(model_dir / "tokenizer.json").encode(HELDOUT_TEXT.read_text())[:2048]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=0, bos_token_id=0)
    model = LlamaForCausalLM(config)
    batch = torch.tensor(ids).reshape(8, 256)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(120):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json")).save_pretrained(path)
    return path


def test_a_quantization_past_its_perplexity_bound_is_refused_and_says_what_to_do(overfit, tmp_path):
    out = tmp_path / "out"
    result = export(overfit, out, "--quantize", "int4", "--max-perplexity-rise", "0.01")
    assert result.returncode == 1, result.stdout + result.stderr
    text = said(result)
    assert "int4 raises perplexity on the held-out text by" in text and "past the 0.01% an export accepts" in text
    assert "--quantize int8" in text and "--force" in text and "nothing was written" in text
    assert not out.exists() or not any(out.iterdir())
    forced = export(overfit, out, "--quantize", "int4", "--max-perplexity-rise", "0.01", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert json.loads((out / "runtime.json").read_text())["quantization"]["bits"] == 4


def test_perplexity_is_the_same_through_either_runtime_and_rises_with_int4(overfit, tmp_path):
    """`batchstring perplexity` on an export: ONNX Runtime and TorchScript agree; the int4 export of
    the fitted model scores its text worse."""
    text = tmp_path / "text.txt"
    from batchstring.export.layout import HELDOUT_TEXT

    text.write_text(HELDOUT_TEXT.read_text()[:12000])
    full, low = tmp_path / "full", tmp_path / "low"
    assert export(overfit, full).returncode == 0
    assert export(overfit, low, "--quantize", "int4", "--force").returncode == 0

    def measured(model: Path, runtime: str) -> float:
        result = subprocess.run([*BATCHSTRING, "perplexity", "--model", str(model), "--text", str(text),
                                 "--runtime", runtime, "--context", "128"], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "windows of 128, second halves scored" in result.stdout
        return float(result.stdout.split()[1])

    onnx, torchscript = measured(full, "onnxruntime"), measured(full, "torchscript")
    assert abs(onnx / torchscript - 1) < 1e-4
    assert measured(low, "onnxruntime") > onnx


def test_perplexity_refuses_what_it_cannot_measure(padded_int8, tmp_path):
    _, out, _ = padded_int8
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    result = subprocess.run([*BATCHSTRING, "perplexity", "--model", str(out), "--text", str(short)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "perplexity needs at least one window of 256" in said(result)
    result = subprocess.run([*BATCHSTRING, "perplexity", "--model", str(out), "--runtime", "torchscript"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "has no model.pt; measure it with the other --runtime" in said(result)
