"""How many CPUs this process may really use: the container's limit, not the node's core count.

`os.cpu_count()` counts the node's cores. A pod limited to 2 CPUs on a 64-core node that sized a
thread pool from it would start 64 tokenizer threads and have the kernel throttle them all. The
limit is in the cgroup's CFS quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`)
and in the CPU affinity mask (`cpuset`, `taskset`); the smaller one is what the process gets.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Where cgroup v1 mounts the CPU controller: `cpu` is the usual name, `cpu,cpuacct` the directory
# it is a symlink to on some distributions, whose mount may be the only one a container sees.
_V1_DIRS = ("cpu", "cpu,cpuacct")


def available_cpus(root: Path = CGROUP_ROOT, affinity: int | None = None) -> int:
    """min(CPUs in the affinity mask, the CFS quota rounded up), at least 1.

    `root` and `affinity` are for tests: a directory of fake cgroup files, a mask's size. A
    quota of 1.5 CPUs counts as 2: the threads then use the whole quota, and a tokenizer thread
    mostly releases the GIL, so the spare one costs little.
    """
    cpus = _affinity() if affinity is None else affinity
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (quota / period), or None when it sets none or is unreadable.

    cgroup v2 is read first: on a hybrid host the v1 files may exist while v2 holds the limit.
    """
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _ratio(quota, period)
    for name in _V1_DIRS:
        v1_quota = _read(root / name / "cpu.cfs_quota_us")
        v1_period = _read(root / name / "cpu.cfs_period_us")
        if v1_quota is not None and v1_period is not None:
            return _ratio(v1_quota, v1_period)
    return None


def _ratio(quota: str, period: str) -> float | None:
    """quota / period; None for no limit (v2 `max`, v1 `-1`) or anything that is not numbers."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _affinity() -> int:
    # sched_getaffinity is Linux-only; elsewhere (a developer's macOS) the core count is the best
    # there is.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
