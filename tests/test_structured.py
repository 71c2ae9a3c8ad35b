"""Structured output and the rest of the sampling surface: constrained decoding (JSON schema, any
JSON, regex, choice, grammars), penalties, logit_bias, min_p and n > 1.

In process: the exported step's choice of every row is checked against a numpy reference built
from the step's own `logits` output (the model's raw logits) and the definitions, written apart
from export/sampler.py. Through a real server: completions validate with `jsonschema`, regex and
choice outputs match, the OpenAI routes' fields are honoured, n = 4 shares the prompt through the
prefix cache, and each bad input gets its error while the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest

from batchstring.client import AsyncBatchClient, InvalidArgument
from batchstring.engine.errors import InvalidRequest
from batchstring.engine.grammar import only_tokens
from batchstring.engine.runner import OnnxRunner, RuntimeSpec
from batchstring.engine.sampling_params import SamplingParams, parse_sampling_parameters
from batchstring.export.contract import FETCHED, SamplingInputs
from batchstring.server.stats import metrics
from tests.conftest import metric_reaches
from tests.engine_helpers import Collector, engine

SCHEMAS = {
    "nested objects": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "name"],
                                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                               "name": {"type": "string", "maxLength": 12}}},
                       "active": {"type": "boolean"}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["tags"],
               "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                                       "items": {"type": "string", "maxLength": 8}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["label", "level"],
              "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                             "level": {"enum": [1, 2, 3]}}},
    "bounded numbers": {"type": "object", "additionalProperties": False, "required": ["score", "ratio"],
                        "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}}},
    "optional fields": {"type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"name": {"type": "string", "maxLength": 10},
                                       "note": {"type": "string", "maxLength": 10},
                                       "count": {"type": "integer", "minimum": 0, "maximum": 99}}},
    "string patterns": {"type": "object", "additionalProperties": False, "required": ["code", "date"],
                        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                       "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}},
}
PROMPTS = ["def parse(line):\n    ", "import os\nimport ", "class Config:\n    def __init__(self", "x = {"]


def params(**values) -> SamplingParams:
    return parse_sampling_parameters(json.dumps(values), context_length=512, default_max_tokens=16)


# ----- the step's choice against a numpy reference on its own logits --------------------------------


class LogitsRunner(OnnxRunner):
    """The shipped ONNX step, also fetching `logits`; records each step's rows as they were fed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        Rows = list[tuple[SamplingParams, list[int], list[int]]]
        self.steps: list[tuple[SamplingInputs, Rows, np.ndarray, np.ndarray]] = []

    def step(self, batch):
        self._rows = [(s.params, list(s.prompt_ids), list(s.output_ids)) for s in batch.sampled]
        self._sampling = batch.inputs.sampling
        return super().step(batch)

    def _run(self, inputs, table):
        out = self.session.run([*FETCHED, "logits"], inputs.feeds(self.held(table.array)))
        self.steps.append((self._sampling, self._rows, out[-1], out[0]))
        return out[:-1]


def reference_logits(x: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """vLLM's definitions: logit_bias added, then the repetition penalty over every token seen
    (divide positive logits, multiply negative ones), then frequency * count and presence over
    the generated tokens."""
    x = x.astype(np.float64).copy()
    for token, bias in p.logit_bias:
        x[token] += bias
    seen = sorted(set(prompt) | set(output))
    x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.size)[: x.size]
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def unpack(words: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.fixture(scope="module")
def recorded(model_dir):
    """One in-process run mixing every kind of row: plain greedy, penalties, logit_bias, min_p,
    constrained (greedy and sampled)."""
    spec = RuntimeSpec.load(model_dir / "runtime.json")
    runner = LogitsRunner(model_dir, spec, 64, 16, "cpu", 2)
    eng = engine(model_dir, runner, kv_cache_tokens=64 * 16)
    kinds = [
        params(temperature=0, max_tokens=12, ignore_eos=True),
        params(temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
        params(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
        params(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={"17": 8.5, "200": -100}),
        params(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=0.7, frequency_penalty=-0.5,
               logit_bias={"5": 2.0}),
        params(temperature=1.0, max_tokens=12, ignore_eos=True, min_p=0.3, seed=4),
        params(temperature=0, max_tokens=40, json_schema=SCHEMAS["enums"]),
        params(temperature=0.9, max_tokens=40, seed=1, regex="[a-f]{2,6}-[0-9]+"),
    ]
    seqs = [eng.make_sequence(PROMPTS[i % len(PROMPTS)], p, Collector()) for i, p in enumerate(kinds)]
    eng.generate(seqs)
    return spec, runner.steps


def test_greedy_rows_pick_the_argmax_of_the_reference_adjusted_and_masked_logits(recorded):
    spec, steps = recorded
    checked = 0
    for sampling, rows, logits, tokens in steps:
        masked = dict(zip(sampling.mask_rows.tolist(), sampling.token_mask))
        for r, (p, prompt, output) in enumerate(rows):
            if not p.greedy:
                continue
            x = reference_logits(logits[r], p, prompt, output)
            if r in masked:
                x[~unpack(masked[r], spec.vocab_size)] = -np.inf
            assert tokens[r] == int(np.argmax(x)), f"row {r} ({p})"
            checked += 1
    assert checked > 40


def test_adjustments_change_the_choice_and_plain_greedy_stays_the_raw_argmax(recorded):
    _, steps = recorded
    changed, plain = 0, 0
    for _, rows, logits, tokens in steps:
        for r, (p, *_) in enumerate(rows):
            if p.greedy and p.adjusts:
                changed += int(tokens[r] != np.argmax(logits[r]))
            elif p.greedy and p.guide is None:
                plain += 1
                assert tokens[r] == np.argmax(logits[r])
    assert changed >= 5 and plain >= 10, "the penalties must actually move some choices"


def test_min_p_samples_only_tokens_at_least_min_p_times_as_likely_as_the_best(recorded):
    _, steps = recorded
    seen = 0
    for _, rows, logits, tokens in steps:
        for r, (p, *_) in enumerate(rows):
            if p.min_p:
                x = logits[r].astype(np.float64) / p.temperature
                assert x[tokens[r]] - x.max() >= np.log(p.min_p) - 1e-6
                seen += 1
    assert seen >= 10


def test_sampled_constrained_rows_only_pick_allowed_tokens(recorded):
    spec, steps = recorded
    seen = 0
    for sampling, rows, _, tokens in steps:
        for r, words in zip(sampling.mask_rows.tolist(), sampling.token_mask):
            assert unpack(words, spec.vocab_size)[tokens[r]]
            seen += int(not rows[r][0].greedy)
    assert seen >= 3


def test_rows_without_a_grammar_or_adjustment_add_nothing_to_the_step(model_dir):
    eng = engine(model_dir)
    seqs = [eng.make_sequence(p, params(temperature=0, max_tokens=3), Collector()) for p in PROMPTS]
    for seq in seqs:
        eng.add(seq)
    from batchstring.engine.batch import Work, build_step

    eng.scheduler.schedule()
    batch = build_step([Work(s, 1) for s in seqs], eng.scheduler.blocks)
    s = batch.inputs.sampling
    assert all(a.size == 0 for a in (s.mask_rows, s.token_mask, s.adjust_rows, s.sample_rows))


def test_a_grammar_that_admits_no_further_token_ends_its_request_with_an_error(model_dir):
    """choice "yes" is complete after one word; min_tokens bans the end of sequence, so nothing is allowed."""
    eng = engine(model_dir)
    out = Collector()
    stuck = eng.make_sequence("x = ", params(choice=["yes"], min_tokens=5, max_tokens=8, temperature=0), out)
    fine = eng.make_sequence("x = ", params(choice=["yes", "no"], max_tokens=8, temperature=0), out)
    eng.generate([stuck, fine])
    assert out.final(stuck).finish_reason == "error" and "sampling_parameters.choice" in out.final(stuck).error
    assert out.final(fine).finish_reason == "stop" and out.text(fine) in ("yes", "no")


def test_compiled_grammars_are_cached_by_text(model_dir):
    eng = engine(model_dir)
    for _ in range(3):
        eng.make_sequence("x", params(regex="[0-9]+"), Collector())
    eng.make_sequence("x", params(json_schema=SCHEMAS["arrays"]), Collector())
    eng.make_sequence("x", params(json_schema=json.loads(json.dumps(SCHEMAS["arrays"]))), Collector())
    assert eng.grammars.compiled == 2


# ----- through a real server ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_completion_parses_and_validates_against_its_schema(client, name):
    schema = SCHEMAS[name]
    results = client.complete(PROMPTS * 2, max_tokens=200, temperature=0.9, json_schema=schema)
    for r in results:
        assert r.finish_reason == "stop", r
        jsonschema.validate(json.loads(r.text), schema)


def test_regex_choice_grammar_and_any_json_outputs_match(client):
    pattern = r"[A-Z][a-z]{1,6} [0-9]{1,3}"
    for r in client.complete(PROMPTS, max_tokens=30, temperature=1.0, regex=pattern):
        assert re.fullmatch(pattern, r.text) and r.finish_reason == "stop"
    choices = ["red", "green", "blue"]
    assert all(t in choices for t in client.batchstring(PROMPTS, max_tokens=8, temperature=1.0, choice=choices))
    gbnf = 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'
    for r in client.complete(PROMPTS, max_tokens=40, temperature=0.8, grammar=gbnf):
        assert re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", r.text) or r.finish_reason == "length"
    for r in client.complete(PROMPTS, max_tokens=150, temperature=0.7, json_object=True):
        assert r.finish_reason != "stop" or isinstance(json.loads(r.text), dict)


def test_logit_bias_and_penalties_change_the_output_as_defined(client, model_dir):
    from batchstring.engine.tokenizer import TextCodec

    codec = TextCodec.from_file(model_dir / "tokenizer.json", RuntimeSpec.load(model_dir / "runtime.json").vocab_size)
    forced = codec.encode("x")[0]
    assert client.complete(["def f():"], max_tokens=6, ignore_eos=True, logit_bias={forced: 100})[0].text == "x" * 6
    plain = client.complete(["def f():"], max_tokens=8, ignore_eos=True)[0].text
    banned = set(codec.encode(plain))
    steered = client.complete(["def f():"], max_tokens=8, ignore_eos=True,
                              logit_bias={t: -100 for t in banned})[0].text
    assert not banned & set(codec.encode(steered))
    loop = "ab ab ab ab ab ab ab ab ab"
    repeats = client.complete([loop], max_tokens=24, ignore_eos=True)[0].text
    penalised = client.complete([loop], max_tokens=24, ignore_eos=True, frequency_penalty=2.0,
                                repetition_penalty=1.5)[0].text
    assert len(set(codec.encode(penalised))) > len(set(codec.encode(repeats)))


def test_openai_fields_are_honoured(server):
    sdk = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    schema = SCHEMAS["enums"]
    strict = sdk.completions.create(model="llm", prompt=PROMPTS[0], max_tokens=60, temperature=1.0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "label", "schema": schema}}})
    jsonschema.validate(json.loads(strict.choices[0].text), schema)
    for extra in ({"guided_choice": ["up", "down"]}, {"structured_outputs": {"choice": ["up", "down"]}}):
        out = sdk.completions.create(model="llm", prompt="x", max_tokens=5, extra_body=extra)
        assert out.choices[0].text in ("up", "down")
    regex = sdk.completions.create(model="llm", prompt="x", max_tokens=10, extra_body={"guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", regex.choices[0].text)
    text = sdk.completions.create(model="llm", prompt="x", max_tokens=3, presence_penalty=0.5, frequency_penalty=0.5,
                                  logit_bias={"5": 1}, extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].finish_reason in ("stop", "length")


def test_n_choices_share_one_prompt_computation(server):
    sdk = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    prompt = "def choose(options):\n    " + "# pick one of the options, carefully\n    " * 8
    before = metrics(server.metrics_url).get("batchstring_prefix_cache_hits_total", 0.0)
    out = sdk.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=1.0, n=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3] and all(c.text for c in out.choices)
    prompt_tokens = out.usage.prompt_tokens // 4
    hits = metric_reaches(server.metrics_url, "batchstring_prefix_cache_hits_total", before + 3 * (prompt_tokens // 16))
    assert hits - before >= 3 * 16 * (prompt_tokens // 16) - 16, "the 3 copies reuse the first one's full blocks"
    chat_free = sdk.completions.create(model="llm", prompt=["a = ", "b = "], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in chat_free.choices] == [0, 1, 2, 3]
    assert chat_free.choices[0].text == chat_free.choices[1].text != "" and chat_free.choices[2].text


BAD = [  # (sampling options, what the error names)
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "sampling_parameters.json_schema"),
    ({"regex": "([a-z]+"}, "sampling_parameters.regex"),
    ({"grammar": "root ::= missing_rule"}, "sampling_parameters.grammar"),
    ({"grammar": 'start: "a"\nstart: "b" &'}, "sampling_parameters.grammar"),
    ({"regex": "[^\\x00-\\U0010FFFF]"}, "sampling_parameters.regex admits no text"),
    ({"json_schema": {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "x" * 40}
                                                       for i in range(440)}}}, "at most 32768 bytes"),
    ({"logit_bias": {"4096": 5}}, "sampling_parameters.logit_bias"),
    ({"logit_bias": {"5": 500}}, "sampling_parameters.logit_bias"),
    ({"regex": "a", "choice": ["b"]}, "one of json_schema"),
]


def test_bad_inputs_get_invalid_argument_naming_the_field_and_cost_nobody_else(server, client):
    async def run():
        async with AsyncBatchClient(server.grpc_url) as aio:
            good = aio.complete(PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
            bad = [aio.complete(["x"], max_tokens=4, return_exceptions=True, **options) for options, _ in BAD]
            stuck = aio.complete(["x = "], choice=["yes"], min_tokens=5, max_tokens=8, return_exceptions=True)
            return await asyncio.gather(good, stuck, *bad)

    good, (stuck,), *bad = asyncio.run(run())
    assert [r.text for r in good] == [r.text for r in client.complete(PROMPTS, max_tokens=12, ignore_eos=True)]
    assert isinstance(stuck, InvalidArgument) and "sampling_parameters.choice" in str(stuck), stuck
    assert "admits no further token" in str(stuck)
    for (options, names), (result,) in zip(BAD, bad):
        assert isinstance(result, InvalidArgument) and names in str(result), (options, result)
    assert server.model_ready()


def test_bad_structured_bodies_get_a_400_naming_the_field(server):
    for body, param in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                        ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
                        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                        ({"best_of": 3}, "best_of")):
        request = urllib.request.Request(f"http://{server.http_url}/v1/completions",
                                         data=json.dumps({"model": "llm", "prompt": "x", **body}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["param"] == param


def test_a_file_job_honours_response_format_and_refuses_n(server, tmp_path):
    schema = SCHEMAS["enums"]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "llm", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 60, "temperature": 1.0,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}
             for i in range(6)]
    lines.append({"custom_id": "many", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "llm", "prompt": "x", "max_tokens": 4, "n": 2}})
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(Path(sys.executable).parent / "batchstring"), "run", "--url", server.grpc_url,
                               "--input", str(source), "--output", str(output), *extra],
                              capture_output=True, text=True, timeout=300)

    refused = run()
    assert refused.returncode != 0 and "n is not supported" in refused.stdout + refused.stderr
    assert run("--skip-malformed").returncode == 0
    answers = {a["custom_id"]: a for a in map(json.loads, output.read_text().splitlines())}
    for i in range(6):
        jsonschema.validate(json.loads(answers[f"c{i}"]["response"]["body"]["choices"][0]["text"]), schema)


def test_a_grammar_slower_to_compile_than_the_limit_is_refused_naming_the_field(model_dir):
    eng = engine(model_dir)
    eng.grammars.compile_seconds = 0.0  # every compilation takes longer than this
    with pytest.raises(InvalidRequest, match=r"sampling_parameters\.regex took .* to compile; at most 0 s"):
        eng.make_sequence("x", params(regex="[0-9]{2,5}"), Collector())


# ----- forced tokens without steps ----------------------------------------------------------------


FORCED_GUIDES = [
    {"json_schema": {"type": "object", "additionalProperties": False, "required": ["name", "kind", "size"],
                     "properties": {"name": {"type": "string", "maxLength": 10},
                                    "kind": {"enum": ["function", "class"]},
                                    "size": {"type": "integer", "minimum": 0, "maximum": 99}}}},
    {"regex": r"item-(alpha|beta)-[0-9]{2}; status: (open|closed)"},
    {"grammar": 'root ::= "call(" name ", " name ")"\nname ::= [a-z]+'},
]


def test_the_only_token_of_a_packed_mask_is_found_for_every_row_at_once():
    masks = np.zeros((6, 4), np.int32)
    masks[0, 0] = 1  # token 0
    masks[1, 2] = np.int32(-(1 << 31))  # bit 31 of word 2: token 95
    masks[2, 3] = 1 << 4  # token 100
    masks[3, 1] = 0b11  # two tokens
    masks[4, [0, 3]] = 1  # two tokens in two words
    assert only_tokens(masks).tolist() == [0, 95, 100, -1, -1, -1], "the last row allows nothing"


@pytest.mark.parametrize("guide", FORCED_GUIDES, ids=["json_schema", "regex", "grammar"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"])
def test_forced_tokens_without_steps_give_the_tokens_of_decoding_them_one_by_one(model_dir, guide, sampling):
    """A constrained row takes the run of tokens its grammar admits one at a time without model
    steps: the same tokens as stepping through them (greedy, and seeded sampling, whose numbers
    are drawn for the skipped positions too), in fewer steps, and every output still matches."""
    prompts = [f"def task_{i}(x):\n    return " for i in range(6)]
    runs = {}
    for skip in (True, False):
        eng = engine(model_dir, skip_forced_tokens=skip)
        params = parse_sampling_parameters(json.dumps({"max_tokens": 48, **guide, **sampling}), 512, 16)
        seqs = [eng.make_sequence(p, params, lambda out: None) for p in prompts]
        eng.generate(seqs)
        runs[skip] = ([s.output_ids for s in seqs], eng.stats.steps, eng.stats.forced_tokens,
                      [eng.codec.decode(s.output_ids) for s in seqs])
    assert runs[True][0] == runs[False][0], "the same tokens, with and without skipping"
    assert runs[True][2] > 0 and runs[False][2] == 0 and runs[True][1] < runs[False][1], "fewer steps when skipping"
    for text in runs[True][3]:
        if "json_schema" in guide:
            jsonschema.validate(json.loads(text), guide["json_schema"])
        elif "regex" in guide:
            assert re.fullmatch(guide["regex"], text), text
        else:
            assert re.fullmatch(r"call\([a-z]+, [a-z]+\)", text), text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}], ids=["greedy", "seeded"])
def test_forced_runs_in_a_crowd_share_steps_with_prompt_chunks_and_give_the_same_tokens(model_dir, sampling):
    """More rows than drafts ride with, and new prompts admitted as others finish: forced runs
    share steps with prompt chunks, which then run as a second call of the step (engine/batch.py
    split_step) instead of padding the runs to their width. The tokens are those of stepping
    through every forced token, and every output still validates."""
    prompts = [f"# task {i}\n" + "x = step(x) + 1\n" * (i % 5 * 5) + "def f(x):\n    return " for i in range(28)]
    guide = FORCED_GUIDES[0]
    runs = {}
    for skip in (True, False):
        eng = engine(model_dir, skip_forced_tokens=skip, max_num_seqs=20)
        calls, step = [], eng.isolation.runner.step
        eng.isolation.runner.step = lambda batch, calls=calls, step=step: calls.append(len(batch.work)) or step(batch)
        params = parse_sampling_parameters(json.dumps({"max_tokens": 48, **guide, **sampling}), 512, 16)
        seqs = [eng.make_sequence(p, params, lambda out: None) for p in prompts]
        eng.generate(seqs)
        runs[skip] = ([s.output_ids for s in seqs], eng.stats.steps, len(calls), eng.stats.forced_tokens)
        for seq in seqs:
            jsonschema.validate(json.loads(eng.codec.decode(seq.output_ids)), guide["json_schema"])
    assert runs[True][0] == runs[False][0], "the same tokens, with and without skipping"
    assert runs[True][3] > 0 and runs[True][1] < runs[False][1], "forced runs in a crowd of 20 rows: fewer steps"
    assert runs[True][2] > runs[True][1], "some steps ran as two calls: forced runs beside prompt chunks"


def test_rows_read_token_by_token_never_skip(model_dir):
    """Streaming, stop strings and log-probabilities read every token as it comes: those rows step
    through their forced tokens."""
    eng = engine(model_dir)
    guide = FORCED_GUIDES[0]
    for extra in ({"logprobs": 1}, {"stop": ["never-here"]}):
        params = parse_sampling_parameters(json.dumps({"max_tokens": 48, "temperature": 0, **guide, **extra}), 512,
                                           16)
        eng.generate([eng.make_sequence("def f(x):\n", params, lambda out: None)])
    streamed = eng.make_sequence("def f(x):\n", parse_sampling_parameters(
        json.dumps({"max_tokens": 48, "temperature": 0, **guide}), 512, 16), lambda out: None, stream=True)
    eng.generate([streamed])
    assert eng.stats.forced_tokens == 0


def test_masks_are_the_same_computed_in_turn_in_the_pool_and_by_llguidances_own_helper(model_dir, monkeypatch):
    """fill_masks writes each row through the matcher's pointer call, in turn or (where the host
    has POOL_MIN_CORES) in llguidance's pool: both give, row for row, what llguidance's numpy
    helper gives, for rows in different states of different grammars (and a reused mask)."""
    import llguidance.numpy

    from batchstring.engine import grammar
    from batchstring.engine.sampling_params import Guide

    spec = RuntimeSpec.load(model_dir / "runtime.json")
    compiler = grammar.GrammarCompiler(model_dir / "tokenizer.json", spec.vocab_size, tuple(spec.eos_token_ids))
    guides = [Guide(kind, json.dumps(text) if kind == "json_schema" else text)
              for guide in FORCED_GUIDES for kind, text in guide.items()]
    rows = []
    for i in range(12):
        row = compiler.constraint(guides[i % len(guides)])
        for _ in range(i // 3):  # a few tokens in: each row's lowest allowed token
            allowed = np.flatnonzero(np.unpackbits(grammar.fill_masks([row])[0].view(np.uint8), bitorder="little"))
            row.advance(int(allowed[0]))
        row.mask = None
        rows.append(row)
    expected = np.zeros((len(rows), rows[0].words), np.int32)
    for i, row in enumerate(rows):
        llguidance.numpy.fill_next_token_bitmask(row.matcher, expected, i)
    monkeypatch.setattr(grammar, "_pool", None)
    monkeypatch.setattr(grammar, "POOL_MIN_CORES", 10**6)
    in_turn = grammar.fill_masks(rows)
    assert grammar._pool is False and np.array_equal(in_turn, expected)
    rows[3].mask = None
    assert np.array_equal(grammar.fill_masks(rows), expected), "one computed again, the others reused"
    for row in rows:
        row.mask = None
    monkeypatch.setattr(grammar, "_pool", None)
    monkeypatch.setattr(grammar, "POOL_MIN_CORES", 1)
    pooled = grammar.fill_masks(rows)
    assert grammar._pool and np.array_equal(pooled, expected)
    assert len({row.tobytes() for row in expected}) > 3, "rows in different states"
