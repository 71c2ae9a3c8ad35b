"""Scheduler and block manager, without a model: admission, retirement, preemption, budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.tokenizer import StreamDecoder


def seq(prompt_len: int, group: int = 0) -> Sequence:
    return Sequence(request_id=f"r{random.random()}", prompt="x", prompt_ids=[1] * prompt_len,
                    params=SamplingParams(max_tokens=64), sink=lambda out: None,
                    decoder=StreamDecoder([b"x"] * 4), group=group)


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(model_dir=Path("."), block_size=block_size, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def fake_step(sched: Scheduler) -> list[Sequence]:
    """What the engine does after a successful step: everything pending is cached, one token sampled."""
    step = sched.schedule()
    if step is None:
        return []
    for s in step.seqs:
        s.num_cached = s.num_tokens
        s.output_ids.append(7)
    return step.seqs


def test_admission_stops_at_max_num_seqs_and_decodes_the_running_batch():
    sched = make(max_num_seqs=3)
    seqs = [seq(5) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.prefill and step.seqs == seqs[:3]
    fake_step_result = step.seqs
    for s in fake_step_result:
        s.num_cached, s.output_ids = s.num_tokens, [7]
    step = sched.schedule()
    assert not step.prefill and step.seqs == seqs[:3]
    assert [s.status for s in seqs[3:]] == [Status.WAITING] * 2


def test_retired_sequence_frees_its_blocks_and_a_waiting_one_joins_next_iteration():
    sched = make(max_num_seqs=2)
    a, b, c = seq(8), seq(8), seq(8)
    for s in (a, b, c):
        sched.add(s)
    fake_step(sched)
    free_before = sched.blocks.num_free
    sched.retire(a)
    assert sched.blocks.num_free == free_before + 2 and a.blocks == []
    step = sched.schedule()
    assert step.prefill and step.seqs == [c]


def test_admission_respects_the_kv_budget():
    sched = make(num_blocks=6, block_size=4)  # 24 tokens
    big = [seq(10), seq(10), seq(10)]  # 3 blocks each
    for s in big:
        sched.add(s)
    step = sched.schedule()
    assert step.seqs == big[:1]  # the second would leave less than the watermark for growth
    assert sched.blocks.num_free >= 1


def test_youngest_is_preempted_when_running_sequences_cannot_grow_then_recomputed():
    sched = make(num_blocks=3, block_size=4)
    old, young = seq(4), seq(4)
    sched.add(old)
    sched.add(young)
    assert fake_step(sched) == [old, young]  # one block each, one left
    assert fake_step(sched) == [old]  # both need a 2nd block for token 5: the oldest gets it
    assert young.status is Status.WAITING and young.num_cached == 0 and young.blocks == []
    assert old.status is Status.RUNNING and sched.preemptions == 1
    assert young.pending_ids == young.prompt_ids + young.output_ids  # recompute everything
    sched.retire(old)
    step = sched.schedule()
    assert step.prefill and step.seqs == [young] and len(young.pending_ids) == 5


def test_budget_is_never_exceeded_under_random_load():
    rng = random.Random(0)
    sched = make(num_blocks=20, block_size=4, max_num_seqs=8)
    live: list[Sequence] = []
    for _ in range(400):
        if rng.random() < 0.3:
            s = seq(rng.randint(1, 20))
            sched.add(s)
            live.append(s)
        for s in fake_step(sched):
            if len(s.output_ids) >= rng.randint(1, 30):
                sched.retire(s)
        owned = [b for s in sched.running for b in s.blocks]
        assert len(owned) == len(set(owned)) and len(owned) + sched.blocks.num_free == 20
        assert all(len(s.blocks) * 4 >= s.num_cached for s in sched.running)
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


def test_cap_after_out_of_memory_halves_the_step_and_recovers(monkeypatch):
    sched = make(max_num_seqs=8, oom_backoff_seconds=10)
    sched.lower_cap(8)
    assert sched.step_cap == 4
    import engine.scheduler as module

    now = module.time.monotonic()
    monkeypatch.setattr(module.time, "monotonic", lambda: now + 11)
    assert sched.step_cap == 8


def test_block_manager_refuses_to_over_allocate():
    blocks = BlockManager(2, 4)
    s = seq(1)
    blocks.grow(s, 8)
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.grow(s, 9)
