"""One process's resource use, as Prometheus' standard ``process_*`` metrics measure it.

Every fastsched process (gateway, frontends, engines) reads its own with
:func:`read_process_stats` and the gateway exports them all on ``/metrics``, one series
per process (``gateway/metrics.py``). Linux only: elsewhere, or when ``/proc`` cannot be
read, the answer is None and nothing is exported. Standard library only, so that any
process may call it; a read costs a few system calls (well under a millisecond).
"""

from __future__ import annotations

import os
from typing import Final

PROC: Final = "/proc"

# name -> what it is, in Prometheus' own words for the standard process collector.
PROCESS_METRICS: Final[dict[str, str]] = {
    "cpu_seconds_total": "Total user and system CPU time spent in seconds.",
    "resident_memory_bytes": "Resident memory size in bytes.",
    "virtual_memory_bytes": "Virtual memory size in bytes.",
    "start_time_seconds": "Start time of the process since unix epoch in seconds.",
    "open_fds": "Number of open file descriptors.",
    "max_fds": "Maximum number of open file descriptors.",
}

_boot_time: float | None = None


def _boot_time_s(proc: str) -> float:
    global _boot_time
    if _boot_time is None:
        with open(os.path.join(proc, "stat"), "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    _boot_time = float(line.split()[1])
                    break
            else:
                raise ValueError("no btime in /proc/stat")
    return _boot_time


def read_process_stats(pid: int | str = "self", proc: str = PROC) -> dict[str, float] | None:
    """``{name: value}`` for the names of :data:`PROCESS_METRICS` plus ``pid``; None when
    ``/proc`` is not there or the process is gone."""
    try:
        base = os.path.join(proc, str(pid))
        with open(os.path.join(base, "stat"), "rb") as f:
            stat = f.read()
        # Fields after the command name, which is in parentheses and may hold spaces.
        fields = stat[stat.rindex(b")") + 2 :].split()
        ticks = os.sysconf("SC_CLK_TCK")
        stats = {
            "pid": float(os.getpid() if pid == "self" else int(pid)),
            "cpu_seconds_total": (int(fields[11]) + int(fields[12])) / ticks,  # utime + stime
            "virtual_memory_bytes": float(fields[20]),
            "resident_memory_bytes": float(int(fields[21]) * os.sysconf("SC_PAGE_SIZE")),
            "start_time_seconds": int(fields[19]) / ticks + _boot_time_s(proc),
            "open_fds": float(len(os.listdir(os.path.join(base, "fd")))),
        }
        with open(os.path.join(base, "limits"), "rb") as f:
            for line in f:
                if line.startswith(b"Max open files"):
                    soft = line.split()[3]
                    stats["max_fds"] = float("inf") if soft == b"unlimited" else float(soft)
        return stats
    except (OSError, ValueError, IndexError):
        return None
