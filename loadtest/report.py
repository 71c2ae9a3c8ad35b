"""Tables and plots for `batchstring bench` results."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

COLUMNS = ("system", "conc.", "out tok/s", "req/s", "p50", "p90", "p99", "TTFT p50", "x no-batching", "x ceiling",
           "Triton batch", "engine step batch")


def _s(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f} s"


def markdown_table(points) -> str:
    by = {(p.system, p.concurrency): p for p in points}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    order = list(dict.fromkeys(q.system for q in points))
    for p in sorted(points, key=lambda p: (p.concurrency, order.index(p.system))):
        reference = "ceiling-sampled" if p.system.endswith("-sampled") else "ceiling"  # same sampling
        base, ceiling = by.get(("no-batching", p.concurrency)), by.get((reference, p.concurrency))
        cells = [
            p.system, str(p.concurrency), f"{p.tokens_per_s:.0f}", f"{p.requests_per_s:.2f}",
            _s(p.p50_s), _s(p.p90_s), _s(p.p99_s), _s(p.ttft_p50_s),
            f"{p.tokens_per_s / base.tokens_per_s:.2f}" if base else "—",
            f"{p.tokens_per_s / ceiling.tokens_per_s:.2f}" if ceiling else "—",
            f"{p.extra['triton_batch']:.1f}" if "triton_batch" in p.extra else "—",
            f"{p.extra['engine_step_batch']:.1f}" if "engine_step_batch" in p.extra else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points, out_dir: Path) -> None:
    systems = list(dict.fromkeys(p.system for p in points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        series = sorted((p for p in points if p.system == system), key=lambda p: p.concurrency)
        ax.plot([p.concurrency for p in series], [p.tokens_per_s for p in series], marker="o", label=system)
    ax.set(xscale="log", xlabel="client concurrency (closed loop)", ylabel="output tokens/s",
           title="Throughput vs concurrency")
    levels = sorted({p.concurrency for p in points})
    ax.set_xticks(levels, labels=[str(c) for c in levels])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        series = sorted((p for p in points if p.system == system and not math.isnan(p.p99_s)),
                        key=lambda p: p.concurrency)
        if series:
            ax.plot([p.tokens_per_s for p in series], [p.p99_s for p in series], marker="o", label=system)
            for p in series:
                ax.annotate(str(p.concurrency), (p.tokens_per_s, p.p99_s), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set(yscale="log", xlabel="output tokens/s", ylabel="p99 request latency (s)",
           title="p99 latency vs throughput (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "latency.png", dpi=120)
    plt.close(fig)
