"""LoRA adapters made by `peft` on tiny random checkpoints, served beside their base model: each
adapter row's greedy tokens are those of `peft`'s merged model (`merge_and_unload`), with several
adapters and the base mixed in one step, in both runtimes and through a real server."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from batchstring.engine.sampling_params import SamplingParams
from batchstring.export.synthetic import random_checkpoint, tiny_family_config
from tests.conftest import BATCHSTRING, export_recipe, made, serve, stop
from tests.engine_helpers import engine

TOKENS = 12
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = ("def parse(text):\n    return", "The quick brown fox jumps over the lazy dog " * 3, "import os\n")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ADAPTERS = {  # name -> LoraConfig's arguments: attention only; every projection with rsLoRA; q/v of a higher rank
    "attn": {"r": 8, "lora_alpha": 16, "target_modules": ATTENTION},
    "all": {"r": 4, "lora_alpha": 8, "use_rslora": True,
            "target_modules": [*ATTENTION, "gate_proj", "up_proj", "down_proj"]},
    "qv": {"r": 16, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
}


def make_adapter(checkpoint: Path, out: Path, seed: int, **lora) -> Path:
    """A PEFT LoRA adapter of `checkpoint` with random A and B (`init_lora_weights=False`: not a
    no-op), saved as `peft` saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():  # large enough to change greedy tokens of a random model
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(4.0)
    peft_model.save_pretrained(out)
    return out


@functools.cache
def merged_model(checkpoint: Path, adapter: Path | None):
    """The base model, or `peft`'s merge of it with `adapter` (the files a test made; never changed)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


@functools.cache
def _merged_greedy(checkpoint: Path, adapter: Path | None, prompt_ids: tuple[int, ...], vocab: int) -> list[int]:
    model = merged_model(checkpoint, adapter)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1, :vocab]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def merged_greedy(checkpoint: Path, adapter: Path | None, prompt_ids: list[int], vocab: int) -> list[int]:
    """Greedy tokens of the base model, or of `peft`'s merge of it with `adapter`, over the ids the
    step samples from (the tokenizer's)."""
    return list(_merged_greedy(checkpoint, adapter, tuple(prompt_ids), vocab))


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}  # Phi-3's checkpoints fuse these: PEFT targets the fused modules


@pytest.fixture(scope="module", params=["llama", "qwen3", "phi3"])
def adapted(request, tmp_path_factory) -> tuple[Path, Path, dict[str, Path]]:
    """(checkpoint, export with the TorchScript step, adapters by name) of a family: Llama, Qwen3
    (q/k norms after the adapted projection) and Phi-3 (fused q/k/v and gate/up modules)."""
    from batchstring.export import artifacts
    from batchstring.export.exporter import decoder_step, load_checkpoint, write_model_files

    family = request.param
    checkpoint = random_checkpoint(tmp_path_factory.mktemp(f"{family}-checkpoint"), tiny_family_config(family),
                                   seed=3)
    out = tmp_path_factory.mktemp(f"{family}-export")
    model = load_checkpoint(checkpoint)
    step, eos = decoder_step(model, checkpoint, adapters=True)
    artifacts.write_torchscript(step, out / "model.pt")
    write_model_files(step, model, eos, checkpoint, out)
    root = tmp_path_factory.mktemp(f"{family}-adapters")
    adapters = {}
    for seed, (name, lora) in enumerate(ADAPTERS.items()):
        if family == "phi3":
            lora = {**lora, "target_modules": sorted({FUSED.get(m, m) for m in lora["target_modules"]})}
        adapters[name] = make_adapter(checkpoint, root / name, seed, **lora)
    return checkpoint, out, adapters


def listing(adapters: dict[str, Path]) -> str:
    return ",".join(f"{name}={path}" for name, path in adapters.items())


def test_rows_of_several_adapters_and_the_base_in_one_step_each_get_their_merged_models_tokens(adapted):
    checkpoint, exported, adapters = adapted
    eng = engine(exported, runtime="torchscript", adapters=listing(adapters), block_size=4)
    vocab = eng.spec.vocab_size
    choices = [None, *adapters]
    seqs = [eng.make_sequence(prompt, GREEDY, lambda o: None, adapter=name)
            for prompt in PROMPTS for name in choices]
    steps = []
    original = eng.runner.step
    eng.runner.step = lambda batch: steps.append({w.seq.adapter_slot for w in batch.work}) or original(batch)
    eng.generate(seqs)
    assert any(len(slots) == len(choices) for slots in steps), "base rows and every adapter shared a step"
    expected = {}
    for seq, (prompt, name) in zip(seqs, [(p, n) for p in PROMPTS for n in choices]):
        key = (tuple(seq.prompt_ids), name)
        expected[key] = expected.get(key) or merged_greedy(checkpoint, adapters.get(name), seq.prompt_ids, vocab)
        assert seq.output_ids == expected[key], (prompt, name)
    for prompt in PROMPTS:  # the adapters change the model: a test of tokens that could not tell them apart is none
        assert len({tuple(expected[p, n]) for p, n in expected if list(p) == eng.codec.encode(prompt)}) > 1


def test_more_adapters_than_slots_wait_for_a_slot_and_two_adapters_never_share_cached_blocks(adapted):
    checkpoint, exported, adapters = adapted
    eng = engine(exported, runtime="torchscript", adapters=listing(adapters), max_adapters=1, block_size=4)
    prompt = PROMPTS[1]  # several full blocks: cached, and findable by a later request
    seqs = [eng.make_sequence(prompt, GREEDY, lambda o: None, adapter=name) for name in (*adapters, "attn")]
    resident = []
    original = eng.runner.step
    eng.runner.step = lambda batch: resident.append(len(eng.adapters.resident)) or original(batch)
    eng.generate(seqs)
    assert max(resident) == 1, "one slot: the adapters took turns"
    for seq in seqs:
        name = seq.adapter.name
        assert seq.output_ids == merged_greedy(checkpoint, adapters[name], seq.prompt_ids, eng.spec.vocab_size), name
    by_name = {seq.adapter.name: set(seq.block_keys) for seq in seqs[:-1]}
    assert all(by_name.values()) and not by_name["attn"] & by_name["all"] and not by_name["all"] & by_name["qv"]
    assert set(seqs[-1].block_keys) == by_name["attn"], "the same prompt under the same adapter shares its blocks"


@pytest.mark.parametrize("adapted", ["llama"], indirect=True)  # the mechanisms are the engine's, not a family's
def test_adapter_rows_keep_their_tokens_through_preemption_drafts_seeds_and_grammars(adapted):
    """A cache too small for every row (preemption and recomputation), n-gram drafts on repetitive
    prompts, seeded sampling and a grammar, on rows of several adapters: each row's tokens are
    what it gets alone with a roomy cache and no drafts."""
    import json

    from batchstring.engine.sampling_params import parse_sampling_parameters

    _, exported, adapters = adapted
    names = [None, *adapters]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)  # long enough to repeat itself: drafts
    seeded = SamplingParams(max_tokens=TOKENS, temperature=0.9, seed=7, ignore_eos=True)
    regex = parse_sampling_parameters(json.dumps({"max_tokens": TOKENS, "temperature": 0, "regex": "(ab|cd)+x"}),
                                      256, 16)
    requests = [(p, name, params) for p in PROMPTS for name in names for params in (long, seeded, regex)]

    def run(eng) -> list[list[int]]:
        seqs = [eng.make_sequence(prompt, params, lambda o: None, adapter=name) for prompt, name, params in requests]
        eng.generate(seqs)
        return [s.output_ids for s in seqs]

    common = {"runtime": "torchscript", "adapters": listing(adapters), "block_size": 4}
    alone = [run(engine(exported, **common, speculative_tokens=0))[i] for i in range(len(requests))]
    crowded = engine(exported, **common, kv_cache_tokens=320, max_num_seqs=16)
    assert run(crowded) == alone
    assert crowded.stats.preemptions > 0 and crowded.stats.speculation.drafted > 0, "both were exercised"
    codec, eos = crowded.codec, set(crowded.spec.eos_token_ids)
    matched = "(ab|cd)+x|(ab|cd)*[ac]?"  # the grammar's whole language, or a prefix of it (max_tokens cut it)
    assert all(re.fullmatch(matched, codec.decode([t for t in out if t not in eos]))
               for out, (_, _, params) in zip(alone, requests) if params is regex)


@pytest.mark.parametrize("adapted", ["llama"], indirect=True)
def test_an_adapter_that_does_not_fit_the_model_is_refused_with_what_differs(adapted, tmp_path):
    from batchstring.engine.adapters import AdapterError, BaseShape, UnknownAdapter, load_adapter
    from batchstring.engine.runner import RuntimeSpec

    _, exported, adapters = adapted
    base = BaseShape.of(RuntimeSpec.load(exported / "runtime.json"))
    narrower = tiny_family_config("llama")
    narrower.hidden_size = 48
    other = random_checkpoint(tmp_path / "other", narrower, seed=1)
    wrong = make_adapter(other, tmp_path / "wrong", 0, r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterError, match=r"adapter 'wrong'.*q_proj has A \[4, 48\].*wants A \[r, 64\]"):
        load_adapter("wrong", wrong, BaseShape(base.layers, base.sites, base.parts, ""), "float32")
    with pytest.raises(AdapterError, match="was trained on 'other'"):
        load_adapter("wrong", wrong, base, "float32")
    broken = tmp_path / "broken"
    shutil.copytree(adapters["attn"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match=r"cannot read adapter_config\.json and adapter_model\.safetensors"):
        load_adapter("broken", broken, base, "float32")
    eng = engine(exported, runtime="torchscript", adapters=listing(adapters))
    with pytest.raises(UnknownAdapter, match="'nope' is not served here; served adapters: all, attn, qv"):
        eng.make_sequence("x", GREEDY, lambda o: None, adapter="nope")


# ----- through a real server (ONNX Runtime) ------------------------------------------------------


@dataclass(frozen=True)
class Served:
    grpc_url: str
    http_url: str
    checkpoint: Path
    adapters: dict[str, Path]
    watched: Path
    exported: Path


def adapters_recipe(root: Path) -> list[str]:
    """`batchstring export --adapters` of a tiny Llama (tests/conftest.py: exports)."""
    checkpoint = random_checkpoint(root / "checkpoint", tiny_family_config("llama"), seed=3)
    return [*BATCHSTRING, "export", "--model", str(checkpoint), "--out", str(root / "export"), "--adapters",
            "--dtype", "float32"]


export_recipe("adapters", adapters_recipe)


@pytest.fixture(scope="module")
def served(exports):
    """A tiny Llama exported by `batchstring export --adapters` (both graphs verified), served by
    `batchstring serve --model --lora --lora-dir` with one configured adapter and a watched
    directory holding another."""
    root, stdout = made(exports, "adapters")
    assert "onnxruntime, small steps: greedy identical" in " ".join(stdout.split())
    checkpoint, exported = root / "checkpoint", root / "export"
    adapters = {name: make_adapter(checkpoint, root / "made" / name, seed, **lora)
                for seed, (name, lora) in enumerate(ADAPTERS.items())}
    watched = root / "watched"
    shutil.copytree(adapters["all"], watched / "all")
    proc, ports, banner = serve(root, "--model", str(exported), "--lora", f"attn={adapters['attn']}",
                                "--lora-dir", str(watched))
    assert "ready" in banner, banner + proc.stdout.read() if proc.poll() is not None else banner
    yield Served(f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[0]}", checkpoint, adapters, watched, exported)
    stop(proc)


def expected_text(checkpoint: Path, adapter: Path | None, prompt: str) -> str:
    from batchstring.engine.tokenizer import TextCodec

    codec = TextCodec.from_file(checkpoint / "tokenizer.json")
    ids = codec.encode(prompt)
    return codec.decode(merged_greedy(checkpoint, adapter, ids, len(codec.token_bytes)))


def test_a_server_mixes_adapters_and_the_base_in_its_batches_by_request_parameter_and_by_model(served):
    import concurrent.futures
    import json

    import openai

    from batchstring.client import BatchClient, NotFound

    checkpoint, adapters = served.checkpoint, served.adapters
    choices = {None: None, "attn": adapters["attn"], "all": adapters["all"]}
    with BatchClient(served.grpc_url) as client, concurrent.futures.ThreadPoolExecutor(3) as pool:
        calls = {name: pool.submit(client.batchstring, list(PROMPTS), max_tokens=TOKENS, ignore_eos=True,
                                   adapter=name) for name in choices}
        for name, call in calls.items():
            assert call.result() == [expected_text(checkpoint, choices[name], p) for p in PROMPTS], name
        (unknown,) = client.batchstring(["x"], adapter="nope", return_exceptions=True)
        assert isinstance(unknown, NotFound) and "'nope' is not served here; served adapters: all, attn" in str(unknown)
    from tests.test_claims import http_json

    generated = json.loads(http_json(f"http://{served.http_url}/v2/models/llm/generate",  # Triton's HTTP
                                     {"text_input": PROMPTS[2], "adapter": "all", "max_tokens": TOKENS,
                                      "temperature": 0, "ignore_eos": True}))
    assert generated["text_output"] == PROMPTS[2] + expected_text(checkpoint, adapters["all"], PROMPTS[2])
    api = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["llm", "all", "attn"]
    done = api.completions.create(model="attn", prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert done.model == "attn" and done.choices[0].text == expected_text(checkpoint, adapters["attn"], PROMPTS[0])
    with pytest.raises(openai.NotFoundError, match="'llm', 'all', 'attn'"):
        api.completions.create(model="nope", prompt="x", max_tokens=2)


def test_each_line_of_a_batch_runs_with_the_model_it_names(served):
    """The Batch API: a file whose lines name the base model and two adapters; each line's text is
    its own model's."""
    import json
    import time

    import openai

    api = openai.OpenAI(base_url=f"http://{served.http_url}/v1", api_key="unused", max_retries=0)
    models = ["llm", "attn", "all"]
    lines = [{"custom_id": f"{model}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}}
             for model in models for i, prompt in enumerate(PROMPTS)]
    uploaded = api.files.create(file=("lines.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                purpose="batch")
    batch = api.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (batch := api.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch.request_counts
        time.sleep(0.3)
    assert batch.status == "completed", batch
    text = api.files.content(batch.output_file_id).text
    out = {line["custom_id"]: line for line in map(json.loads, text.splitlines())}
    for model in models:
        for i, prompt in enumerate(PROMPTS):
            body = out[f"{model}-{i}"]["response"]["body"]
            expected = expected_text(served.checkpoint, served.adapters.get(model), prompt)
            assert body["model"] == model and body["choices"][0]["text"] == expected, (model, prompt)


def test_adapters_come_and_go_with_the_watched_directory_and_a_broken_one_is_refused_alone(served):
    import time

    from batchstring.client import BatchClient, NotFound

    checkpoint, adapters, watched = served.checkpoint, served.adapters, served.watched
    prompt = PROMPTS[2]

    def answer(client: BatchClient, name: str) -> str | BaseException:
        return client.batchstring([prompt], max_tokens=TOKENS, ignore_eos=True, adapter=name,
                                  return_exceptions=True)[0]

    def until(client: BatchClient, name: str, done, seconds: float = 15.0) -> str | BaseException:
        deadline = time.monotonic() + seconds
        while not done(result := answer(client, name)) and time.monotonic() < deadline:
            time.sleep(0.3)
        return result

    with BatchClient(served.grpc_url) as client:
        assert isinstance(answer(client, "qv"), NotFound)
        shutil.copytree(adapters["qv"], watched / "qv")
        assert until(client, "qv", lambda r: isinstance(r, str)) == expected_text(checkpoint, adapters["qv"], prompt)
        broken = watched / "broken"
        shutil.copytree(adapters["attn"], broken)
        (broken / "adapter_model.safetensors").write_bytes(b"truncated")
        refused = until(client, "broken", lambda r: "cannot read" in str(r))
        assert isinstance(refused, NotFound) and "cannot read" in str(refused), refused
        shutil.rmtree(watched / "qv")
        assert isinstance(until(client, "qv", lambda r: isinstance(r, NotFound)), NotFound)
        for name in ("all", "attn", None):  # the others kept serving throughout
            assert answer(client, name) == expected_text(checkpoint, adapters.get(name), prompt), name


def test_a_quantized_base_takes_the_same_adapters(served, tmp_path):
    """`batchstring quantize int8` of an export with adapters: the projections run MatMulNBits, the
    adapters' products stay in float32, and adapter rows follow their merged models' greedy tokens
    up to the quantization's own drift (the base rows drift alike)."""
    import onnx

    checkpoint, adapters, exported = served.checkpoint, served.adapters, served.exported
    out = tmp_path / "int8"
    result = subprocess.run([*BATCHSTRING, "quantize", "int8", "--model", str(exported), "--out", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MatMulNBits" in {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    eng = engine(out, adapters=listing(adapters))
    seqs = [eng.make_sequence(p, GREEDY, lambda o: None, adapter=name) for p in PROMPTS for name in [None, *adapters]]
    eng.generate(seqs)
    agree = []
    for seq in seqs:
        name = seq.adapter.name if seq.adapter else None
        expected = merged_greedy(checkpoint, adapters.get(name), seq.prompt_ids, eng.spec.vocab_size)
        agree.append(next((i for i, (a, b) in enumerate(zip(seq.output_ids, expected)) if a != b), TOKENS))
    assert min(agree) >= 2 and sum(a == TOKENS for a in agree) >= len(agree) // 2, agree
    base = {tuple(s.prompt_ids): s.output_ids for s in seqs if s.adapter is None}
    assert all(s.output_ids != base[tuple(s.prompt_ids)] for s in seqs if s.adapter), "the adapters were applied"
