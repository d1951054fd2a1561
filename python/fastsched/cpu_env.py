"""What the CPU the engine runs on allows: how many threads it may use, and whether it
computes in bf16 natively (``--dtype auto``)."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

# CPU flags (/proc/cpuinfo) of native bf16 arithmetic: AVX512-BF16 dot products, AMX tiles.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_bf16() -> bool:
    """Whether bf16 matmuls run natively here (else torch emulates them, slower than fp32)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def usable_cpus() -> tuple[int, str]:
    """The cores this process may run on and why: its affinity mask, capped by a cgroup v2
    CPU quota (``cpu.max``) when one is set."""
    count, source = len(os.sched_getaffinity(0)), "affinity"
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max" and int(quota) // int(period) < count:
            count, source = max(1, int(quota) // int(period)), "cgroup cpu.max"
    except (OSError, ValueError):
        pass
    return count, source


def configure_threads(num_threads: int | None) -> int:
    """Sets torch's intra-op threads: ``num_threads`` if given, else ``OMP_NUM_THREADS`` if
    set, else the usable cores; logs which. Returns the count."""
    import torch

    if num_threads is not None:
        count, source = num_threads, "--num-threads"
    elif os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        count, source = int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    else:
        count, source = usable_cpus()
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    logger.info(
        "CPU compute: %d intra-op threads (from %s); native bf16: %s",
        count,
        source,
        "yes" if cpu_has_bf16() else "no",
    )
    return count
