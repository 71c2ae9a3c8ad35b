"""Speculative decoding (engine/speculation.py): n-gram drafts verified inside the exported step.

Greedy tokens must equal plain decoding wherever drafts ride along (crowds, preemption, prefix-cache
hits, stop strings, through Triton); sampled tokens must keep their distribution, and a seeded
request its exact tokens; the policy must keep drafts out of full batches and away from requests
that opt out; and the acceptance counters must move.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import numpy as np
import pytest

from batchstring.engine.config import EngineConfig
from batchstring.engine.errors import InvalidRequest
from batchstring.engine.sampling_params import SamplingParams, parse_sampling_parameters
from tests.conftest import metric_reaches, start_server
from tests.engine_helpers import Collector, alone, engine, interleave, varied_prompts

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
EVERYWHERE = {"speculative_step_tokens": 512}  # drafts even in crowds, where the default budget turns them off


FIELDS = ("width", "height", "depth", "colour", "name")


def repetitive_prompts(count: int) -> list[str]:
    """Code that repeats itself (where prompt lookup finds drafts), beside plain stdlib snippets."""
    classes = []
    for i in range(count // 2):
        fields = FIELDS[: 2 + i % 4]
        classes.append(f"class Box{i}:\n    def __init__(self, {', '.join(fields)}):\n"
                       + "".join(f"        self.{f} = {f}\n" for f in fields))
    return classes + varied_prompts(count - len(classes), seed=5)


@pytest.fixture(scope="module")
def prompts():
    return repetitive_prompts(30)


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    """Each prompt alone without speculation: the reference."""
    return alone(engine(model_dir, speculative_tokens=0), prompts, GREEDY)


def test_greedy_tokens_with_drafts_in_crowds_equal_plain_decoding(model_dir, prompts, plain):
    eng = engine(model_dir, **EVERYWHERE)
    seqs, _ = interleave(eng, prompts, GREEDY, per_wave=6)
    assert [i for i, s in enumerate(seqs) if s.output_ids != plain[i]] == []
    stats = eng.stats.speculation
    assert 0 < stats.accepted < stats.drafted, "drafts were both accepted and rejected"
    assert max(eng.stats.step_sizes) >= 10, "drafts rode in crowded steps"
    assert stats.drafted_at[0] >= stats.drafted_at[-1] > 0 and stats.accepted_at[0] >= stats.accepted_at[-1]
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_drafts_cut_the_steps_of_one_caller(model_dir, prompts, plain):
    eng = engine(model_dir)  # the shipped policy
    seqs = [eng.make_sequence(p, GREEDY, lambda out: None) for p in prompts]
    for seq in seqs:
        eng.generate([seq])
    assert [s.output_ids for s in seqs] == plain
    tokens = len(prompts) * (GREEDY.max_tokens - 1)  # the first token of each comes from its prefill step
    decode_steps = eng.stats.steps - len(prompts)
    assert decode_steps < 0.8 * tokens, f"{decode_steps} steps for {tokens} tokens"


def test_preemption_with_drafts_recomputes_and_keeps_the_tokens(model_dir, prompts, plain):
    eng = engine(model_dir, kv_cache_tokens=1024, **EVERYWHERE)
    seqs, _ = interleave(eng, prompts, GREEDY, per_wave=10)
    assert eng.stats.preemptions > 0, "the cache was meant to be too small for all sequences"
    assert eng.stats.speculation.accepted > 0
    assert [s.output_ids for s in seqs] == plain
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_prefix_cache_hits_with_drafts_give_the_plain_tokens(model_dir):
    instruction = "".join(varied_prompts(40, seed=7)[20:24])[:700]
    prompts = [instruction + tail[:120] for tail in repetitive_prompts(16)]
    reference = alone(engine(model_dir, speculative_tokens=0), prompts, GREEDY)
    eng = engine(model_dir, **EVERYWHERE)
    seqs, _ = interleave(eng, prompts, GREEDY, per_wave=4)
    assert eng.scheduler.blocks.hit_tokens > 10 * 160, "the shared instruction came from the cache"
    assert eng.stats.speculation.accepted > 0
    assert [s.output_ids for s in seqs] == reference


def test_stop_strings_and_streaming_with_drafts_answer_as_plain_decoding(model_dir, prompts):
    params = SamplingParams(max_tokens=48, temperature=0.0, stop=("self.d", "\n\n"))
    answers = {}
    for k in (0, 4):
        eng = engine(model_dir, speculative_tokens=k, **EVERYWHERE)
        seqs, sink = interleave(eng, prompts, params, per_wave=6, stream=True)
        answers[k] = [(sink.text(s), sink.final(s).finish_reason, sink.final(s).num_output_tokens) for s in seqs]
    assert answers[4] == answers[0]
    assert any(reason == "stop" for _, reason, count in answers[4] if count < 48), "stop strings ended some"


def test_a_seeded_sampled_request_gets_the_same_tokens_with_drafts(model_dir, prompts):
    def tokens(k: int) -> list[list[int]]:
        eng = engine(model_dir, speculative_tokens=k, **EVERYWHERE)
        params = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        sink = Collector()
        seqs = [eng.make_sequence(p, params[i], sink) for i, p in enumerate(prompts)]
        eng.generate(seqs)
        assert k == 0 or eng.stats.speculation.accepted > 0
        return [s.output_ids for s in seqs]

    assert tokens(4) == tokens(0), "the n-th token takes the n-th number of the request's own stream"


def chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (rare tokens pooled); p-value by Wilson-Hilferty."""
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rows = [[a[t] for t in common] + [sum(a.values()) - sum(a[t] for t in common)],
            [b[t] for t in common] + [sum(b.values()) - sum(b[t] for t in common)]]
    table = np.array([col for col in zip(*rows) if sum(col) > 0], float).T
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    if dof < 1:
        return 1.0
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_keep_their_distribution_with_drafts(model_dir):
    """Unseeded rows share the engine's random stream, so drafts change which numbers each
    position gets: the tokens differ run to run, but not their distribution."""
    prompt = "import os\nimport sys\nimport re\nimport os\nimport sys\nimport re\nimport os\n"
    params = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True)
    positions: dict[int, list[Counter]] = {}
    for k in (0, 4):
        eng = engine(model_dir, speculative_tokens=k, **EVERYWHERE)
        seqs = [eng.make_sequence(prompt, params, lambda out: None) for _ in range(600)]
        for start in range(0, len(seqs), 60):
            eng.generate(seqs[start : start + 60])
        positions[k] = [Counter(s.output_ids[j] for s in seqs) for j in range(params.max_tokens)]
        if k:
            stats = eng.stats.speculation
            assert stats.accepted > 300 and stats.drafted - stats.accepted > 300, "both outcomes were exercised"
    p_values = [chi_square_p(positions[0][j], positions[4][j]) for j in range(1, params.max_tokens)]
    assert min(p_values) > 1e-3, f"a position's tokens are distributed differently with drafts: {p_values}"
    assert len(positions[4][3]) >= 5, "the distribution is not a point mass"


def test_full_batches_and_requests_that_opt_out_never_draft(model_dir, prompts):
    eng = engine(model_dir)  # the shipped budget: 16 tokens a step
    eng.generate([eng.make_sequence(p, GREEDY, lambda out: None) for p in prompts[:16]])
    assert eng.stats.speculation.drafted == 0, "16 decoding rows fill the budget: no drafts"
    opted_out = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, speculative=False)
    eng.generate([eng.make_sequence(prompts[0], opted_out, lambda out: None)])
    assert eng.stats.speculation.drafted == 0, "a request that opts out decodes plainly"
    eng.generate([eng.make_sequence(prompts[0], GREEDY, lambda out: None)])
    assert eng.stats.speculation.drafted > 0, "the same request alone, allowed, drafts"


def test_speculation_parameters_are_checked():
    with pytest.raises(ValueError, match="speculative_tokens must be >= 0"):
        EngineConfig.from_parameters({"speculative_tokens": "-1"}, model_dir="unused")
    assert parse_sampling_parameters('{"speculative": "false"}', 512, 16).speculative is False
    assert parse_sampling_parameters(None, 512, 16).speculative is True
    with pytest.raises(InvalidRequest, match="speculative must be true or false; got 'maybe'"):
        parse_sampling_parameters('{"speculative": "maybe"}', 512, 16)


@pytest.fixture(scope="module")
def crowded_server(request, model_dir):
    """A small cache (preemptions) and a budget that lets crowds draft."""
    return start_server(request, "speculative", config="cpu",
                        params={"kv_cache_tokens": "1024", "speculative_step_tokens": "512"})


def test_greedy_completions_through_triton_equal_with_and_without_drafts(crowded_server):
    from batchstring.client import AsyncBatchClient

    instruction = "".join(varied_prompts(40, seed=7)[20:24])[:600]
    prompts = repetitive_prompts(24) + [instruction + tail[:100] for tail in varied_prompts(16, seed=9)]

    async def crowd(speculative: bool) -> list[str]:
        async with AsyncBatchClient(crowded_server.grpc_url) as aio:
            async def one(i: int, prompt: str) -> str:
                await asyncio.sleep(0.01 * (i % 8))
                return (await aio.batchstring([prompt], max_tokens=40, ignore_eos=True, speculative=speculative))[0]

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    without, with_drafts = asyncio.run(crowd(False)), asyncio.run(crowd(True))
    assert [i for i, (a, b) in enumerate(zip(without, with_drafts)) if a != b] == []
    url = crowded_server.metrics_url
    assert metric_reaches(url, "batchstring_spec_decode_accepted_tokens_total", 1) > 0
    drafted = metric_reaches(url, "batchstring_spec_decode_draft_tokens_total", 1)
    assert drafted > metric_reaches(url, "batchstring_spec_decode_accepted_tokens_total", 1)
    assert metric_reaches(url, "batchstring_preemptions_total", 1) > 0
    assert metric_reaches(url, "batchstring_prefix_cache_hits_total", 1) > 0
    assert metric_reaches(url, "batchstring_spec_decode_accepted_tokens_per_pos_total", 1) > 0
