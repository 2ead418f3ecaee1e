"""CPU probing: the feature flags the kernel lists, the cores this process may use, and the
kind of CPU they make for the backend table (`selection.BACKENDS`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# Kinds of x86 CPU by their fastest int8 and bfloat16 matrix instructions, best first: a CPU
# is of the first kind it has any flag of. onnxruntime's kernels dispatch on the same flags.
CPU_KINDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("amx", frozenset({"amx_int8", "amx_bf16"})),
    ("avx512_vnni", frozenset({"avx512_vnni"})),
    ("avx_vnni", frozenset({"avx_vnni"})),
    ("avx2", frozenset({"avx2"})),
)


def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            line = next((line for line in info if line.startswith(field)), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel lists them (empty where it cannot be read)."""
    return set(_cpuinfo("flags").split())


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown CPU"


def cpu_kind(flags: set[str] | None = None) -> str:
    """The first of `CPU_KINDS` this CPU belongs to; "other" for none of them."""
    flags = cpu_flags() if flags is None else flags
    return next((kind for kind, mark in CPU_KINDS if mark & flags), "other")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's CPU limit, which affinity does not show)."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    return cores


def usable_physical_cores() -> int:
    """`usable_cores`, counting the hyperthreads of one core once, as onnxruntime's own
    default counts cores (which, left to itself, counts the whole host and pins a thread to
    each core, blind to a container's limit)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(topology.read_text().strip() if topology.exists() else str(cpu))
    return max(1, min(len(cores), usable_cores()))
