"""Scheduler and block manager, without a model: admission, chunked prefill, prefix caching,
retirement, preemption, the cache budget. Steps are reported through the scheduler's own `update`."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from batchstring.engine.block_manager import BlockManager
from batchstring.engine.config import EngineConfig
from batchstring.engine.policy import policy_for
from batchstring.engine.sampling_params import SamplingParams
from batchstring.engine.scheduler import Scheduler
from batchstring.engine.sequence import Sequence, Status

EOS = 0
_fresh = itertools.count(1000)


def seq(prompt_len: int, group: int = 0, max_tokens: int = 64, prefix: list[int] | None = None) -> Sequence:
    """A prompt of distinct tokens (no accidental prefix sharing), after `prefix` if given."""
    body = [next(_fresh) for _ in range(prompt_len - len(prefix or []))]
    return Sequence(request_id=f"r{random.random()}", prompt_ids=[*(prefix or []), *body],
                    params=SamplingParams(max_tokens=max_tokens), group=group)


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(model_dir=Path("."), block_size=block_size, **{"max_num_batched_tokens": 512, **cfg})
    blocks = BlockManager(num_blocks, block_size, config.max_num_seqs, 512, config.enable_prefix_caching)
    return Scheduler(config, blocks, policy_for(config.scheduling), (EOS,))


def fake_step(sched: Scheduler, token: int = 7) -> list[Sequence]:
    """A successful step as the engine reports it: every row that samples gets `token`."""
    step = sched.schedule()
    if step is None:
        return []
    sampled = [w.seq for w in step.work if w.samples]
    for s in sched.update(step.work, sampled, np.full(len(sampled), token)):
        sched.retire(s)
    return step.seqs


def owned_blocks_are_consistent(sched: Scheduler) -> None:
    """Reference counts equal the owners; every block is owned or free, never both."""
    blocks = sched.blocks
    owners: dict[int, int] = {}
    for s in sched.running:
        for b in s.blocks:
            owners[b] = owners.get(b, 0) + 1
    assert all(blocks.references(b) == n for b, n in owners.items())
    free = blocks.free_blocks()
    assert not free & set(owners) and len(free) + len(owners) == blocks.num_blocks


def test_admission_stops_at_max_num_seqs_and_then_everyone_decodes():
    sched = make(max_num_seqs=3)
    seqs = [seq(5) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.prefill and step.seqs == seqs[:3]
    sched.update(step.work, step.seqs, np.full(3, 7))
    step = sched.schedule()
    assert not step.prefill and step.seqs == seqs[:3] and [w.new for w in step.work] == [1, 1, 1]
    assert [s.status for s in seqs[3:]] == [Status.WAITING] * 2


def test_a_retired_sequence_frees_its_blocks_and_a_waiting_one_joins_the_decoding_ones():
    sched = make(max_num_seqs=2)
    a, b, c = seq(8), seq(8), seq(8)
    for s in (a, b, c):
        sched.add(s)
    fake_step(sched)
    free_before = sched.blocks.num_free
    sched.retire(a)
    assert sched.blocks.num_free == free_before + 2 and a.blocks == []
    step = sched.schedule()
    assert [(w.seq, w.new) for w in step.work] == [(b, 1), (c, 8)], "b decodes while c is prefilled"


def test_chunked_prefill_spreads_a_long_prompt_over_steps_while_others_decode():
    sched = make(max_num_batched_tokens=16, max_num_seqs=4)
    short = [seq(3) for _ in range(2)]
    for s in short:
        sched.add(s)
    fake_step(sched)
    long = seq(40)
    sched.add(long)
    chunks = []
    while not long.output_ids:
        step = sched.schedule()
        assert sum(w.new for w in step.work) <= 16
        assert [w.new for w in step.work if w.seq in short] == [1, 1], "the decoding ones never wait"
        chunks += [w.new for w in step.work if w.seq is long]
        assert [w.samples for w in step.work if w.seq is long] == [long.num_computed + chunks[-1] == 40]
        sampled = [w.seq for w in step.work if w.samples]
        sched.update(step.work, sampled, np.full(len(sampled), 7))
    assert chunks == [14, 14, 12] and long.output_ids == [7]


def test_without_chunked_prefill_a_prefill_step_runs_whole_prompts_alone():
    sched = make(max_num_batched_tokens=64, enable_chunked_prefill=False)
    a = seq(3)
    sched.add(a)
    fake_step(sched)
    big, small = seq(100), seq(10)
    sched.add(big)
    sched.add(small)
    step = sched.schedule()
    assert step.prefill and [(w.seq, w.new) for w in step.work] == [(big, 100)], "alone, even beyond the budget"
    sched.update(step.work, step.seqs, np.full(1, 7))
    step = sched.schedule()
    assert [(w.seq, w.new) for w in step.work] == [(small, 10)] and step.prefill


def test_a_shared_prefix_is_computed_once_and_reused_with_reference_counts():
    sched = make(block_size=4)
    instruction = [next(_fresh) for _ in range(12)]  # three full blocks
    first = seq(15, prefix=instruction)
    sched.add(first)
    fake_step(sched)
    others = [seq(14, prefix=instruction) for _ in range(3)]
    for s in others:
        sched.add(s)
    step = sched.schedule()
    assert [w.new for w in step.work if w.seq in others] == [2, 2, 2], "only the part after the prefix"
    assert all(s.blocks[:3] == first.blocks[:3] for s in others)
    assert sched.blocks.hit_tokens == 36 and sched.blocks.query_tokens == 15 + 3 * 14
    owned_blocks_are_consistent(sched)


def test_a_whole_prompt_in_the_cache_still_computes_its_last_block():
    sched = make(block_size=4)
    a = seq(8)
    sched.add(a)
    fake_step(sched)
    twin = Sequence(request_id="twin", prompt_ids=list(a.prompt_ids), params=SamplingParams())
    sched.add(twin)
    step = sched.schedule()
    assert [w.new for w in step.work if w.seq is twin] == [4]  # first block reused, the last one recomputed


def test_freed_cached_blocks_are_reused_until_their_space_is_needed_least_recent_first():
    sched = make(num_blocks=8, block_size=4, max_num_seqs=4)
    a, b = seq(9), seq(9)  # two full blocks each, plus one token
    held = {}
    for s in (a, b):
        sched.add(s)
        fake_step(sched)
        held[s.request_id] = s.blocks[:2]
        sched.retire(s)
    assert sched.blocks.cached_blocks == 4 and sched.blocks.num_free == 8
    again = Sequence(request_id="again", prompt_ids=list(b.prompt_ids), params=SamplingParams())
    sched.add(again)
    step = sched.schedule()
    assert [w.new for w in step.work] == [1] and again.blocks[:2] == held[b.request_id]
    sched.retire(again)
    big = seq(24)  # 6 blocks: the 4 without contents, then the 2 least recently freed: a's
    sched.add(big)
    fake_step(sched)
    twin = {s.request_id: Sequence(request_id="twin", prompt_ids=list(s.prompt_ids), params=SamplingParams())
            for s in (a, b)}
    assert sched.blocks.lookup(twin[a.request_id]) == [], "a's blocks were freed longest ago: evicted"
    assert sched.blocks.lookup(twin[b.request_id]) == held[b.request_id], "b's were used again since"


def test_reference_counts_stay_right_under_preemption_and_cancellation():
    rng = random.Random(1)
    sched = make(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    instruction = [next(_fresh) for _ in range(8)]
    live: list[Sequence] = []
    for _ in range(300):
        if rng.random() < 0.4:
            s = seq(rng.randint(9, 20), prefix=instruction if rng.random() < 0.7 else None, max_tokens=30)
            sched.add(s)
            live.append(s)
        fake_step(sched)
        if sched.running and rng.random() < 0.1:  # a client cancels
            sched.retire(rng.choice(sched.running))
        if sched.waiting and rng.random() < 0.05:
            sched.retire(sched.waiting[-1])
        owned_blocks_are_consistent(sched)
        assert all(len(s.blocks) * 4 >= s.num_computed for s in sched.running)
    assert sched.preemptions > 0 and sched.blocks.hit_tokens > 0


def test_the_youngest_is_preempted_when_running_sequences_cannot_grow_then_recomputed():
    sched = make(num_blocks=3, block_size=4, enable_prefix_caching=False)
    old, young = seq(4), seq(4)
    sched.add(old)
    sched.add(young)
    assert fake_step(sched) == [old, young]  # one block each, one left
    assert fake_step(sched) == [old]  # both need a 2nd block for token 5: the oldest gets it
    assert young.status is Status.WAITING and young.num_computed == 0 and young.blocks == []
    assert old.status is Status.RUNNING and sched.preemptions == 1
    assert young.pending_ids(5) == young.prompt_ids + young.output_ids  # recompute everything
    sched.retire(old)
    step = sched.schedule()
    assert step.prefill and step.seqs == [young] and step.work[0].new == 5


def test_the_budget_is_never_exceeded_under_random_load():
    rng = random.Random(0)
    sched = make(num_blocks=20, block_size=4, max_num_seqs=8, max_num_batched_tokens=24)
    for _ in range(400):
        if rng.random() < 0.3:
            sched.add(seq(rng.randint(1, 20)))
        step = sched.schedule()
        if step is None:
            continue
        assert sum(w.new for w in step.work) <= 24
        sampled = [w.seq for w in step.work if w.samples]
        for s in sched.update(step.work, sampled, np.full(len(sampled), 7)):
            sched.retire(s)
        for s in [s for s in sched.running if len(s.output_ids) >= rng.randint(1, 30)]:
            sched.retire(s)
        owned_blocks_are_consistent(sched)
        assert len(sched.running) <= 8


def test_static_scheduling_admits_one_group_into_an_empty_engine_only():
    sched = make(scheduling="static", max_num_seqs=8)
    g0 = [seq(4, group=0) for _ in range(2)]
    g1 = [seq(4, group=1) for _ in range(2)]
    for s in g0 + g1:
        sched.add(s)
    assert fake_step(sched) == g0
    sched.retire(g0[0])
    assert fake_step(sched) == [g0[1]]  # g1 waits although there is room
    sched.retire(g0[1])
    assert fake_step(sched) == g1


def test_admission_cap_after_a_size_failure_limits_admissions_only_and_recovers(monkeypatch):
    sched = make(max_num_seqs=8, oom_backoff_seconds=10)
    for s in [seq(4) for _ in range(2)]:
        sched.add(s)
    fake_step(sched)
    sched.lower_admit_cap(8)
    assert sched.admit_cap == 4
    for s in [seq(4) for _ in range(6)]:
        sched.add(s)
    assert len(fake_step(sched)) == 2 + 4, "a step admits at most the lowered cap"
    assert len(fake_step(sched)) == 6 + 2, "and the next one the rest, up to max_num_seqs"
    assert len(fake_step(sched)) == 8, "every running sequence decodes: the cap never limits them"
    import batchstring.engine.scheduler as module

    now = module.time.monotonic()
    monkeypatch.setattr(module.time, "monotonic", lambda: now + 11)
    assert sched.admit_cap == 8


def test_update_ends_sequences_at_eos_and_at_max_tokens_unless_eos_is_ignored():
    sched = make()
    eos, length, ignoring = seq(3), seq(3, max_tokens=1), seq(3)
    ignoring.params = SamplingParams(max_tokens=64, ignore_eos=True)
    for s in (eos, length, ignoring):
        sched.add(s)
    step = sched.schedule()
    ended = sched.update(step.work, step.seqs, np.array([EOS, 5, EOS]))
    assert ended == {eos: "stop", length: "length"}
    assert [s.num_computed for s in step.seqs] == [3, 3, 3] and ignoring.output_ids == [EOS]


def test_block_manager_refuses_to_over_allocate():
    blocks = BlockManager(2, 4, 1, 64)
    s = seq(1)
    blocks.grow(s, 8)
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.grow(s, 9)


def test_chunked_prefill_needs_a_budget_for_every_decoding_sequence():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model_dir=Path("."), max_num_seqs=64, max_num_batched_tokens=32)
    assert EngineConfig(model_dir=Path("."), max_num_seqs=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_requests_arriving_together_compute_their_shared_instruction_once():
    sched = make(block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_seqs=8)
    instruction = [next(_fresh) for _ in range(24)]  # six blocks, prefilled 8 tokens per step
    batch = [seq(27, prefix=instruction) for _ in range(6)]
    for s in batch:
        sched.add(s)
    computed = 0
    while any(not s.output_ids for s in batch):
        step = sched.schedule()
        computed += sum(w.new for w in step.work if not w.seq.output_ids)
        sampled = [w.seq for w in step.work if w.samples]
        sched.update(step.work, sampled, np.full(len(sampled), 7))
    assert computed == 27 + 5 * 3, "the instruction is computed by one request and reused by the other five"
    assert all(s.blocks[:6] == batch[0].blocks[:6] for s in batch)


def test_interactive_requests_are_admitted_first_and_take_seats_from_background_rows():
    sched = make(max_num_seqs=4, max_num_batched_tokens=64)
    background = [seq(3) for _ in range(6)]
    for s in background:
        s.priority = 2
        sched.add(s)
    assert set(fake_step(sched)) == set(background[:4]), "background rows fill an idle engine"
    interactive = [seq(3) for _ in range(2)]
    for s in interactive:
        sched.add(s)
    scheduled = sched.schedule()
    assert all(w.seq.status is Status.RUNNING and w.seq.row is not None for w in scheduled.work), \
        "a row that gave way is in no step"
    sampled = [w.seq for w in scheduled.work if w.samples]
    for s in sched.update(scheduled.work, sampled, np.full(len(sampled), 7)):
        sched.retire(s)
    step = scheduled.seqs
    assert set(interactive) <= set(step), "interactive requests take seats at once, ahead of older background ones"
    assert sched.preemptions == 2 and len(sched.running) == 4
    assert {s for s in background[:4] if s not in sched.running} == {background[3], background[2]}, \
        "the youngest background rows give way"
    owned_blocks_are_consistent(sched)
    while sched.has_work():
        fake_step(sched)
    assert all(s.finished for s in background + interactive), "background rows resume and finish"
    assert sched.blocks.num_free == sched.blocks.num_blocks, "every block is free again"


def test_without_background_requests_admission_stays_first_come_first_served():
    sched = make(max_num_seqs=2)
    first, second, third = seq(3), seq(3), seq(3)
    for s in (first, second, third):
        sched.add(s)
    assert set(fake_step(sched)) == {first, second} and sched.preemptions == 0
