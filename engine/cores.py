"""The cores this process may keep busy, for what sizes its own threads (the runtime's, the mask pool's)."""

from __future__ import annotations

import os
from pathlib import Path


def available_cores(cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The cores this process may keep busy: its CPU affinity, capped by the cgroup's CPU quota (a
    container's `--cpus`, a pod's CPU limit), which the affinity does not show. Rounded down: a
    spinning thread past the quota gets the whole container throttled."""
    cores = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota(cgroup)
    return cores if quota is None else max(1, min(cores, int(quota)))


def _cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs' worth of time per period from cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us); None: no limit."""
    if (root / "cpu.max").exists():
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    v1 = root / "cpu"
    if (v1 / "cpu.cfs_quota_us").exists():
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    return None
