"""Scheduler and block manager, without a model: admission, retirement, preemption, budget."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.policy import policy_for
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

EOS = 0


def seq(prompt_len: int, group: int = 0, max_tokens: int = 64) -> Sequence:
    return Sequence(request_id=f"r{random.random()}", prompt_ids=[1] * prompt_len,
                    params=SamplingParams(max_tokens=max_tokens), group=group)


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(model_dir=Path("."), block_size=block_size, **cfg)
    blocks = BlockManager(num_blocks, block_size, config.max_num_seqs, 512)
    return Scheduler(config, blocks, policy_for(config.scheduling), (EOS,))


def fake_step(sched: Scheduler, token: int = 7) -> list[Sequence]:
    """A successful step as the engine reports it: every row samples `token`."""
    step = sched.schedule()
    if step is None:
        return []
    ended = sched.update(step.work, step.seqs, np.full(len(step.work), token))
    for s, _ in ended:
        sched.retire(s)
    return step.seqs


def test_admission_stops_at_max_num_seqs_and_decodes_the_running_batch():
    sched = make(max_num_seqs=3)
    seqs = [seq(5) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.prefill and step.seqs == seqs[:3]
    sched.update(step.work, step.seqs, np.full(3, 7))
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
    assert young.pending_ids(5) == young.prompt_ids + young.output_ids  # recompute everything
    sched.retire(old)
    step = sched.schedule()
    assert step.prefill and step.seqs == [young] and step.work[0].new == 5


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


def test_admission_cap_after_a_size_failure_limits_admissions_only_and_recovers(monkeypatch):
    sched = make(max_num_seqs=8, oom_backoff_seconds=10)
    running = [seq(4) for _ in range(2)]
    for s in running:
        sched.add(s)
    fake_step(sched)
    sched.lower_admit_cap(8)
    assert sched.admit_cap == 4
    for s in [seq(4) for _ in range(6)]:
        sched.add(s)
    assert len(fake_step(sched)) == 4, "a prefill step admits at most the lowered cap"
    assert len(fake_step(sched)) == 2, "and the next one the rest, up to max_num_seqs"
    assert len(fake_step(sched)) == 8, "every running sequence decodes: the cap never limits them"
    import engine.scheduler as module

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
    ended = dict(sched.update(step.work, step.seqs, np.array([EOS, 5, EOS])))
    assert ended == {eos: "stop", length: "length"}
    assert [s.num_cached for s in step.seqs] == [3, 3, 3] and ignoring.output_ids == [EOS]


def test_block_manager_refuses_to_over_allocate():
    blocks = BlockManager(2, 4, 1, 64)
    s = seq(1)
    blocks.grow(s, 8)
    with pytest.raises(RuntimeError, match="exhausted"):
        blocks.grow(s, 9)
