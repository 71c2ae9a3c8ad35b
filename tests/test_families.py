"""Every decoder family the step exports, each a tiny random checkpoint built with transformers'
own config class (no download) with its family's features switched on (export/synthetic.py):
sliding windows crossed by the verification's pasts, soft-caps, multipliers, q/k norms, partial
and absent rotary, rope scalings. Norm weights and biases are randomised, so that a norm or a bias
in the wrong place changes the logits.

- In process, every family: the eager step and its TorchScript trace against HF's forward
  (logits and new K/V over rows that cross windows, blocks and spans) and HF `generate`; and the
  step in bfloat16 within the 16-bit export rule.
- Through `batchstring export` (ONNX Runtime too) and a real server, families that between them
  bring every feature that changes the graph's operators.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from batchstring.export.family import FAMILIES, UnsupportedModel, family_of
from batchstring.export.synthetic import FAMILY_OPTIONS, random_checkpoint, tiny_family_config
from tests.conftest import BATCHSTRING, export_recipe, made, start_server
from tests.test_export import _NullConsole

EOS = 0
SERVED = ("gemma3_text", "starcoder2", "phi3", "gpt_oss")  # sandwich norms, q/k norm, windows, two rotary
# tables, GELU; LayerNorm with biases and an MLP without a gate; fused projections and partial rotary; experts,
# attention sinks, yarn
SERVED_BY_TORCHSCRIPT = ("olmo2", "granite", "smollm3", "gemma2")  # norms after sublayers, q/k norm over all
# heads; multipliers; layers without rotary; soft-caps


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(model_type)
    config.eos_token_id = EOS
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # norms start at 1 (or 0), biases and sinks at 0: make each one matter
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "sinks")) or "norm" in name:
                parameter.normal_(1.0 if "norm" in name else 0.2, 0.3)
    return model.to(dtype).eval()


def test_the_tiny_checkpoints_bring_their_familys_features():
    """The features the tests rely on are really on (a config default changing would hide them)."""
    from batchstring.export.family import features

    expected = {"mistral": "sliding window 24 on 2/2", "qwen2": "sliding window 24 on 1/2", "qwen3": "rope yarn",
                "olmo2": "q/k norm (all)", "granite": "logits_scaling 8", "smollm3": "no rotary on 1/2",
                "phi3": "partial rotary 0.75", "starcoder2": "sliding window 24 on 2/2",
                "gemma2": "attn_logit_softcapping 50", "gemma3_text": "a rotary table per layer type",
                "llama": "rope llama3", "qwen3_moe": "8 experts, top-2 on 1/2 layers",
                "mixtral": "8 experts, top-2 on 2/2 layers", "gpt_oss": "attention sinks"}
    assert set(expected) == set(FAMILY_OPTIONS) == set(FAMILIES)
    for model_type, feature in expected.items():
        found = ", ".join(features(tiny_model(model_type)))
        assert feature in found, (model_type, found)


@pytest.mark.parametrize("model_type", list(FAMILY_OPTIONS))
def test_each_familys_step_reproduces_the_hf_forward_and_generate(model_type, tmp_path):
    from batchstring.export import artifacts
    from batchstring.export.exporter import _eager, report, torchscript_step
    from batchstring.export.step import DecoderStep
    from batchstring.export.verify import verify_greedy, verify_logits

    model = tiny_model(model_type)
    step = DecoderStep(model, [EOS]).eval()
    artifacts.write_torchscript(step, tmp_path / "model.pt")
    runtimes = {"eager step": _eager(step), "torchscript": torchscript_step(tmp_path / "model.pt", step.dtype,
                                                                                   step.adapter_sites())}
    cases = verify_logits(model, runtimes, [EOS])
    greedy = verify_greedy(model, lambda text: list(text.encode()), [EOS], runtimes)
    worst = report(_NullConsole(), cases, greedy)  # raises past the tolerance or on any greedy difference
    assert max(worst.values()) < 1e-4


@pytest.mark.parametrize("model_type", list(FAMILY_OPTIONS))
def test_each_familys_step_in_bfloat16_stays_within_the_16_bit_rule(model_type):
    from batchstring.export.exporter import _eager
    from batchstring.export.step import DecoderStep
    from batchstring.export.verify import tolerance_failures, verify_logits

    truth, half = tiny_model(model_type), tiny_model(model_type, torch.bfloat16)
    cases = verify_logits(truth, {"eager step": _eager(DecoderStep(half, [EOS]).eval())}, [EOS], relative=True,
                          hf_16bit=half, cases=[(3, 17), (8, 100)])
    assert not tolerance_failures(cases, "bfloat16")


def test_each_expert_computes_only_the_tokens_routed_to_it():
    """Compute follows the routing: over a layer's experts, the rows multiplied add up to tokens x
    top-k (every expert computing every token would make it tokens x experts)."""
    from batchstring.export.step import DecoderStep

    mixture = DecoderStep(tiny_model("mixtral"), [EOS]).layers[0].mixture
    rows: list[int] = []
    for expert in mixture.gate_up:
        expert.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[0]))
    tokens = 40
    with torch.no_grad():
        mixture(torch.randn(1, tokens, 64))
    assert len(rows) == 8 and sum(rows) == tokens * mixture.top_k and max(rows) < tokens


def test_a_wrong_window_is_caught_by_the_verification():
    """The windows are checked, not only present: a window off by one fails the rule."""
    from batchstring.export.exporter import _eager
    from batchstring.export.step import DecoderStep
    from batchstring.export.verify import tolerance_failures, verify_logits

    model = tiny_model("mistral")
    step = DecoderStep(model, [EOS]).eval()
    step.plans = [plan._replace(window=plan.window + 1) for plan in step.plans]
    step.windows = sorted({plan.window for plan in step.plans})
    assert tolerance_failures(verify_logits(model, {"step": _eager(step)}, [EOS], cases=[(3, 100)]), "float32")


@pytest.mark.parametrize(("model_type", "missing"), [("qwen2_moe", "shared experts"), ("phimoe", "sparsemixer"),
                                                      ("gpt2", "not supported")])
def test_families_we_do_not_export_are_refused_naming_what_is_missing(model_type, missing):
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModel, match=missing) as refused:
        family_of(AutoConfig.for_model(model_type))
    assert "gemma3_text" in str(refused.value), "the refusal lists what is supported"


def test_rope_that_changes_with_the_sequence_is_refused():
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModel, match="dynamic"):
        family_of(config)


# ----- exported and served ---------------------------------------------------------------------


SIXTEEN_BITS = [("gemma2", "float16"), ("mixtral", "bfloat16")]


def family_recipe(model_type: str, dtype: str, seed: int):
    """`batchstring export --dtype dtype` of a tiny random `model_type` (tests/conftest.py: exports)."""
    def recipe(root: Path) -> list[str]:
        checkpoint = random_checkpoint(root / "checkpoint", tiny_family_config(model_type), seed=seed)
        return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export"), "--dtype", dtype]
    return recipe


for served in SERVED:
    export_recipe(f"{served}-float32", family_recipe(served, "float32", seed=1), family_export=served)
for sixteen, bits in SIXTEEN_BITS:
    export_recipe(f"{sixteen}-{bits}", family_recipe(sixteen, bits, seed=2), model_type=sixteen, dtype=bits)


@pytest.fixture(scope="module", params=SERVED + SERVED_BY_TORCHSCRIPT)
def family_export(request, exports, tmp_path_factory) -> tuple[str, Path, Path, dict[str, str]]:
    """(model_type, checkpoint, export, the engine's parameters): `batchstring export` and ONNX
    Runtime for SERVED; for the others, the TorchScript step and the model files written in
    process (verified in process above), served by TorchScript: tracing ONNX takes ~45 s a family."""
    model_type = request.param
    if model_type in SERVED_BY_TORCHSCRIPT:
        from batchstring.export import artifacts
        from batchstring.export.exporter import decoder_step, load_checkpoint, write_model_files

        checkpoint = tmp_path_factory.mktemp(f"{model_type}-checkpoint")
        random_checkpoint(checkpoint, tiny_family_config(model_type), seed=1)
        out = tmp_path_factory.mktemp(f"{model_type}-export")
        model = load_checkpoint(checkpoint)
        step, eos = decoder_step(model, checkpoint)
        artifacts.write_torchscript(step, out / "model.pt")
        write_model_files(step, model, eos, checkpoint, out)
        return model_type, checkpoint, out, {"runtime": "torchscript"}
    root, stdout = made(exports, f"{model_type}-float32")
    assert f"{model_type}:" in stdout and "onnxruntime" in stdout
    return model_type, root / "checkpoint", root / "export", {}


def test_a_familys_greedy_tokens_through_a_real_server_equal_hf_generate(request, family_export, tmp_path_factory):
    """`/v1/completions` on the exported family, greedy, past the window: the text HF `generate`'s
    tokens make."""
    import openai
    from transformers import AutoModelForCausalLM

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.server.repository import repository_for

    model_type, checkpoint, exported, params = family_export
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    codec = TextCodec.from_file(checkpoint / "tokenizer.json")
    repository = repository_for(exported, tmp_path_factory.mktemp(f"{model_type}-repository"))
    server = start_server(request, f"family-{model_type}", config="cpu", repository=repository, params=params)
    api = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    for prompt in ("def parse(text):\n    return", "The quick brown fox"):
        ids = codec.encode(prompt)
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                                   eos_token_id=hf.config.eos_token_id,
                                   pad_token_id=hf.config.eos_token_id)[0, len(ids):].tolist()
        done = api.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0,
                                      extra_body={"min_tokens": 40})
        assert done.choices[0].text == codec.decode(expected), (model_type, prompt)


def test_a_familys_export_quantizes_and_the_engine_decodes_what_its_step_does(family_export, tmp_path):
    """`batchstring quantize int4` on each family's ONNX export (q/k norms, experts, fused
    projections, LayerNorm with biases): MatMulNBits in the graph, measured against the export, and
    the engine's greedy tokens are the quantized step's own. An export with the TorchScript step
    only is refused, saying what to make instead."""
    import json

    import numpy as np
    import onnx

    from batchstring.engine.sampling_params import SamplingParams
    from batchstring.export.exporter import onnx_step
    from batchstring.export.verify import greedy_with_step
    from tests.engine_helpers import engine

    model_type, _, exported, _ = family_export
    out = tmp_path / "int4"
    result = subprocess.run([*BATCHSTRING, "quantize", "int4", "--model", str(exported), "--out", str(out),
                             "--force"], capture_output=True, text=True, timeout=300)
    if model_type in SERVED_BY_TORCHSCRIPT:
        assert result.returncode == 1 and "is not an ONNX export" in result.stderr, result.stderr
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matrix multiplies quantized" in result.stdout and "greedy identical to it for" in result.stdout
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    spec = json.loads((out / "runtime.json").read_text())
    eng = engine(out)
    seq = eng.make_sequence("def parse(text):", SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                              lambda o: None)
    eng.generate([seq])
    kv_shape = (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"])
    assert seq.output_ids == greedy_with_step(onnx_step(out / "model.onnx", "float32"), seq.prompt_ids, 10, kv_shape,
                                              [], np.float32), model_type


def test_blocks_outside_every_window_are_given_up_and_the_tokens_stay_hfs(family_export):
    """Where every layer has a window (StarCoder2 here), a long generation holds only the blocks
    the window reaches; what it gives up is not read again: its tokens are still HF's."""
    from transformers import AutoModelForCausalLM

    from batchstring.engine.sampling_params import SamplingParams
    from tests.engine_helpers import engine

    _, checkpoint, exported, params = family_export
    eng = engine(exported, block_size=4, kv_cache_tokens=512, **params)
    blocks, step = eng.scheduler.blocks, eng.runner.step
    held: list[int] = []

    def watched(batch):
        held.append(blocks.num_blocks - blocks.num_free)
        return step(batch)

    eng.runner.step = watched
    params = SamplingParams(max_tokens=80, min_tokens=80, temperature=0.0)
    seq = eng.make_sequence("def parse(text):\n    return", params, lambda out: None)
    eng.generate([seq])
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([seq.prompt_ids]), max_new_tokens=80, min_new_tokens=80, do_sample=False,
                               eos_token_id=hf.config.eos_token_id, pad_token_id=hf.config.eos_token_id)
    assert seq.output_ids == expected[0, len(seq.prompt_ids):].tolist()
    total = -(-(len(seq.prompt_ids) + 80) // 4)
    if eng.spec.window is None:
        assert max(held) >= total - 1, "nothing is given up while a layer reads the whole past"
    else:
        assert max(held) <= eng.spec.window // 4 + 3 < total, (held, total)


@pytest.mark.parametrize(("model_type", "dtype"), SIXTEEN_BITS)
def test_a_family_exports_in_16_bits(model_type, dtype, exports):
    """`batchstring export --dtype` 16 bits: soft-caps in float16 (ONNX Runtime runs it here),
    experts in bfloat16 (the ONNX graph checked structurally; TorchScript run)."""
    _, stdout = made(exports, f"{model_type}-{dtype}")
    assert "exported and verified" in stdout and "torchscript" in stdout
    said = " ".join(stdout.split())
    assert ("onnxruntime: greedy" in said) == (dtype == "float16")
    assert ("structure was checked" in said) == (dtype == "bfloat16")
