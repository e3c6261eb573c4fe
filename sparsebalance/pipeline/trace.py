"""Chrome-trace JSON and Gantt PNG of predicted (or recorded) step timelines.

Chrome trace: one process per DP replica, one thread per pipeline rank, complete
("X") events in microseconds; open in chrome://tracing or Perfetto.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

from ..io import atomic_path, atomic_write_bytes
from .simulate import PHASES, PipelineTimeline, op_id


def trace_events(res: PipelineTimeline, label: str = "", pid_offset: int = 0) -> List[dict]:
    """Chrome-trace events of a step result (critical-path ops get ``args.critical``)."""
    crit = set(res.critical_path)
    D, _, M, S = res.start_ms.shape
    ev: List[dict] = []
    for d in range(D):
        pid = pid_offset + d
        ev.append({"name": "process_name", "ph": "M", "pid": pid,
                   "args": {"name": f"{label} dp{d}".strip()}})
        for r in range(res.pp):
            ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": r,
                       "args": {"name": f"pp rank {r}"}})
        for p in range(2):
            for m in range(M):
                for s in range(S):
                    oid = op_id(p, d, m, s)
                    t0, t1 = float(res.start_ms[d, p, m, s]), float(res.end_ms[d, p, m, s])
                    ev.append({"name": f"{PHASES[p]}{m}" + (f"/c{s // res.pp}" if res.vpp > 1
                                                           else ""),
                               "cat": PHASES[p], "ph": "X", "pid": pid, "tid": s % res.pp,
                               "ts": t0 * 1e3, "dur": (t1 - t0) * 1e3,
                               "args": {"op": oid, "slack_ms": float(res.slack_ms[d, p, m, s]),
                                        "critical": oid in crit}})
    return ev


def write_chrome_trace(path: str, results: Dict[str, PipelineTimeline]) -> None:
    """Write one trace holding every labelled result (e.g. baseline and tuned)."""
    ev: List[dict] = []
    off = 0
    for label, res in results.items():
        ev += trace_events(res, label, off)
        off += res.dp
    data = json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}).encode()
    atomic_write_bytes(path, data)


def write_gantt(path: str, results: Dict[str, PipelineTimeline], replicas: Optional[Sequence[int]] = None,
                title: str = "", unit: str = "ms") -> None:
    """Gantt PNG, one panel per labelled result side by side, shared time axis.

    ``unit`` labels the time axis (e.g. "ms per 1,000 tokens" for timelines scaled to
    equal tokens, so arms that pack different token counts compare by throughput).

    Rows are (replica, rank); forward ops light, backward dark, critical-path ops
    outlined in black; the label shows micro-batch ids.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items: List[Tuple[str, PipelineTimeline]] = list(results.items())
    if not items:
        raise ValueError("results must not be empty")
    tmax = max(r.step_ms for _, r in items)
    fig, axes = plt.subplots(1, len(items), figsize=(7 * len(items), 1.2 + 0.45 * max(
        len(replicas or range(r.dp)) * r.pp for _, r in items)), squeeze=False, sharex=True)
    cmap = matplotlib.colormaps["tab20"]
    for ax, (label, res) in zip(axes[0], items):
        crit = set(res.critical_path)
        reps = list(replicas) if replicas is not None else list(range(res.dp))
        rows = [(d, r) for d in reps for r in range(res.pp)]
        D, _, M, S = res.start_ms.shape
        for y, (d, r) in enumerate(rows):
            for p in range(2):
                for m in range(M):
                    for s in range(r, S, res.pp):
                        t0 = res.start_ms[d, p, m, s]
                        w = res.end_ms[d, p, m, s] - t0
                        c = cmap((2 * (m % 10)) + (0 if p else 1))
                        edge = "black" if op_id(p, d, m, s) in crit else "none"
                        ax.barh(y, w, left=t0, color=c, edgecolor=edge, linewidth=1.2)
                        if w > 0.03 * tmax:
                            ax.text(t0 + w / 2, y, f"{PHASES[p]}{m}", ha="center",
                                    va="center", fontsize=6)
        ax.set_yticks(range(len(rows)), [f"dp{d} pp{r}" for d, r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, tmax * 1.02)
        ax.axvline(res.step_ms, color="red", linewidth=1)
        ax.set_xlabel(unit)
        ax.set_title(f"{label}: step {res.step_ms:.1f} {unit}")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)

