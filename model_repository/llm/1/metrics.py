"""Publishes engine statistics as Triton custom metrics (served at :8002/metrics).

Each metric update is a round trip to the Triton process, so the engine only bumps plain
counters and this thread copies them out twice a second, as deltas for counters.
"""

from __future__ import annotations

import threading

from batchstring.engine.stats import EngineStats

PUBLISH_SECONDS = 0.5

GAUGES = {
    "running": ("batchstring_running_sequences", "Sequences in the running batch"),
    "waiting": ("batchstring_waiting_sequences", "Sequences accepted by the engine, waiting for admission"),
    "kv_usage": ("batchstring_kv_cache_utilization", "Fraction of KV-cache blocks in use (0-1)"),
    "last_step_size": ("batchstring_step_batch_size", "Sequences in the most recent engine step"),
    "cached_blocks": ("batchstring_prefix_cache_blocks", "KV-cache blocks the prefix cache can offer (in use or free)"),
}
COUNTERS = {
    "steps": ("batchstring_steps_total", "Engine steps (prefill and decode)"),
    "prefill_steps": ("batchstring_prefill_steps_total", "Engine steps that admitted new sequences"),
    "step_seqs": ("batchstring_step_sequences_total", "Sum of step batch sizes (divide by steps for the mean)"),
    "prompt_tokens": ("batchstring_prompt_tokens_total", "Prompt tokens of requests that started generating"),
    "generated_tokens": ("batchstring_generated_tokens_total", "Tokens generated"),
    "preemptions": ("batchstring_preemptions_total", "Sequences preempted (cache freed, recomputed later)"),
    "failures_isolated": ("batchstring_failures_isolated_total", "Requests failed alone after a step error"),
    "oom_events": ("batchstring_oom_events_total", "Steps that ran out of memory"),
    "cancelled": ("batchstring_cancelled_total", "Requests stopped because nobody will read them (cancelled, "
                  "past their deadline, caller unreachable)"),
    "prefix_query_tokens": ("batchstring_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache"),
    "prefix_hit_tokens": ("batchstring_prefix_cache_hits_total", "Prompt tokens found in the prefix cache (hit rate: "
                          "hits / queries)"),
}
SPECULATION = {
    "drafted": ("batchstring_spec_decode_draft_tokens_total", "Speculative (n-gram) draft tokens verified"),
    "accepted": ("batchstring_spec_decode_accepted_tokens_total", "Draft tokens accepted (acceptance rate: "
                 "accepted / drafted; tokens per verified row: 1 + accepted / verify rows)"),
    "verify_rows": ("batchstring_spec_decode_verify_rows_total", "Row-steps that carried drafts"),
}
PER_POSITION = {
    "drafted_at": ("batchstring_spec_decode_draft_tokens_per_pos_total", "Draft tokens verified, by position in the "
                   "draft (1 = first)"),
    "accepted_at": ("batchstring_spec_decode_accepted_tokens_per_pos_total", "Draft tokens accepted, by position"),
}
FINISH_REASONS = ("stop", "length", "abort", "error")


class MetricsPublisher:
    def __init__(self, pb_utils, stats: EngineStats, model: str, instance: str, draft_positions: int) -> None:
        labels = {"model": model, "instance": instance}
        self.stats = stats

        def family(name: str, text: str, kind):
            return pb_utils.MetricFamily(name=name, description=text, kind=kind)

        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self.families = [family(n, t, gauge) for n, t in GAUGES.values()]
        self.families += [family(n, t, counter) for n, t in COUNTERS.values()]
        self.gauges = {k: f.Metric(labels=labels) for k, f in zip(GAUGES, self.families)}
        self.counters = {k: f.Metric(labels=labels) for k, f in zip(COUNTERS, self.families[len(GAUGES):])}
        finished = family("batchstring_requests_finished_total", "Requests finished, by finish_reason", counter)
        self.families.append(finished)
        self.finished = {r: finished.Metric(labels={**labels, "reason": r}) for r in FINISH_REASONS}
        self.speculation = {}
        for key, (name, text) in SPECULATION.items():
            self.families.append(family(name, text, counter))
            self.speculation[key] = self.families[-1].Metric(labels=labels)
        for key, (name, text) in PER_POSITION.items():
            self.families.append(family(name, text, counter))
            for i in range(draft_positions):
                self.speculation[f"{key}:{i}"] = self.families[-1].Metric(labels={**labels, "position": str(i + 1)})
        self._sent: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchstring-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.publish()

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_SECONDS):
            self.publish()

    def publish(self) -> None:
        for key, metric in self.gauges.items():
            metric.set(float(getattr(self.stats, key)))
        totals = {key: float(getattr(self.stats, key)) for key in self.counters}
        totals.update({f"finished:{r}": float(self.stats.finished.get(r, 0)) for r in FINISH_REASONS})
        spec = self.stats.speculation
        totals.update({f"spec:{key}": float(getattr(spec, key)) for key in SPECULATION})
        totals.update({f"spec:{key}:{i}": float(n) for key in PER_POSITION for i, n in enumerate(getattr(spec, key))})
        for key, value in totals.items():
            delta = value - self._sent.get(key, 0.0)
            if delta > 0:
                self._target(key).increment(delta)
                self._sent[key] = value

    def _target(self, key: str):
        kind, _, name = key.partition(":")
        return {"finished": self.finished, "spec": self.speculation}.get(kind, self.counters)[name or kind]
