"""What the engine counts: monotonic counters and current gauges, published as Triton metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Counters, read by the metrics publisher from another thread: the engine only bumps them."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    verify_rows: int = 0  # row-steps that carried drafts
    drafted_at: list[int] = field(default_factory=list)  # per draft position (0 = first): drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: accepted

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.verify_rows += 1
        if len(self.drafted_at) < drafted:  # sized by the longest draft seen
            grow = drafted - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1


@dataclass
class EngineStats:
    """Read by the metrics publisher from another thread; the engine only bumps plain fields."""

    steps: int = 0
    prefill_steps: int = 0
    step_seqs: int = 0  # sum of step batch sizes: step_seqs / steps = mean batch
    last_step_size: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    failures_isolated: int = 0
    oom_events: int = 0
    cancelled: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of which found there (not computed again)
    cached_blocks: int = 0  # KV blocks whose contents the prefix cache can offer
    step_sizes: dict[int, int] = field(default_factory=dict)  # batch size -> steps of that size
    runner_seconds: float = 0.0  # time inside the runner's step: the rest of a step is host work
    forced_tokens: int = 0  # generated without a step: the only tokens a grammar admitted (engine/grammar.py)

    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # n-gram drafts (engine/speculation.py)

    def reset(self) -> None:
        """Counts from zero again (after the warm-up), in place: every holder keeps reading this object."""
        self.__dict__.update(EngineStats().__dict__)

    def record_step(self, size: int, prefill: bool) -> None:
        self.steps += 1
        self.step_seqs += size
        self.last_step_size = size
        self.step_sizes[size] = self.step_sizes.get(size, 0) + 1
        self.prefill_steps += prefill

    def record_finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
