"""How well a latency profile's fit predicts layer times it was not fitted on, from the
profile's own samples: prints one JSON object.

``profile_latency.py --validate`` times held-out random micro-batches after the grid; on
the H200 (Runs 5-7) that check was cut each time and only the grid's samples came back.
This reads those samples and, for each document mix of the grid (its ``lengths``), fits the
coefficients on every other sample (``fit_coefficients``, as the profile does) and predicts
that mix's layer forward + backward at each of its budgets: leave one mix out. The error is
over mixes the fit never saw, not over new random micro-batches, so it is an estimate of
the held-out MAPE, not that check::

    .venv/bin/python tools/harness/gpu/profile_cv.py \\
        --profile results/gpu_check/h200_run7_latency_samples_unvalidated.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron.training.arguments import usage_error  # noqa: E402

PROG = "profile_cv.py"


def leave_one_mix_out(samples: list, block_size: int) -> dict:
    """Per held-out (mix, budget): measured and predicted layer fwd+bwd ms; their MAPE."""
    from sparsebalance.predictor.fitted import LAYER_FEATURES, fit_coefficients, layer_features
    from sparsebalance.predictor.fitting import mape

    layer = [s for s in samples if s["kind"] == "layer"]
    mixes = sorted({tuple(s["lengths"]) for s in layer})
    if len(mixes) < 2:
        raise ValueError(f"leave one mix out needs layer samples of 2 or more mixes, got {len(mixes)}")
    rows = []
    for mix in mixes:
        coef = fit_coefficients([s for s in samples if s["kind"] != "layer" or tuple(s["lengths"]) != mix],
                                block_size)["layer"]
        held = [s for s in layer if tuple(s["lengths"]) == mix]
        for topk in sorted({s["topk"] for s in held}, key=lambda t: -1 if t is None else t):
            ms = {s["phase"]: s["ms"] for s in held if s["topk"] == topk}
            if set(ms) != {"fwd", "bwd"}:
                continue
            x = layer_features(list(mix), topk, block_size)
            pred = sum(float(np.dot(x, [coef[ph][n] for n in LAYER_FEATURES])) for ph in ("fwd", "bwd"))
            rows.append({"docs": len(mix), "tokens": int(sum(mix)), "max_len": int(max(mix)), "topk": topk,
                         "measured_ms": round(ms["fwd"] + ms["bwd"], 4), "predicted_ms": round(pred, 4)})
    meas = [r["measured_ms"] for r in rows]
    pred = [r["predicted_ms"] for r in rows]
    return {"mixes": len(mixes), "items": len(rows), "mape": mape(pred, meas),
            "max_ape": float(max(abs(p / m - 1) for p, m in zip(pred, meas))), "heldout": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="a latency profile (or unvalidated samples) JSON")
    a = p.parse_args(argv)
    try:
        with open(a.profile) as fh:
            prof = json.load(fh)
    except OSError as e:
        usage_error(f"--profile {a.profile}: {e.strerror}", prog=PROG)
    except ValueError:
        usage_error(f"--profile {a.profile}: not JSON", prog=PROG)
    if not isinstance(prof, dict) or prof.get("format") != "sparsebalance-latency-profile":
        usage_error(f"--profile {a.profile}: not a latency profile (profile_latency.py's format)", prog=PROG)
    try:
        out = leave_one_mix_out(prof.get("samples") or [], int(prof["model"]["block_size"]))
    except (KeyError, TypeError, ValueError) as e:
        usage_error(f"--profile {a.profile}: {e}", prog=PROG)
    out = {"profile": a.profile, "hardware": prof.get("hardware", {}).get("gpu"), **out}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
