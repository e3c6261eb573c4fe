"""``benchmarks/compare.py --regime`` and ``--wlb-validation``: run, check, write, print."""

from __future__ import annotations

import json
import os
from typing import Callable

from sparsebalance.io import atomic_write_text

from . import regime, wlb_validation


def _write(d: str, name: str, obj) -> None:
    atomic_write_text(os.path.join(d, name), obj if isinstance(obj, str) else json.dumps(obj, indent=1))


def run_study(a, cmd: str, log: Callable[[str], None]) -> int:
    """The study ``a`` selects, on ``a.length_arrays`` with the first simulated model's
    SimConfig as base (each cell sets its own model, shape and attention). Returns 0."""
    base = next(iter(a.sim_cfgs.values()))[0]
    head = {"cost_model": a.cost_model, "command": cmd,
            "config": {k: v for k, v in base.__dict__.items()
                       if k in ("steps", "seed", "block_size", "topk", "max_carry_steps",
                                "density_study", "density_mode", "topk_min")},
            "files": sorted(a.length_arrays)}
    if a.wlb_validation:
        quick = dict(published=wlb_validation.PUBLISHED[1:2], pps=(4,)) if a.quick else {}
        res = {**head, **wlb_validation.run(a.length_arrays, base, log, **quick)}
        wlb_validation.check(res)
        if a.report:
            _write(a.report, "validation.json", res)
            _write(a.report, "validation.md", wlb_validation.markdown(res))
        print(json.dumps(res) if a.json else wlb_validation.markdown(res))
        return 0
    cells = regime.run_study(regime.grid_for(a.quick, a.density_study), a.length_arrays, base, log)
    res = {**head, "cells": cells}
    if a.report:
        _write(a.report, "regime.json", res)
        _write(a.report, "regime.md", regime.report(res))
        regime.figure(os.path.join(a.report, "regime_vs_microbatches.png"), cells, a.cost_model)
    if a.json:
        print(json.dumps({**head, "cells": [{k: v for k, v in c.items() if k != "tables"} for c in cells]}))
    else:
        print("\n".join(regime.table_lines(cells)))
    return 0
