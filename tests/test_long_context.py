"""Long contexts: attention over block tables whose cost follows what the contexts hold.

A tiny random Llama with a 17k-token context, exported as users export theirs, runs through the
engine in both runtimes: its log-probabilities against the Hugging Face forward over prompts that
cross block, chunk and span boundaries and hit the prefix cache; a long row's greedy tokens alone
and among short rows; the input limits; and a 16k-token prompt served through /v1/completions.
The pieces under it (the block table's journal and its device mirror, the choice of span, the
front door's limits) are checked on their own.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from batchstring.engine.batch import SPLIT_STEP_COSTS, Work, split_cost, split_step
from batchstring.engine.block_table import BlockTable, pair_carrier, pair_count, single_span_blocks, span_blocks
from batchstring.engine.config import INPUT_BYTES_PER_TOKEN, EngineConfig
from batchstring.engine.errors import InvalidRequest
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.runner import DeviceTable
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Sequence
from batchstring.export.exporter import torch_arguments
from batchstring.export.layout import DEFAULT_MODEL_DIR
from tests.conftest import BATCHSTRING, export_recipe, made, start_server
from tests.engine_helpers import engine

CONTEXT = 17408  # 16k of prompt and room to generate
RUNTIMES = ("onnxruntime", "torchscript")
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CHUNKED = {"block_size": 16, "long_prefill_token_threshold": 100, "max_num_batched_tokens": 256,
           "kv_cache_tokens": 3 * CONTEXT, "max_num_seqs": 32}


def long_recipe(root: Path) -> list[str]:
    """A tiny Llama with CONTEXT positions, exported in float32 (tests/conftest.py: exports)."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         eos_token_id=0, bos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(root / "checkpoint")
    PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json")).save_pretrained(
        root / "checkpoint")
    return [*BATCHSTRING, "export", "--model", str(root / "checkpoint"), "--out", str(root / "export"),
            "--dtype", "float32"]


export_recipe("long-context", long_recipe)


@pytest.fixture(scope="module")
def long_checkpoint(exports) -> Path:
    return made(exports, "long-context")[0] / "checkpoint"


@pytest.fixture(scope="module")
def long_export(exports) -> Path:
    return made(exports, "long-context")[0] / "export"


@pytest.fixture(scope="module")
def hf_model(long_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(long_checkpoint, attn_implementation="eager").eval()


def text_of(eng, tokens: int, seed: int = 0) -> str:
    """Real source text of about `tokens` tokens (the stdlib, from a seed-dependent line)."""
    lines = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text().splitlines(keepends=True)
    text, i = "", seed * 97
    while len(text) < 6 * tokens:
        text += lines[i % len(lines)]
        i += 1
    ids = eng.codec.encode(text)[:tokens]
    return eng.codec.decode(ids)


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()


def assert_logprobs_match(hf_model, seq, tolerance: float = 2e-4) -> None:
    """Every generated token's log-probability and top-5 against HF's forward over the same tokens."""
    reference = hf_logprobs(hf_model, seq.prompt_ids + seq.output_ids)
    start = len(seq.prompt_ids) - 1
    assert len(seq.output.logprobs) == len(seq.output_ids)
    for j, entry in enumerate(seq.output.logprobs):
        row = reference[start + j]
        assert entry.token_id == seq.output_ids[j]
        assert abs(entry.logprob - row[entry.token_id]) < tolerance, (j, entry.logprob, row[entry.token_id])
        for token, logprob in entry.top:
            assert abs(logprob - row[token]) < tolerance, (j, token)
        assert {t for t, _ in entry.top} <= set(np.argsort(-row)[:6].tolist())


# ----- the block table, the spans, the limits at the front door --------------------------------------


def test_the_block_table_journal_brings_a_device_mirror_up_to_date_with_only_what_changed():
    table = BlockTable(rows=4, width=6)
    table.write(0, 0, [5, 6])
    mirror = DeviceTable(torch, torch.device("cpu"))
    first = mirror.sync(table)
    assert first.shape == (5, 6) and torch.equal(first, torch.from_numpy(table.array))
    table.write(2, 1, [9, 10, 11])
    table.write(0, 2, [7])
    index, blocks = table.drain()
    assert sorted(zip(index.tolist(), blocks.tolist())) == [(2, 7), (13, 9), (14, 10), (15, 11)]
    table.write(3, 0, [1])
    table.write(2, 1, [3])
    table.write(2, 1, [4])  # the same entry twice: the later write wins
    synced = mirror.sync(table)
    assert synced is first and synced[3, 0] == 1 and synced[2, 1] == 4
    assert synced[0, 2] == 0, "what was drained before reached no mirror: the journal is one consumer's"
    assert table.drain()[0].size == 0


def test_spans_follow_the_rows_one_per_row_when_even_and_many_for_a_long_row_among_short_ones():
    even = np.full(64, 97)
    assert span_blocks(even, 1, 16, 2) == 7, "seven blocks each: one span per row, no padding"
    mixed = np.array([97] * 63 + [15000])
    span = span_blocks(mixed, 1, 16, 2)
    assert span > 1 and span < 64 and pair_count(mixed, span, 16) > 64, "several short spans for the long row"
    keys = pair_count(mixed, span, 16) * span * 16
    assert keys < 1.2 * mixed.sum() + 64 * span * 16, "the keys gathered follow the sum of the contexts"
    assert pair_count(np.array([0, 0, 33]), 1, 16) == 1 + 1 + 3, "a row without a past keeps one masked pair"
    carrier = pair_carrier(mixed, span, 16)
    assert carrier.shape == (pair_count(mixed, span, 16), span, 0) and carrier.nbytes == 0
    assert single_span_blocks(np.array([100, 90, 120]), 16) == 8
    assert single_span_blocks(np.array([16, 16, 16, 15000]), 16) is None, "one long row: pairs, not padding"


def test_a_step_splits_in_two_calls_only_when_padding_would_cost_more_than_a_call():
    """A forced run's few tokens beside a prompt chunk of a hundred: two calls, short rows first;
    rows of one width, or a short run among short rows, stay one call."""

    def work(news: list[int], past: int = 200) -> list[Work]:
        return [Work(Sequence(str(i), [1] * (past + n), SamplingParams(), num_computed=past), n)
                for i, n in enumerate(news)]

    crowd = work([1] * 40 + [5] * 12 + [128, 97])
    first, second = split_step(crowd, 16, SPLIT_STEP_COSTS["cpu"])
    assert [w.new for w in first] == [1] * 40 + [5] * 12 and [w.new for w in second] == [128, 97]
    for news in ([1] * 40 + [128] * 3, [1] * 40 + [5] * 12, [1] * 40 + [2, 3], [4] * 8 + [1, 6], [1, 1, 1, 2, 3]):
        assert len(split_step(work(news), 16, SPLIT_STEP_COSTS["cpu"])) == 1, news


def test_the_split_cost_is_the_devices_unless_configured(tmp_path):
    def parse(value: str, device: str) -> EngineConfig:
        return EngineConfig.from_parameters({"split_step_cost": value}, model_dir=tmp_path, device=device)

    assert split_cost(parse("auto", "cpu")) == SPLIT_STEP_COSTS["cpu"]
    assert split_cost(parse("auto", "cuda:1")) == SPLIT_STEP_COSTS["cuda"]
    assert split_cost(parse("100", "cuda:0")) == 100
    with pytest.raises(ValueError, match="split_step_cost must be a positive number or auto; got -1"):
        parse("-1", "cpu")


def test_the_front_door_takes_what_a_long_context_model_takes(tmp_path):
    from batchstring.frontdoor.gateway.limits import Limits

    (tmp_path / "runtime.json").write_text(json.dumps({"context_length": 131072}))
    limits = Limits.for_model(tmp_path)
    assert limits.max_input_bytes == 131072 * INPUT_BYTES_PER_TOKEN
    assert limits.max_body_bytes > 2 * limits.max_input_bytes and limits.max_message_bytes > 2 * limits.max_input_bytes
    shipped = Limits.for_model(None)
    assert (shipped.max_body_bytes, shipped.max_message_bytes) == (2**20, 2**20)
    assert Limits.for_model(tmp_path, body=5000).max_body_bytes == 5000, "a configured limit wins"
    assert f"text_input is at most {131072 * INPUT_BYTES_PER_TOKEN} bytes" in limits.too_large("x", 1)


# ----- the engine on a long-context export ------------------------------------------------------------


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_long_prompts_match_the_hf_forward_across_blocks_chunks_and_prefix_cache_hits(long_export, hf_model,
                                                                                     runtime):
    eng = engine(long_export, runtime=runtime, **CHUNKED)
    first = eng.make_sequence(text_of(eng, 1850), LOGPROBS, lambda out: None)
    eng.generate([first])
    assert len(first.prompt_ids) > 1800
    assert_logprobs_match(hf_model, first)
    hits = eng.scheduler.blocks.hit_tokens
    shared = eng.codec.decode(first.prompt_ids[:1500])
    second = eng.make_sequence(shared + text_of(eng, 300, seed=3), LOGPROBS, lambda out: None)
    eng.generate([second])
    assert eng.scheduler.blocks.hit_tokens - hits >= 1456, "the shared prefix came from the cache"
    assert_logprobs_match(hf_model, second)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_long_rows_tokens_are_the_same_alone_and_among_short_rows(long_export, runtime):
    alone = engine(long_export, runtime=runtime, **CHUNKED)
    prompt = text_of(alone, 4000, seed=5)
    seq = alone.make_sequence(prompt, GREEDY, lambda out: None)
    alone.generate([seq])
    crowd = engine(long_export, runtime=runtime, **CHUNKED)
    short = [crowd.make_sequence(text_of(crowd, 20 + 7 * i, seed=i), GREEDY, lambda out: None) for i in range(24)]
    long = crowd.make_sequence(prompt, GREEDY, lambda out: None)
    crowd.generate([*short[:12], long, *short[12:]])
    assert long.output_ids == seq.output_ids
    assert all(len(s.output_ids) == GREEDY.max_tokens for s in short)


def test_input_limits_follow_the_context_and_name_both_numbers(long_export):
    eng = engine(long_export, **CHUNKED)
    cap = INPUT_BYTES_PER_TOKEN * CONTEXT
    assert eng.max_input_bytes == cap
    with pytest.raises(InvalidRequest) as refused:
        eng.make_sequence("x" * (cap + 1), GREEDY, lambda out: None)
    message = str(refused.value)
    assert f"text_input is {cap + 1} bytes; at most {cap} bytes" in message
    assert f"{CONTEXT}-token context" in message and f"at most {CONTEXT} tokens" in message
    too_long = text_of(eng, CONTEXT - 4)
    n = len(eng.codec.encode(too_long))
    with pytest.raises(InvalidRequest, match=f"prompt is {n} tokens and max_tokens is 12; their sum must be at most "
                                             f"{CONTEXT}"):
        eng.make_sequence(too_long, GREEDY, lambda out: None)
    fits = text_of(eng, CONTEXT - 12)
    assert len(eng.make_sequence(fits, GREEDY, lambda out: None).prompt_ids) + 12 <= CONTEXT
    configured = engine(long_export, max_input_bytes=1000, **CHUNKED)
    with pytest.raises(InvalidRequest, match=r"at most 1000 bytes are allowed \(max_input_bytes\)"):
        configured.make_sequence("x" * 1001, GREEDY, lambda out: None)


# ----- served --------------------------------------------------------------------------------------


def test_a_16k_token_prompt_is_served_through_v1_completions_beside_short_callers(request, long_export,
                                                                                  tmp_path_factory):
    """A real server on the long-context export: the long prompt completes, streamed, while short
    callers run beside it, and they all finish."""
    import asyncio

    import openai

    from batchstring.server.repository import repository_for

    repository = repository_for(long_export, tmp_path_factory.mktemp("long-repository"))
    server = start_server(request, "long-context", config="cpu", repository=repository)
    local = engine(long_export, **CHUNKED)
    prompt = text_of(local, 16384, seed=2)
    tokens = len(local.codec.encode(prompt))
    assert tokens >= 16000 and len(prompt.encode()) > 2**15

    async def run() -> tuple[list, str, int]:
        api = openai.AsyncOpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
        async with api:
            async def short(i: int) -> str:
                done = await api.completions.create(model="llm", prompt=f"def f_{i}(x):\n", max_tokens=24,
                                                   temperature=0)
                return done.choices[0].finish_reason

            stream = await api.completions.create(model="llm", prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
            shorts = asyncio.gather(*(short(i) for i in range(8)))
            pieces, reason = [], None
            async for chunk in stream:
                pieces.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            return await shorts, reason, len(pieces)

    shorts, reason, pieces = asyncio.run(run())
    assert reason == "length" and pieces >= 2, "streamed, to its last token"
    assert set(shorts) <= {"length", "stop"} and len(shorts) == 8


# ----- decode steps of static shapes (CUDA graphs) -----------------------------------------------


def rows_of(eng, pasts: list[int], params: list[SamplingParams]) -> list:
    """Sequences that have computed `past` tokens each and decode their next one."""
    from batchstring.engine.batch import Work
    from batchstring.engine.sequence import Sequence

    work = []
    for i, (past, p) in enumerate(zip(pasts, params)):
        seq = Sequence(f"row-{i}", [1 + (i * 7 + j) % 4000 for j in range(past + 1)], p)
        eng.scheduler.blocks.grow(seq, past + 1)
        seq.num_computed = past
        work.append(Work(seq, 1))
    return work


def as_numpy(x) -> np.ndarray:
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("pasts", [[40, 97, 130, 7, 64], [33] * 20 + [50, 3, 90]])
def test_a_decode_step_padded_to_its_bucket_computes_what_the_step_itself_does(long_export, runtime, pasts):
    """The bucketed step a CUDA graph holds (rows padded, one span per row of a power-of-two
    blocks, sampled rows padded with greedy ones) against the same step unpadded, in a small step
    (its rows in the prefill group) and a large one (the decode group), on the CPU."""
    from batchstring.engine.batch import build_step
    from batchstring.engine.cuda_graph_padding import pad_decode

    eng = engine(long_export, runtime=runtime, **CHUNKED)
    rng = np.random.default_rng(0)
    for cache in (eng.runner.keys, eng.runner.values):
        cache[...] = torch.from_numpy(rng.standard_normal(cache.shape).astype(np.float32)) \
            if isinstance(cache, torch.Tensor) else rng.standard_normal(cache.shape).astype(np.float32)
    kinds = [GREEDY, SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3),
             SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5), SamplingParams(max_tokens=12, logprobs=3)]
    work = rows_of(eng, pasts, [kinds[i % len(kinds)] for i in range(len(pasts))])
    batch = build_step(work, eng.scheduler.blocks, RandomStreams(1), query_group=2)
    block_size = CHUNKED["block_size"]
    scratch = (eng.scheduler.blocks.num_blocks - 1) * block_size  # a block no row holds
    padded = pad_decode(batch, block_size, scratch)
    assert padded is not None and padded.rows == len(pasts) and padded.key[0] > len(pasts)
    assert padded.key[1] == 1 << (-(-max(pasts) // block_size) - 1).bit_length()
    theirs = eng.runner._run(batch.inputs, batch.table)
    ours = eng.runner._run(padded.inputs, batch.table)
    n, m = padded.rows, padded.sampled
    assert (as_numpy(ours[0])[:n] == as_numpy(theirs[0])).all()
    assert np.allclose(as_numpy(ours[1])[:m], as_numpy(theirs[1]), atol=1e-5)
    assert (as_numpy(ours[2])[:m] == as_numpy(theirs[2])).all()
    for new_ours, new_theirs in zip(ours[4:], theirs[4:]):
        assert np.abs(as_numpy(new_ours)[:, :, :n] - as_numpy(new_theirs)).max() < 1e-5


def test_steps_that_fit_no_bucket_run_as_they_are(long_export):
    from batchstring.engine.batch import Work, build_step
    from batchstring.engine.cuda_graph_padding import pad_decode

    eng = engine(long_export, **CHUNKED)
    blocks = eng.scheduler.blocks

    def padded(work: list[Work]):
        step = pad_decode(build_step(work, blocks), 16, 0)
        for w in work:
            blocks.release(w.seq)
        return step

    assert padded(rows_of(eng, [20] * 30 + [9000], [GREEDY] * 31)) is None, "one span per row would waste"
    assert padded(rows_of(eng, [10], [SamplingParams(max_tokens=4, logit_bias=((5, 2.0),))])) is None, "adjustments"
    two = rows_of(eng, [20, 30], [GREEDY, GREEDY])
    two[1].seq.num_computed = 29
    assert padded([two[0], Work(two[1].seq, 2)]) is None, "a row feeding two tokens"
    quiet = rows_of(eng, [20, 30, 40], [GREEDY] * 3)  # the middle row computes without sampling
    assert padded([quiet[0], Work(quiet[1].seq, 1, samples=False), quiet[2]]) is None, "a row not sampled"
    assert padded(rows_of(eng, [20, 30], [GREEDY, GREEDY])).key == (4, 2)


def test_a_16_bit_step_over_one_long_span_stays_finite(long_checkpoint):
    """A pair's unnormalised weights sum to up to its span (here 4,096 keys, all alike): times
    values of 100, more than float16 holds; the step normalises a pair before that product."""
    from transformers import AutoModelForCausalLM

    from batchstring.export.step import DecoderStep
    from batchstring.export.verify import Row, pack

    hf = AutoModelForCausalLM.from_pretrained(long_checkpoint, dtype=torch.float16, attn_implementation="eager")
    step = DecoderStep(hf.eval(), [0]).eval()
    blocks, size = 256, 16
    keys = np.zeros((2, 2, blocks, size, 16), np.float16)
    values = np.full_like(keys, 100.0)
    inputs, held = pack([Row([5], list(range(blocks)), blocks * size)], keys, values, spans=(blocks, blocks),
                        sites=step.adapter_sites())
    assert inputs.decode_pairs.shape[:2] == (1, blocks), "one pair spans the whole past"
    with torch.no_grad():
        outputs = step(*torch_arguments(inputs, held))
    assert torch.isfinite(outputs[4]).all() and torch.isfinite(outputs[5]).all()
