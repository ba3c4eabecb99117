"""How many CPUs this process may use: what a worker sizes its thread pool by.

``os.cpu_count()`` is the machine's count. A process pinned to some cores (taskset, a cpuset)
or given a CPU quota (a container's limit: cgroup v2 ``cpu.max``, v1 ``cfs_quota_us``) can use
fewer, and a thread pool sized for the machine then time-slices against its own quota: every
step is throttled."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may run on, capped by its cgroup's CPU quota (rounded up)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        count = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(count, math.ceil(quota)) if quota is not None else count)


def _cgroup_quota(cgroup: Path) -> float | None:
    """CPUs' worth of time per period the cgroup allows, or None when unlimited or unknown."""
    try:
        fields = (cgroup / "cpu.max").read_text().split()  # v2: "max 100000" or "200000 100000"
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    except (OSError, ValueError):
        pass
    try:  # v1
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
