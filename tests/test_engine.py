"""The continuous-batching engine in-process, on the real exported default model."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from batchstring.engine.batch import sampling_inputs
from batchstring.engine.errors import EngineBroken, InvalidRequest
from batchstring.engine.randomness import RandomStreams
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.sequence import Status
from tests.engine_helpers import GREEDY, Collector, alone, engine, interleave, varied_prompts

POISON = "<<poison>>"


@pytest.fixture(scope="module")
def prompts():
    return varied_prompts(40)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return alone(engine(model_dir), prompts)


def test_greedy_output_is_batch_invariant_when_interleaved(model_dir, prompts, reference):
    eng = engine(model_dir)
    seqs, _ = interleave(eng, prompts)
    mismatched = [i for i, s in enumerate(seqs) if s.output_ids != reference[i]]
    assert not mismatched, f"prompts {mismatched} differ from their solo run"
    assert max(eng.stats.step_sizes) >= 20, "the test must really batch many sequences together"


def test_static_scheduling_gives_the_same_tokens_and_answers_each_batch_together(model_dir, prompts, reference):
    eng = engine(model_dir, scheduling="static")
    sink = Collector()
    params = [SamplingParams(max_tokens=4 + i % 20, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    seqs = [eng.make_sequence(p, params[i], sink, group=i // 16) for i, p in enumerate(prompts)]
    answered_at: dict[str, int] = {}
    for s in seqs:
        eng.add(s)
    while any(not s.finished for s in seqs):
        eng.step()
        for s in seqs:
            if s.request_id in sink.outputs:
                answered_at.setdefault(s.request_id, eng.stats.steps)
    for i, s in enumerate(seqs):
        final = sink.final(s)
        assert final.num_output_tokens == params[i].max_tokens
        assert s.output_ids[: final.num_output_tokens] == reference[i][: final.num_output_tokens]
    for group in range(3):
        steps = {answered_at[s.request_id] for s in seqs[group * 16 : (group + 1) * 16]}
        assert len(steps) == 1, "a static batch answers all its requests together"
    # batches of 16, 16 and 8 whose longest want 19, 23 and 23 tokens: one step per token, all rows
    assert eng.stats.step_sizes == {16: 19 + 23, 8: 23}, "rows stay in the batch until the longest is done"


def test_preemption_under_a_small_cache_recomputes_and_keeps_outputs(model_dir, prompts, reference):
    eng = engine(model_dir, kv_cache_tokens=1024, block_size=16)
    seqs, _ = interleave(eng, prompts, per_wave=10)
    assert eng.stats.preemptions > 0, "the cache was meant to be too small for all sequences"
    assert [s.output_ids for s in seqs] == reference
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks


def test_streamed_pieces_concatenate_to_the_non_streamed_text(model_dir, prompts):
    eng = engine(model_dir)
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=(")\n", "  return"))
    streamed, s_sink = interleave(eng, prompts[:12], params, stream=True)
    whole, w_sink = interleave(eng, prompts[:12], params, stream=False)
    for a, b in zip(streamed, whole):
        assert len(s_sink.outputs[a.request_id]) >= 1 and len(w_sink.outputs[b.request_id]) == 1
        assert s_sink.text(a) == w_sink.text(b)
        assert s_sink.final(a).finish_reason == w_sink.final(b).finish_reason
    reasons = {w_sink.final(b).finish_reason for b in whole}
    assert "stop" in reasons, "some prompt should hit a stop string"


def test_stop_strings_are_cut_and_never_streamed(model_dir, prompts):
    eng = engine(model_dir)
    params = SamplingParams(max_tokens=60, temperature=0.0, stop=("self",))
    seqs, sink = interleave(eng, prompts[:10], params, stream=True)
    for s in seqs:
        assert "self" not in sink.text(s)
        if sink.final(s).finish_reason == "stop":
            assert len(s.output_ids) < 60


def test_finish_reasons_and_token_counts(model_dir):
    eng = engine(model_dir)
    sink = Collector()
    s = eng.make_sequence("def ", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), sink)
    eng.generate([s])
    out = sink.final(s)
    assert (out.finish_reason, out.num_output_tokens, out.num_input_tokens) == ("length", 5, len(s.prompt_ids))


def test_include_input_prefixes_the_prompt_once(model_dir):
    eng = engine(model_dir)
    for stream in (False, True):
        sink = Collector()
        s = eng.make_sequence("import os\n", GREEDY, sink, stream=stream, include_input=True)
        eng.generate([s])
        assert sink.text(s) == "import os\n" + s.output.text


def test_one_poisoned_request_fails_alone_and_the_others_complete(model_dir, prompts, reference):
    eng = engine(model_dir, fault_marker=POISON)
    sink = Collector()
    batch = [*prompts[:15], prompts[15] + POISON]
    seqs = [eng.make_sequence(p, GREEDY, sink) for p in batch]
    eng.generate(seqs)
    finals = [sink.final(s) for s in seqs]
    assert [f.finish_reason for f in finals].count("error") == 1
    assert finals[-1].finish_reason == "error" and "out of memory" in finals[-1].error
    assert [s.output_ids for s in seqs[:15]] == reference[:15]
    assert eng.stats.failures_isolated == 1 and eng.stats.oom_events >= 1
    assert eng.scheduler.admit_cap == eng.config.max_num_seqs, "a failure isolated to one request costs nobody"


class _SmallMemory:
    """A runner that runs out of memory on any step of more than `rows` rows, as a device does when
    a batch is too big for it (no request is at fault)."""

    def __init__(self, real, rows: int) -> None:
        self.real, self.rows = real, rows
        self.keys, self.values = real.keys, real.values

    def step(self, batch):
        if len(batch.work) > self.rows:
            raise MemoryError(f"out of memory: {len(batch.work)} rows")
        return self.real.step(batch)


def test_a_step_too_big_for_memory_is_split_and_admissions_back_off_without_failing_anyone(model_dir, prompts,
                                                                                         reference):
    real = engine(model_dir)
    eng = engine(model_dir, runner=_SmallMemory(real.runner, 5))
    seqs = [eng.make_sequence(p, GREEDY, Collector()) for p in prompts[:12]]
    eng.generate(seqs)
    assert [s.output_ids for s in seqs] == reference[:12], "the halves give every row what one step would"
    assert eng.stats.failures_isolated == 0 and eng.stats.oom_events >= 1
    assert eng.scheduler.admit_cap <= 5, "admissions are capped below the size that failed"


def test_an_aborted_request_stops_at_once_and_frees_its_cache(model_dir):
    eng = engine(model_dir)
    sink = Collector()
    s = eng.make_sequence("def ", SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), sink)
    other = eng.make_sequence("import os\n", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), sink)
    eng.add(s)
    eng.add(other)
    for _ in range(5):
        eng.step()
    assert s.status is Status.RUNNING and eng.scheduler.blocks.num_free < eng.scheduler.blocks.num_blocks
    eng.abort(s, "cancelled by the client")
    assert s.finished and sink.final(s).finish_reason == "abort" and sink.final(s).error == "cancelled by the client"
    eng.generate([other])
    assert sink.final(other).finish_reason == "length", "its batch-mate is not affected"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks and eng.stats.cancelled == 1


def test_a_request_past_its_deadline_is_dropped_by_expire(model_dir):
    eng = engine(model_dir)
    sink = Collector()
    late = eng.make_sequence("def ", SamplingParams(max_tokens=100, temperature=0.0), sink, deadline=time.monotonic())
    eng.add(late)
    eng.expire(time.monotonic() + 0.001)
    assert late.finished and "deadline" in sink.final(late).error


class _BrokenDevice:
    """A runner whose every step fails, as after a sticky CUDA error."""

    def __init__(self, real) -> None:
        self.keys, self.values = real.keys, real.values

    def step(self, batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_generate_on_a_device_that_fails_every_step_raises_at_once_and_answers_everyone(model_dir):
    real = engine(model_dir)
    eng = engine(model_dir, runner=_BrokenDevice(real.runner))
    sink = Collector()
    seqs = [eng.make_sequence(p, GREEDY, sink) for p in ("def ", "import os\n", "class A:")]
    began = time.monotonic()
    with pytest.raises(EngineBroken, match="illegal memory access"):
        eng.generate(seqs)
    assert time.monotonic() - began < 1.0
    assert all(s.finished for s in seqs)
    assert all(sink.final(s).retryable and "probe" in sink.final(s).error for s in seqs)
    with pytest.raises(EngineBroken, match="warm-up failed on cpu"):
        eng.warm_up()


def test_the_serving_engine_answers_every_waiter_and_tells_its_host_when_the_device_breaks(model_dir):
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.serving import ServingEngine

    told = threading.Event()
    real = engine(model_dir)
    served = ServingEngine(EngineConfig(model_dir=model_dir), runner=_BrokenDevice(real.runner),
                           on_broken=lambda why: told.set())
    done = threading.Event()
    finals = []

    def sink(out):
        if out.finished:
            finals.append(out)
            if len(finals) == 3:
                done.set()

    served.start()
    served.submit(*[served.core.make_sequence(p, GREEDY, sink) for p in ("def ", "import os\n", "class A:")])
    assert done.wait(5) and told.wait(5)
    assert all(f.retryable and f.finish_reason == "abort" for f in finals)
    late = []
    served.submit(served.core.make_sequence("x = 1", GREEDY, late.append))
    assert late and late[0].retryable, "a broken engine refuses new work at once"
    served.stop()


def test_cache_is_preallocated_once(model_dir, prompts):
    eng = engine(model_dir)
    keys, values = eng.runner.keys, eng.runner.values
    pointer = keys.__array_interface__["data"][0]
    interleave(eng, prompts[:20])
    assert eng.runner.keys is keys and eng.runner.values is values
    assert keys.__array_interface__["data"][0] == pointer


def test_small_steps_run_with_every_row_in_one_group_on_the_small_step_graph(model_dir, prompts, reference):
    """A step of at most SMALL_STEP_TOKENS tokens (decode rows included) is packed in the prefill
    group and runs on the single-group graph; a larger one keeps its decode group and the full
    graph; the tokens are those of each prompt alone either way (the `reference`)."""
    from batchstring.engine.batch import SMALL_STEP_TOKENS
    from batchstring.export.layout import SMALL_STEP_GRAPH

    seen = []
    eng = spied(engine(model_dir), seen)
    assert eng.runner.small_session._model_path.endswith(SMALL_STEP_GRAPH)
    assert eng.runner.session._model_path.endswith("model.onnx")
    seqs, _ = interleave(eng, prompts[:24])
    assert [s.output_ids for s in seqs] == reference[:24]
    small = [(tokens, decode, rows) for name, tokens, decode, rows in seen if name == "small_session"]
    full = [(tokens, decode, rows) for name, tokens, decode, rows in seen if name == "session"]
    assert small and all((tokens <= SMALL_STEP_TOKENS or rows == 1) and decode == 0 for tokens, decode, rows in small)
    assert all(tokens > SMALL_STEP_TOKENS and rows > 1 for tokens, _, rows in full)
    assert any(decode > 0 for _, decode, _ in full), "a crowd of decode rows keeps its own group"


def test_a_lone_prompt_runs_on_the_small_step_graph_where_its_session_has_every_core(model_dir, prompts):
    """A step of one row, however long (a lone prompt, chunks with a past included), goes to the
    small-step session when that session has every core, with the tokens of the full graph alone
    (an engine with one session, `threads` 1); with fewer small-step threads than cores it stays
    on the full session, whose threads outnumber them."""
    from batchstring.engine.batch import SMALL_STEP_TOKENS
    from batchstring.engine.cores import available_cores

    chunked = {"enable_prefix_caching": False, "long_prefill_token_threshold": 24}
    one_session = engine(model_dir, threads=1, **chunked)
    long = [p for p in prompts if len(one_session.codec.encode(p)) > 2 * 24][:2]
    assert long, "the test needs prompts of several chunks"
    full_graph = alone(one_session, long)
    for threads, expected in ((available_cores(), "small_session"), (available_cores() - 1, "session")):
        if threads < 1:
            continue  # one core: the small session always has every core
        seen = []
        eng = spied(engine(model_dir, small_step_threads=threads, **chunked), seen)
        assert alone(eng, long) == full_graph
        lone = [(name, tokens) for name, tokens, _, rows in seen if tokens > SMALL_STEP_TOKENS and rows == 1]
        assert len(lone) >= 2 * len(long) and {name for name, _ in lone} == {expected}, (threads, lone)


def spied(eng, seen: list) -> object:
    """`eng` with each ONNX Runtime session's calls recorded in `seen`: (session, tokens, decode
    tokens, rows)."""
    for name in ("session", "small_session"):
        session = getattr(eng.runner, name)

        def spy(fetches, feeds, run=session.run, name=name):
            rows = len(feeds["prefill_rows"]) + len(feeds["decode_rows"])
            seen.append((name, len(feeds["input_ids"]), len(feeds["decode_tokens"]), rows))
            return run(fetches, feeds)

        session.run = spy
    return eng


def test_small_steps_run_on_spinning_threads_and_give_the_tokens_of_one_thread(model_dir, prompts, reference):
    """The small-step session has `small_step_threads` threads (at most the cores this process may
    use) that spin between operators; the large steps' session never spins; a single small-step
    thread never spins either and gives the same tokens; zero threads is refused by name."""
    from batchstring.engine.config import EngineConfig
    from batchstring.engine.cores import available_cores

    cores = available_cores()
    spin = "session.intra_op.allow_spinning"
    eng = engine(model_dir)
    small, large = (s.get_session_options() for s in (eng.runner.small_session, eng.runner.session))
    assert (small.intra_op_num_threads, small.get_session_config_entry(spin)) == (min(2, cores), str(int(cores > 1)))
    assert large.get_session_config_entry(spin) == "0"
    single = engine(model_dir, small_step_threads=1)
    options = single.runner.small_session.get_session_options()
    assert (options.intra_op_num_threads, options.get_session_config_entry(spin)) == (1, "0")
    assert alone(single, prompts[:12]) == reference[:12]
    with pytest.raises(ValueError, match="small_step_threads must be >= 1"):
        EngineConfig.from_parameters({"small_step_threads": "0"}, model_dir=model_dir)


@pytest.mark.parametrize(("files", "limit"), [
    ({}, None),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1),
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2),
])
def test_available_cores_follow_the_cgroup_quota_as_well_as_the_affinity(tmp_path, files, limit):
    """A container's CPU quota (cgroup v2 or v1) caps the cores the small steps spin on, rounded
    down and at least one; without a quota the affinity decides."""
    from batchstring.engine.cores import available_cores

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    affinity = len(os.sched_getaffinity(0))
    assert available_cores(tmp_path) == (affinity if limit is None else min(affinity, limit))


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", GREEDY, "empty"),
        ("x" * 20000, GREEDY, "at most 16384 bytes"),
        ("word " * 400, SamplingParams(max_tokens=200), "must be at most 512"),
        ("bad \ud800", GREEDY, "lone surrogate"),
    ],
)
def test_requests_beyond_the_limits_are_refused_before_they_run(model_dir, prompt, params, message):
    eng = engine(model_dir)
    with pytest.raises(InvalidRequest, match=message):
        eng.make_sequence(prompt, params, lambda o: None)


def test_torchscript_runtime_generates_the_same_greedy_tokens(model_dir, prompts, reference):
    eng = engine(model_dir, runtime="torchscript")
    seqs, _ = interleave(eng, prompts[:16])
    assert [s.output_ids for s in seqs] == reference[:16]


SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)


def test_a_seeded_sampled_request_gives_the_same_tokens_alone_and_among_forty_others(model_dir, prompts):
    eng = engine(model_dir)
    solo = eng.make_sequence(prompts[3], SEEDED, lambda o: None)
    eng.generate([solo])
    others = [eng.make_sequence(p, SamplingParams(max_tokens=8 + i % 20, temperature=0.9, top_k=50 * (i % 2),
                                                  seed=i if i % 3 else None, ignore_eos=True), lambda o: None)
              for i, p in enumerate(prompts[:40])]
    seeded = eng.make_sequence(prompts[3], SEEDED, lambda o: None)
    for s in others[:25]:  # the seeded one joins a running crowd, at another position in the batch
        eng.add(s)
    for _ in range(3):
        eng.step()
    eng.add(seeded)
    for s in others[25:]:
        eng.add(s)
    while not all(s.finished for s in [*others, seeded]):
        eng.step()
    assert max(eng.stats.step_sizes) >= 20, "the seeded request must really share steps with many others"
    assert seeded.output_ids == solo.output_ids
    other_seed = eng.make_sequence(prompts[3], dataclasses.replace(SEEDED, seed=99), lambda o: None)
    eng.generate([other_seed])
    assert other_seed.output_ids != solo.output_ids, "a different seed must sample differently"


def test_the_step_bans_the_end_of_sequence_until_min_tokens_and_seeds_draw_their_own_numbers(model_dir):
    eng = engine(model_dir)
    params = [SamplingParams(min_tokens=3), SamplingParams(min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=11)]
    seqs = [eng.make_sequence("x", p, lambda o: None) for p in params]
    for s, generated in zip(seqs, (2, 2, 0, 5)):
        s.output_ids = [1] * generated
    sampling = sampling_inputs(seqs, RandomStreams(0))
    assert sampling.ban_rows.tolist() == [0]
    assert sampling.sample_rows.tolist() == [0, 1, 3]  # the greedy row needs no sampling
    assert sampling.uniform[2] == np.float32(1.0 - np.random.default_rng(11).random())


def test_logprobs_come_with_each_generated_token(model_dir):
    eng = engine(model_dir)
    sink = Collector()
    s = eng.make_sequence("def ", SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True), sink)
    eng.generate([s])
    entries = sink.final(s).logprobs
    assert [e["token_id"] for e in entries] == s.output_ids
    for e in entries:
        assert len(e["top_logprobs"]) == 3 and e["logprob"] <= 0
        assert e["top_logprobs"][0]["token_id"] == e["token_id"], "greedy picks the most likely token"
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"] >= e["top_logprobs"][2]["logprob"]


def shared_prefix_and_long_prompts() -> list[str]:
    """40 prompts opening with the same ~900-character instruction, and 20 plain ones."""
    instruction = "".join(varied_prompts(60, seed=7)[20:24])[:900]
    return [instruction + tail[:200] for tail in varied_prompts(40, seed=11)] + varied_prompts(20, seed=3)


def test_prefix_caching_and_chunked_prefill_give_the_tokens_of_whole_solo_prefills(model_dir):
    prompts = shared_prefix_and_long_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = engine(model_dir, enable_chunked_prefill=False, enable_prefix_caching=False)
    reference = alone(plain, prompts, params)
    eng = engine(model_dir, max_num_batched_tokens=96)
    chunks = []
    runner_step = eng.runner.step

    def watch(batch):
        chunks.extend(w.new for w in batch.work if not w.samples)
        return runner_step(batch)

    eng.runner.step = watch
    seqs, _ = interleave(eng, prompts, params, per_wave=6)
    assert [i for i, s in enumerate(seqs) if s.output_ids != reference[i]] == []
    assert chunks and max(chunks) <= 96, "long prompts were prefilled in chunks"
    assert eng.scheduler.blocks.hit_tokens > 30 * 200, "the shared instruction was computed once and reused"
    assert eng.scheduler.blocks.num_free == eng.scheduler.blocks.num_blocks and eng.scheduler.blocks.cached_blocks > 0
