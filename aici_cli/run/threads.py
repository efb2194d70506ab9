"""How many CPU threads a run's torch work uses (`--threads`, `AICI_BATCH_THREADS`).

torch's own default is the machine's core count, which on a shared CPU (a CI runner
running jobs side by side, a container with a CPU quota) oversubscribes the cores: with
one other busy process on 2 cores a forward step took 187 ms at the default against
58 ms with one thread. The default here is what this process may actually use: the CPUs
of its affinity mask, bounded by its cgroup's CPU quota (v2 `cpu.max`, v1
`cpu.cfs_quota_us`), and an `OMP_NUM_THREADS` the user set wins over both.

Torch-free: `apply` sets the OpenMP/MKL variables while torch is not imported yet (they
are read once, when its thread pool starts) and calls `torch.set_num_threads` only where
torch already is.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# The variables torch's CPU backends read when their thread pools start.
_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _cgroup_v2_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """The unified hierarchy's directories of this process, leaf first, up to the root
    (a quota set on any ancestor bounds the process too)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
            for base in (root, root / "unified"):
                if (base / "cgroup.controllers").exists() or (base / "cpu.max").exists():
                    leaf = base / rel if rel else base
                    return [leaf, *[p for p in leaf.parents if p.is_relative_to(base)]]
    return []


def _v2_quota(dirs: list[Path]) -> float | None:
    """The smallest `cpu.max` quota among `dirs`, in CPUs ("max": none)."""
    quotas: list[float] = []
    for d in dirs:
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota != "max" and float(period) > 0:
            quotas.append(float(quota) / float(period))
    return min(quotas) if quotas else None


def _v1_quota(proc_cgroup: str, root: Path) -> float | None:
    """cgroup v1's `cpu.cfs_quota_us / cpu.cfs_period_us` (-1: none)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "cpu" in parts[1].split(","):
            rel = parts[2].strip().lstrip("/")
            for base in (root / "cpu", root / "cpu,cpuacct"):
                d = base / rel if (base / rel).exists() else base
                try:
                    quota = float((d / "cpu.cfs_quota_us").read_text())
                    period = float((d / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return quota / period if quota > 0 and period > 0 else None
    return None


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                     proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's CPU quota in CPUs (1.5: one and a half), or None without one."""
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return None
    quota = _v2_quota(_cgroup_v2_dirs(text, root))
    return quota if quota is not None else _v1_quota(text, root)


def available_cpus(root: Path = Path("/sys/fs/cgroup"),
                   proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may use: its affinity mask, bounded by its cgroup quota
    rounded down (a thread throttled by the quota holds up every OpenMP barrier of the
    others), at least 1."""
    cpus = _affinity()
    quota = cgroup_cpu_quota(root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def default_threads() -> int:
    """`--threads` when not given: a valid OMP_NUM_THREADS the user set, else the CPUs
    this process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return available_cpus()


def apply(threads: int | None) -> int:
    """Make torch use `threads` (None: `default_threads()`); returns the count. Before
    torch is imported it sets the OpenMP/MKL variables its thread pool reads when it
    starts; after, `torch.set_num_threads`."""
    n = default_threads() if threads is None else threads
    if "torch" in sys.modules:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
    else:
        for name in _ENV_VARS:
            os.environ[name] = str(n)
    return n
