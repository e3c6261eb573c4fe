"""How well a latency profile's fit predicts layer times it was not fitted on, from the
profile's own samples: prints one JSON object.

``profile_latency.py --validate`` times held-out random micro-batches after the grid; on
the H200 (Runs 5-7) that check was cut each time and only the grid's samples came back.
This reads those samples and, for each document mix of the grid (its ``lengths``), fits the
coefficients on every other sample (``fit_coefficients``, as the profile does) and predicts
that mix's layer forward + backward at each of its budgets: leave one mix out. The error is
over mixes the fit never saw, not over new random micro-batches, so it is an estimate of
the held-out MAPE, not that check::

    .venv/bin/python benchmarks/harness/gpu/profile_cv.py \\
        --profile results/gpu_check/h200_run7_latency_samples_unvalidated.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron.training.arguments import usage_error  # noqa: E402

PROG = "profile_cv.py"


def leave_one_mix_out(profile: dict) -> dict:
    """Per held-out (mix, budget) of ``profile`` (a parsed latency profile): measured and
    predicted layer fwd+bwd ms, the prediction by the :class:`FittedPredictor` a run would
    load from the profile's other samples; their MAPE."""
    from sparsebalance.config import ModelShape
    from sparsebalance.predictor.fitted import FittedPredictor, fit_coefficients
    from sparsebalance.predictor.fitting import mape

    samples, model = profile["samples"], profile["model"]
    shape = ModelShape(**{k: model[k] for k in ModelShape.__dataclass_fields__ if k in model})
    layer = [s for s in samples if s["kind"] == "layer"]
    mixes = sorted({tuple(s["lengths"]) for s in layer})
    if len(mixes) < 2:
        raise ValueError(f"leave one mix out needs layer samples of 2 or more mixes, got {len(mixes)}")
    rows = []
    for mix in mixes:
        rest = [s for s in samples if s["kind"] != "layer" or tuple(s["lengths"]) != mix]
        pred = FittedPredictor(shape, fit_coefficients(rest, shape.block_size),
                               dense_only=model.get("attention") == "dense")
        held = [s for s in layer if tuple(s["lengths"]) == mix]
        for topk in sorted({s["topk"] for s in held}, key=lambda t: -1 if t is None else t):
            ms = {s["phase"]: s["ms"] for s in held if s["topk"] == topk}
            if set(ms) != {"fwd", "bwd"}:
                continue
            rows.append({"docs": len(mix), "tokens": int(sum(mix)), "max_len": int(max(mix)), "topk": topk,
                         "measured_ms": round(ms["fwd"] + ms["bwd"], 4),
                         "predicted_ms": round(sum(pred.layer_ms(list(mix), topk, ph) for ph in ("fwd", "bwd")), 4)})
    meas = [r["measured_ms"] for r in rows]
    pred_ms = [r["predicted_ms"] for r in rows]
    return {"mixes": len(mixes), "items": len(rows), "mape": mape(pred_ms, meas),
            "max_ape": float(max(abs(p / m - 1) for p, m in zip(pred_ms, meas))), "heldout": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--profile", required=True, help="a latency profile (or unvalidated samples) JSON")
    a = p.parse_args(argv)
    from sparsebalance.predictor.profile import read_profile

    try:
        prof, _ = read_profile(a.profile)
    except OSError as e:
        usage_error(f"--profile {a.profile}: {e.strerror}", prog=PROG)
    except UnicodeDecodeError:
        usage_error(f"--profile {a.profile}: not JSON text", prog=PROG)
    except ValueError as e:  # read_profile's "profile PATH: why"
        usage_error(f"--{e}", prog=PROG)
    try:
        out = leave_one_mix_out(prof)
    except (KeyError, TypeError, ValueError) as e:
        usage_error(f"--profile {a.profile}: {e}", prog=PROG)
    out = {"profile": a.profile, "hardware": prof.get("hardware", {}).get("gpu"), **out}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
