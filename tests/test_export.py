"""Export round trip on a tiny random Llama (the path users take with their own checkpoints)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.export.exporter import onnx_adapter_sites, torch_arguments
from batchstring.export.layout import DEFAULT_MODEL_DIR
from batchstring.export.source import resolve
from batchstring.export.step import DecoderStep
from batchstring.export.verify import VerificationError
from tests.conftest import BATCHSTRING, export_recipe, made


def make_tiny_checkpoint(path: Path) -> Path:
    """2 layers, hidden 64, grouped-query attention (4 query heads, 2 kv heads), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=0, bos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json")).save_pretrained(path)
    return path


def tiny_recipe(root: Path) -> list[str]:
    """The default export of `make_tiny_checkpoint` (tests/conftest.py: exports)."""
    checkpoint = make_tiny_checkpoint(root / "checkpoint")
    return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export")]


HUB_ID = "batchstring-tests/tiny-llama3"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cached(checkpoint: Path, hf_home: Path, repo_id: str) -> None:
    """`checkpoint` as a Hub repository's snapshot in the Hugging Face cache at `hf_home`, in the
    layout huggingface_hub documents (hub/models--OWNER--NAME/refs/main names the snapshot), as a
    download leaves it: HF_HUB_OFFLINE=1 then resolves the id there, as on a machine without network."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    shutil.copytree(checkpoint, repo / "snapshots" / HUB_COMMIT)


def llama3_style_recipe(root: Path) -> list[str]:
    """`make_tiny_checkpoint` with a Llama-3-style generation config (several EOS ids, sampling
    defaults), read by its Hub id from the Hugging Face cache, exported in bfloat16 into a
    directory an earlier float32 export left a small-step graph in."""
    checkpoint = make_tiny_checkpoint(root / "checkpoint")
    (checkpoint / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [0, 5, 7], "bos_token_id": 0, "do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    hub_cached(checkpoint, root / "hf-home", HUB_ID)
    (root / "export").mkdir()
    (root / "export" / "model.small.onnx").write_bytes(b"an earlier float32 export's small-step graph")
    return ["env", f"HF_HOME={root / 'hf-home'}", "HF_HUB_OFFLINE=1", *BATCHSTRING, "export", "--model", HUB_ID,
            "--out", str(root / "export"), "--dtype", "bfloat16"]


export_recipe("tiny", tiny_recipe)
export_recipe("tiny-bfloat16", llama3_style_recipe)


@pytest.fixture(scope="module")
def exported_tiny(exports) -> tuple[Path, str]:
    root, stdout = made(exports, "tiny")
    return root / "export", stdout


@pytest.fixture(scope="module")
def tiny_checkpoint(exported_tiny) -> Path:
    return exported_tiny[0].parent / "checkpoint"


def test_export_writes_the_repository_files_and_prints_the_table(exported_tiny):
    out, stdout = exported_tiny
    assert {"model.onnx", "model.pt", "tokenizer.json", "tokenizer_config.json", "runtime.json"} <= \
        {p.name for p in out.iterdir()}
    spec = json.loads((out / "runtime.json").read_text())
    assert spec["dtype"] == "float32" and spec["sampling_defaults"] == {}
    for stage in ("[1/4] load", "[2/4] trace and save ONNX", "[3/4] trace and save TorchScript", "[4/4] verify each"):
        assert stage in stdout and "peak memory" in stdout, stage
    assert (spec["num_layers"], spec["num_kv_heads"], spec["head_dim"], spec["context_length"]) == (2, 2, 16, 256)
    assert "max |Δ|" in stdout and "greedy 32 tokens" in stdout and "exported and verified" in stdout


def test_dynamic_axes_are_really_dynamic(exported_tiny, tiny_checkpoint):
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM

    from batchstring.export.verify import Row, Sampling, pack

    out, _ = exported_tiny
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    step = DecoderStep(AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager"), [0]).eval()
    rng = np.random.default_rng(0)
    n = 60  # blocks of 3 tokens: a block size never seen at export time either
    blocks = rng.permutation(n)
    # shapes never seen at export time: 3 decode rows, 4 prefill rows of 2..9 new tokens, pasts up to 33
    lengths = [(33, 1), (0, 1), (17, 1), (5, 9), (0, 2), (33, 4), (1, 7)]
    rows, used = [], 0
    for i, (past, new) in enumerate(lengths):
        rows.append(Row(rng.integers(0, 4096, new).tolist(), blocks[used : used + -(-past // 3)].tolist(), past,
                        Sampling(temperature=float(i % 2), uniform=0.5)))
        used += -(-past // 3)
    inputs, held = pack(rows, rng.standard_normal((2, 2, n, 3, 16)).astype(np.float32),
                        rng.standard_normal((2, 2, n, 3, 16)).astype(np.float32), sites=step.adapter_sites())
    outputs = session.run(None, inputs.feeds(held))
    with torch.no_grad():
        ref = step(*torch_arguments(inputs, held))
    tokens = sum(new for _, new in lengths)
    assert outputs[4].shape == (7, 4096) and outputs[5].shape == (2, 2, tokens, 16)
    assert np.abs(outputs[4] - ref[4].numpy()).max() < 1e-4
    assert (outputs[0] == ref[0].numpy()).all()


def test_the_small_step_graph_computes_a_small_steps_packing_as_the_full_graph_with_fewer_operators(exported_tiny):
    """Decode rows among prefill rows, every row in the prefill group (as the engine packs a step
    of at most SMALL_STEP_TOKENS tokens): the single-group graph agrees with the two-group one."""
    import onnx
    import onnxruntime as ort

    from batchstring.export.layout import SMALL_STEP_GRAPH
    from batchstring.export.verify import Row, Sampling, pack

    out, stdout = exported_tiny
    assert "onnxruntime, small steps: greedy identical" in " ".join(stdout.split()), "verified at export"
    full, small = (ort.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])
                   for name in ("model.onnx", SMALL_STEP_GRAPH))
    nodes = {name: len(onnx.load(str(out / name)).graph.node) for name in ("model.onnx", SMALL_STEP_GRAPH)}
    assert nodes[SMALL_STEP_GRAPH] < 0.85 * nodes["model.onnx"], nodes
    rng = np.random.default_rng(1)
    rows = [Row(rng.integers(0, 4096, new).tolist(), list(range(start, start + -(-past // 4))), past,
                Sampling(temperature=t, uniform=0.4))
            for (past, new, start, t) in ((40, 1, 0, 0.0), (3, 5, 12, 1.0), (0, 1, 14, 0.0), (12, 2, 16, 0.8))]
    caches = [rng.standard_normal((2, 2, 25, 4, 16)).astype(np.float32) for _ in range(2)]
    inputs, held = pack(rows, *caches, single_group=True, sites=onnx_adapter_sites(full))
    assert inputs.decode_tokens.shape[0] == 0 and inputs.prefill_tokens.shape == (4, 5)
    ours, theirs = small.run(None, inputs.feeds(held)), full.run(None, inputs.feeds(held))
    assert (ours[0] == theirs[0]).all() and np.abs(ours[4] - theirs[4]).max() < 1e-5
    assert np.abs(ours[5] - theirs[5]).max() < 1e-5
    two_groups = full.run(None, pack(rows, *caches)[0].feeds(held))
    assert (two_groups[0] == ours[0]).all() and np.abs(two_groups[4] - ours[4]).max() < 1e-4


def test_verification_catches_perturbed_weights(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from batchstring.export.exporter import _eager, report
    from batchstring.export.verify import verify_logits

    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        perturbed.model.layers[1].mlp.down_proj.weight.add_(1e-2)
    cases = verify_logits(reference, {"perturbed step": _eager(DecoderStep(perturbed, [0]).eval())}, [0])
    with pytest.raises(VerificationError, match="does not match"):
        report(_NullConsole(), cases, {"def ": {"perturbed step": True}})


def test_unsupported_architectures_are_refused_with_the_reason(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    command = [*BATCHSTRING, "export", "--model", str(tmp_path), "--out", str(tmp_path / "o")]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "'gpt2' is not supported" in out.stderr and "llama" in out.stderr
    assert not (tmp_path / "o").exists()


class _NullConsole:
    def print(self, *args, **kwargs) -> None:
        pass

    def status(self, *args, **kwargs):
        raise AssertionError("not used")


def test_a_bfloat16_export_records_its_dtype_the_checkpoints_eos_ids_and_sampling_defaults(exports):
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.core import EngineCore
    from batchstring.engine.sampling_params import SamplingParams

    root, stdout = made(exports, "tiny-bfloat16")
    out = root / "export"
    text = " ".join(stdout.split())
    assert not (out / "model.small.onnx").exists(), "a 16-bit export (for GPUs) has none, and leaves no stale one"
    spec = json.loads((out / "runtime.json").read_text())
    source = f"{HUB_ID}@{HUB_COMMIT}"  # the commit the id resolved to, so the export traces back to it
    assert spec["source"] == source and f"load {source} in bfloat16" in text, "read by its Hub id"
    assert spec["dtype"] == "bfloat16" and spec["eos_token_ids"] == [0, 5, 7]
    assert spec["sampling_defaults"]["temperature"] == 0.6 and spec["sampling_defaults"]["top_p"] == 0.9
    assert "HF itself" in text and "at least 0.05" in text and "greedy identical for" in text
    assert "structure was checked" in text, "ONNX Runtime's CPU provider has no bfloat16 kernels: checked structurally"
    engine = EngineCore(EngineConfig(model_dir=out, runtime="torchscript", kv_cache_tokens=1024))
    assert engine.runner.keys.dtype == torch.bfloat16, "the KV cache is in the export's dtype"
    seq = engine.make_sequence("def f(x):", SamplingParams(max_tokens=12, temperature=0), lambda o: None)
    engine.generate([seq])
    assert 0 < len(seq.output_ids) <= 12 and not set(seq.output_ids[:-1]) & {0, 5, 7}, "any EOS id ends it"


def test_a_hub_id_that_cannot_be_downloaded_or_a_revision_of_a_directory_is_refused_saying_what_to_do(tmp_path):
    offline = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([*BATCHSTRING, "export", "--model", "batchstring-tests/not-cached", "--out",
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=offline)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1 and "downloading it from the Hugging Face Hub failed" in said, said
    assert "`hf download batchstring-tests/not-cached --local-dir DIR`, and pass --model DIR" in said
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="--revision picks a version of a Hugging Face Hub id"):
        resolve(DEFAULT_MODEL_DIR, revision="main")
    assert resolve(DEFAULT_MODEL_DIR).path == DEFAULT_MODEL_DIR.resolve()
    assert resolve("./batchstring-tests/not-cached").path == Path("batchstring-tests/not-cached").resolve(), \
        "a path that names a directory is never sent to the Hub"


def test_a_hub_download_takes_only_the_files_an_export_reads():
    """The patterns snapshot_download is given, applied by huggingface_hub's own filter to a
    repository's files: the root's configs, shards and tokenizer; not other formats, subfolders'
    models or Mistral's second copy of the weights."""
    from huggingface_hub.utils import filter_repo_objects

    from batchstring.export.source import CHECKPOINT_FILES, SKIPPED_FILES

    wanted = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    others = ["pytorch_model.bin", "model.gguf", "onnx/model.safetensors", "consolidated.safetensors",
              "original/params.json", "README.md"]
    assert list(filter_repo_objects(wanted + others, allow_patterns=CHECKPOINT_FILES,
                                    ignore_patterns=SKIPPED_FILES)) == wanted


def _op_types(graph) -> set[str]:
    """Every operator of an ONNX graph, its branches' included."""
    found = set()
    for node in graph.node:
        found.add(node.op_type)
        for attr in node.attribute:
            if attr.g.node:
                found |= _op_types(attr.g)
    return found


def test_a_plain_greedy_step_skips_the_sampling_head_and_picks_what_the_whole_head_picks(exported_tiny):
    """The ONNX step branches (one `If`) to an argmax when no row samples, wants log-probabilities
    or has an adjustment, and within it (a second `If`) to a bare argmax unless a row has EOS
    banned or follows a grammar; the TorchScript trace always runs the whole head. Both must pick
    the same tokens, on every side of the branches."""
    import onnx
    import onnxruntime as ort

    from batchstring.export.verify import Row, Sampling, pack

    out, _ = exported_tiny
    graph = onnx.load(str(out / "model.onnx")).graph
    (branch,) = [node for node in graph.node if node.op_type == "If"]
    ops = {attr.name: _op_types(attr.g) for attr in branch.attribute}
    assert "ArgMax" in ops["then_branch"] and not {"TopK", "CumSum"} & ops["then_branch"], ops
    assert {"TopK", "CumSum"} <= ops["else_branch"], ops
    (inner,) = [node for node in branch.attribute[0].g.node if node.op_type == "If"]
    greedy = {attr.name: _op_types(attr.g) for attr in inner.attribute}
    assert "ScatterND" not in greedy["then_branch"] and "ArgMax" in greedy["else_branch"], greedy
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    traced = torch.jit.load(str(out / "model.pt"))
    rng = np.random.default_rng(2)
    caches = [rng.standard_normal((2, 2, 20, 4, 16)).astype(np.float32) for _ in range(2)]
    plain = [Row(rng.integers(0, 4096, new).tolist(), list(range(start, start + -(-past // 4))), past)
             for past, new, start in ((20, 1, 0), (0, 6, 5), (9, 1, 6), (4, 3, 9))]
    neutral = {"adjust_rows": np.array([1]), "adjust_tokens": np.array([7]), "adjust_bias": np.zeros(1, np.float32),
               "adjust_scale": np.ones(1, np.float32), "adjust_shift": np.zeros(1, np.float32)}
    banned = [Row(r.new_ids, r.blocks, r.past, Sampling(ban_eos=i == 2)) for i, r in enumerate(plain)]
    allow_all = {"mask_rows": np.array([3]), "token_mask": np.full((1, 4096 // 32), -1, np.int32)}
    logprobs_only = {"sample_rows": np.array([0]), "temperature": np.zeros(1, np.float32),
                     "top_k": np.zeros(1, np.int64), "top_p": np.ones(1, np.float32),
                     "uniform": np.ones(1, np.float32), "min_p": np.zeros(1, np.float32)}
    inputs, held = pack(plain, *caches, sites=onnx_adapter_sites(session))
    cases = [inputs, inputs.replace(**neutral), pack(banned, *caches)[0], inputs.replace(**allow_all),
             inputs.replace(**logprobs_only)]
    for i, case in enumerate(cases):
        ours = session.run(None, case.feeds(held))
        with torch.no_grad():
            theirs = [t.numpy() for t in traced(*torch_arguments(case, held))]
        assert (ours[0] == theirs[0]).all()
        assert ours[2].shape == theirs[2].shape == (len(case.sampling.sample_rows), theirs[2].shape[1]), i
        assert (ours[2] == theirs[2]).all() and np.allclose(ours[3], theirs[3], atol=1e-4)
        assert np.abs(ours[4] - theirs[4]).max() < 1e-4
    assert cases[0].sampling.sample_rows.size == 0 and ours[2].shape[0] == 1  # both sides of the branch were taken


def test_the_exported_files_hold_each_weight_once(exported_tiny, tiny_checkpoint):
    """The step fuses q/k/v and gate/up into one projection each; the fused copies replace the
    checkpoint's modules in what is saved, so the files are no larger than the checkpoint."""
    import onnx
    from transformers import AutoModelForCausalLM

    out, _ = exported_tiny
    checkpoint = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).num_parameters()
    traced = torch.jit.load(str(out / "model.pt"))
    assert sum(p.numel() for p in traced.parameters()) == checkpoint
    initializers = onnx.load(str(out / "model.onnx")).graph.initializer
    large = sum(int(np.prod(t.dims)) for t in initializers
                if t.data_type == onnx.TensorProto.FLOAT and np.prod(t.dims) >= 64 * 64)
    assert checkpoint * 0.99 <= large <= checkpoint


@pytest.mark.parametrize("family", ["qwen2", "llama with biases"])
def test_fused_projections_keep_the_checkpoints_biases(family):
    """q/k/v and gate/up fuse into one projection each; a bias on any part (Qwen2's q/k/v, Llama's
    attention_bias / mlp_bias) must land on its own outputs and nowhere else."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from batchstring.export.exporter import _eager, report
    from batchstring.export.verify import verify_logits

    torch.manual_seed(3)
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, eos_token_id=0, bos_token_id=0)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="eager"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape, attention_bias=True, mlp_bias=True, attn_implementation="eager"))
    with torch.no_grad():  # biases start at zero: make each one matter
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.5)
    model.eval()
    biases = {name.split(".")[-2] for name, _ in model.named_parameters() if name.endswith(".bias")}
    assert {"q_proj", "k_proj", "v_proj"} <= biases
    cases = verify_logits(model, {"step": _eager(DecoderStep(model, [0]).eval())}, [0])
    assert max(report(_NullConsole(), cases, {"def ": {"step": True}}).values()) < 1e-4


def test_greedy_agreement_is_judged_up_to_the_first_near_tie():
    """Past a near-tie either of HF's top two is right, and the continuation may differ after it;
    before it every token must be HF's."""
    from batchstring.export.verify import GreedyReference

    tied = GreedyReference([1], tokens=[5, 6, 7, 8], first_tie=2, runner_up=9)
    assert tied.agrees([5, 6, 7, 8]) and tied.agrees([5, 6, 9, 3]) and tied.agrees([5, 6, 7, 1])
    assert not tied.agrees([5, 4, 7, 8]) and not tied.agrees([5, 6, 3, 8])
    untied = GreedyReference([1], tokens=[5, 6, 7], first_tie=None, runner_up=None)
    assert untied.agrees([5, 6, 7]) and not untied.agrees([5, 6, 8])


def test_the_export_verifies_one_runtime_at_a_time(tiny_checkpoint):
    """Each runtime is loaded when its turn comes and freed before the next: a real-size float32
    model's copies would not fit side by side."""
    import gc

    from batchstring.engine.tokenizer import TextCodec
    from batchstring.export.exporter import _eager, _verify_each, load_checkpoint

    model = load_checkpoint(tiny_checkpoint)
    step = DecoderStep(model, [0]).eval()
    alive, most = [], []

    class Runtime:
        def __init__(self) -> None:
            gc.collect()
            alive.append(1)
            most.append(len(alive))
            self.run = _eager(step)

        def __call__(self, inputs, held):
            return self.run(inputs, held)

        def __del__(self) -> None:
            alive.pop()

    loaders = {name: Runtime for name in ("a", "b", "c")}
    codec = TextCodec.from_file(tiny_checkpoint / "tokenizer.json")
    cases, greedy = _verify_each(loaders, model, model, codec.encode, [0], "float32")
    assert max(most) == 1 and not alive
    assert set(cases[0].max_diff) == {"a", "b", "c"} and all(set(ok) == {"a", "b", "c"} for ok in greedy.values())
    assert max(c.max_diff["c"] for c in cases) < 1e-4


def test_serve_model_refuses_a_directory_that_is_not_an_export(tiny_checkpoint):
    result = subprocess.run([*BATCHSTRING, "serve", "--model", str(tiny_checkpoint)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0
    said = " ".join(result.stderr.split())
    assert "is not an export (it lacks runtime.json, model.onnx or model.pt)" in said, said
    assert "batchstring export --model CHECKPOINT --out" in said


def test_the_contract_is_the_exported_graphs_and_the_docs(exported_tiny):
    """export/contract.py names every input and output of both ONNX graphs, in order, with their
    dtypes and dynamic axes; export/README.md shows its tables as `markdown()` renders them."""
    import onnx

    from batchstring.export.contract import INPUTS, MODEL_DTYPE, OUTPUTS, STATIC_DIMS, markdown
    from batchstring.export.layout import REPO_ROOT

    out, _ = exported_tiny
    types = {"int64": onnx.TensorProto.INT64, "int32": onnx.TensorProto.INT32, "bool": onnx.TensorProto.BOOL,
             "float32": onnx.TensorProto.FLOAT, MODEL_DTYPE: onnx.TensorProto.FLOAT}
    for graph in ("model.onnx", "model.small.onnx"):
        model = onnx.load(str(out / graph), load_external_data=False).graph
        for declared, actual in ((INPUTS, model.input), (OUTPUTS, model.output)):
            assert [t.name for t in declared] == [v.name for v in actual], graph
            for tensor, value in zip(declared, actual):
                assert value.type.tensor_type.elem_type == types[tensor.dtype], tensor.name
                dims = value.type.tensor_type.shape.dim
                assert len(dims) == len(tensor.dims), tensor.name
                for dim, name in zip(dims, tensor.dims):  # a dynamic name stays a name; a number a number
                    if isinstance(name, int):
                        assert dim.dim_value == name, tensor.name
                    elif name not in STATIC_DIMS and declared is INPUTS:
                        assert dim.dim_param, (tensor.name, name)
    assert markdown() in (REPO_ROOT / "export" / "README.md").read_text()
