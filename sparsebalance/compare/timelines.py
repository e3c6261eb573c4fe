"""Per-op timelines the driver writes with ``--sb-timeline``: where prediction error comes from.

For every logged step the driver stores the predicted and the measured per-op
forward/backward times. Replaying the measured op times through the pipeline model
gives the step the schedule alone explains; the rest of the measured step is
outside the modelled ops (optimizer, point-to-point waits, data, planning). So

    measured step - replayed measured ops  = overhead the model does not see
    replayed measured ops - predicted      = error of the op-time predictions
"""

from __future__ import annotations

import glob
import json
import os
from typing import Optional

import numpy as np

from ..pipeline import simulate


def timeline_stats(directory: str, skip: int) -> Optional[dict]:
    """Medians over the logged steps after the first ``skip``; None without files."""
    files = sorted(glob.glob(os.path.join(directory, "step_*.measured.json")))[skip:]
    rows = []
    for f in files:
        pf = f.replace(".measured.json", ".predicted.json")
        if not os.path.isfile(pf):
            continue
        with open(f) as fh:
            m = json.load(fh)
        with open(pf) as fh:
            p = json.load(fh)
        mf, mb = np.asarray(m["fwd_ms"]), np.asarray(m["bwd_ms"])
        qf, qb = np.asarray(p["fwd_ms"]), np.asarray(p["bwd_ms"])
        kw = dict(schedule=m.get("schedule", "1f1b"), vpp=int(m.get("vpp", 1)))
        rows.append((simulate(mf, mb, **kw).step_ms, simulate(qf, qb, **kw).step_ms,
                     float((mf + mb).sum()), float((qf + qb).sum())))
    if not rows:
        return None
    r = np.median(np.array(rows), axis=0)
    return {"replayed_ms": float(r[0]), "predicted_ops_ms": float(r[1]),
            "op_sum_measured_ms": float(r[2]), "op_sum_predicted_ms": float(r[3]),
            "steps": len(rows)}
