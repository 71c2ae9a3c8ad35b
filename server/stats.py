"""What the server did: Triton's own statistics API and the engine's Prometheus metrics."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass

from tritonclient.grpc import InferenceServerClient

from batchstring.client.defaults import MODEL

# The model publishes its counters twice a second (model_repository/llm/1/metrics.py PUBLISH_SECONDS):
# a read this long after some work finds it published, but for a publication running late.
SETTLE_SECONDS = 0.6


@dataclass(frozen=True)
class BatchStats:
    """Cumulative since the server started; subtract two snapshots for an interval."""

    requests: int  # requests that reached execute()
    executions: int  # execute() calls, i.e. batches formed by Triton's dynamic batcher
    queue_ns: int  # total time requests waited in Triton's queue

    @property
    def average_batch(self) -> float:
        return self.requests / self.executions if self.executions else 0.0

    @property
    def average_queue_ms(self) -> float:
        return self.queue_ns / self.requests / 1e6 if self.requests else 0.0

    def __sub__(self, other: BatchStats) -> BatchStats:
        return BatchStats(self.requests - other.requests, self.executions - other.executions,
                          self.queue_ns - other.queue_ns)


def batch_stats(grpc_url: str) -> BatchStats:
    client = InferenceServerClient(grpc_url)
    try:
        stats = client.get_inference_statistics(model_name=MODEL).model_stats[0]
    finally:
        client.close()
    return BatchStats(stats.inference_count, stats.execution_count, stats.inference_stats.queue.ns)


def settled_metrics(metrics_url: str) -> dict[str, float]:
    """`metrics` once the model has published what it did until now (blocks SETTLE_SECONDS)."""
    time.sleep(SETTLE_SECONDS)
    return metrics(metrics_url)


def metrics(metrics_url: str) -> dict[str, float]:
    """Prometheus text format, summed over labels: {"batchstring_steps_total": 123.0, ...}."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals
