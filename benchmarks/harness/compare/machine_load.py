"""Did other processes compete for the CPU during the real runs?

Real CPU comparisons are only as good as the machine is quiet: a process that steals
cycles from one arm's run and not the other's moves the ratio. Before and after the
runs we read the system's busy CPU time (``/proc/stat``) and this process's own CPU
time with its finished children (``/proc/self/stat``: utime + stime + cutime + cstime;
every run is a waited child, so its ranks' time lands there). What the system spent
beyond that was spent by other processes. A short window before the runs tells
whether the machine was already busy; the 1-minute load average is reported beside.

Readers are injectable so the logic is tested with made-up readings.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

BUSY_CORES_WARN = 0.25
"""Other processes' mean CPU use (cores) above which the runs are flagged."""


@dataclass(frozen=True)
class LoadSample:
    """One reading of the machine."""

    t: float
    """Monotonic clock, s."""
    busy_s: float
    """CPU seconds the whole system spent busy since boot (all cores)."""
    own_s: float
    """CPU seconds of this process and its waited-for children."""
    loadavg: float
    """1-minute load average."""


def _proc_busy_s() -> float:
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_own_s() -> float:
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    # After the command name: state is field 3, utime..cstime are fields 14-17.
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def sample(busy: Callable[[], float] = _proc_busy_s, own: Callable[[], float] = _proc_own_s,
           loadavg: Callable[[], float] = lambda: os.getloadavg()[0],
           clock: Callable[[], float] = time.monotonic) -> LoadSample:
    """Read the machine now (the defaults read /proc and os.getloadavg)."""
    return LoadSample(clock(), busy(), own(), loadavg())


def other_cores(before: LoadSample, after: LoadSample) -> float:
    """Mean CPU cores other processes used between two samples."""
    dt = after.t - before.t
    if dt <= 0:
        return 0.0
    other = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(other, 0.0) / dt


def cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def verdict(idle_window: tuple, runs: tuple, ncpu: int,
            threshold: float = BUSY_CORES_WARN) -> dict:
    """The load record of a comparison and its one warning line (None when quiet).

    Args:
        idle_window: ``(sample, sample)`` around a short wait before any run.
        runs: ``(sample, sample)`` before the first run and after the last.
        ncpu: CPUs of the machine.
    """
    pre = other_cores(*idle_window)
    during = other_cores(*runs)
    rec = {"other_cores_before": pre, "other_cores_during": during, "cpus": ncpu,
           "loadavg_before": runs[0].loadavg, "loadavg_after": runs[1].loadavg,
           "warning": None}
    if max(pre, during) > threshold:
        rec["warning"] = (
            f"WARNING: other processes competed for the CPU: {during:.2f} of {ncpu} cores on "
            f"average during the runs ({pre:.2f} just before; load average "
            f"{runs[0].loadavg:.2f} before, {runs[1].loadavg:.2f} after); the measured ratios "
            "are less reliable, rerun on a quiet machine")
    return rec


def idle_window(seconds: float = 2.0, sleep: Callable[[float], None] = time.sleep,
                read: Optional[Callable[[], LoadSample]] = None) -> tuple:
    """Two samples ``seconds`` apart while this process sleeps."""
    read = read or sample
    a = read()
    sleep(seconds)
    return a, read()
