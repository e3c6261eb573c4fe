#!/usr/bin/env python
"""Render recorded step timelines (per-op durations) as Chrome trace + Gantt PNG.

A timeline file holds the per-op durations of one step, measured or predicted::

    {"schedule": "1f1b" | "interleaved", "vpp": V, "p2p_ms": float,
     "fwd_ms": [[[ms per stage] per micro-batch] per dp replica], "bwd_ms": same}

(stage = virtual stage ``v * P + rank``). Each file is replayed through the
pipeline model (megatron's op order), so a measured and a predicted timeline of
the same step can be compared side by side; the JSON summary gives both step
times and the per-rank bubbles.

Tiny CPU run::

    OMP_NUM_THREADS=1 .venv/bin/python tools/timeline.py --timeline measured=/tmp/m.json \\
        --timeline predicted=/tmp/p.json --trace /tmp/tl.trace.json --gantt /tmp/tl.png

GPU cluster (files written by the driver's ``--sb-timeline DIR``)::

    python tools/timeline.py --timeline measured=runs/q05b/tl/step_100.measured.json \\
        --timeline predicted=runs/q05b/tl/step_100.predicted.json --gantt runs/q05b/tl/100.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparsebalance.pipeline import simulate  # noqa: E402
from sparsebalance.pipeline.trace import write_chrome_trace, write_gantt  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def load_timeline(path: str):
    """Replay one timeline file through the pipeline model."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        d = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a timeline JSON file ({e})") from None
    if not isinstance(d, dict) or "fwd_ms" not in d or "bwd_ms" not in d:
        raise ValueError(f"{path}: a timeline needs 'fwd_ms' and 'bwd_ms'")
    try:
        return simulate(d["fwd_ms"], d["bwd_ms"], schedule=d.get("schedule", "1f1b"),
                        vpp=int(d.get("vpp", 1)), p2p_ms=float(d.get("p2p_ms", 0.0)))
    except (TypeError, ValueError) as e:  # malformed durations: name the file
        raise ValueError(f"{path}: {e}") from None


def main(argv=None) -> int:
    p = _Parser(prog="tools/timeline.py", description=__doc__.split("\n")[0])
    p.add_argument("--timeline", action="append", required=True, metavar="LABEL=FILE")
    p.add_argument("--trace", help="Chrome-trace JSON output")
    p.add_argument("--gantt", help="Gantt PNG output")
    a = p.parse_args(argv)
    try:
        results = {}
        for item in a.timeline:
            label, sep, path = item.partition("=")
            if not sep:
                label, path = os.path.basename(item), item
            results[label] = load_timeline(path)
        if a.trace:
            write_chrome_trace(a.trace, results)
        if a.gantt:
            write_gantt(a.gantt, results)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    print(json.dumps({k: {"step_ms": r.step_ms, "bubble_ms": r.bubble_ms.tolist()}
                      for k, r in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
