"""What sparsity-awareness buys under threshold routing: the same scaling cells with measured
densities and with every density replaced by its length bucket's mean, side by side.

Reads the ``scaling.json`` of two ``benchmarks/compare.py --scaling --routing threshold`` runs
(``--density-mode measured`` and ``bucket-mean``, same cells) and writes ``summary.json``
and ``summary.md`` into ``--out``::

    .venv/bin/python -m benchmarks.harness.compare.threshold_summary \\
        --measured results/scaling_threshold/measured/scaling.json \\
        --bucket-mean results/scaling_threshold/bucket_mean/scaling.json --out results/scaling_threshold
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def _key(c: dict) -> tuple:
    return c["model"], c["context"], c["pp"], c["dp"], c["cp"]


def _sab_over(c: dict, arm: str) -> float:
    return c["arms"]["sab"] / c["arms"][arm]


def summarise(measured: dict, bucket: dict) -> dict:
    """Per cell (present in both runs): sb_vs_best, best baseline and SAB over WLB-LLM in each
    mode, and the estimator's figures of the measured run."""
    other = {_key(c): c for c in bucket["cells"]}
    rows = []
    for c, tables in zip(measured["cells"], measured.get("tables", [{}] * len(measured["cells"]))):
        b = other.get(_key(c))
        if b is None:
            continue
        th = [t["threshold"] for t in tables.values() if "estimator_microbatch_mape" in t.get("threshold", {})]
        mean = (lambda k: float(np.mean([t[k] for t in th])) if th else None)  # noqa: E731
        rows.append({"model": c["model"], "context": c["context"], "pp": c["pp"], "dp": c["dp"], "cp": c["cp"],
                     "measured": {"sb_vs_best": c["sb_vs_best"], "best_baseline": c["best_baseline"],
                                  "sab_vs_wlb": _sab_over(c, "wlb"), "sab_vs_megatron": _sab_over(c, "megatron")},
                     "bucket_mean": {"sb_vs_best": b["sb_vs_best"], "best_baseline": b["best_baseline"],
                                     "sab_vs_wlb": _sab_over(b, "wlb"), "sab_vs_megatron": _sab_over(b, "megatron")},
                     "estimator_mape": mean("estimator_microbatch_mape"),
                     "length_bucket_oracle_mape": mean("length_bucket_oracle_microbatch_mape"),
                     "estimator_share_of_step": mean("estimator_share_of_step")})
    med = lambda mode: float(np.median([r[mode]["sb_vs_best"] for r in rows])) if rows else None  # noqa: E731
    return {"density_study": measured["config"].get("density_study"), "cost_model": measured["cost_model"],
            "commands": {"measured": measured.get("command"), "bucket_mean": bucket.get("command")},
            "median_sb_vs_best": {"measured": med("measured"), "bucket_mean": med("bucket_mean")},
            "cells": rows}


def markdown(s: dict) -> str:
    lines = ["# Threshold routing: measured densities vs length-bucket means (simulated)", "",
             f"Density study: `{s['density_study']}`. Cost model: `{s['cost_model']}`.", "",
             f"- measured: `{s['commands']['measured']}`", f"- bucket-mean: `{s['commands']['bucket_mean']}`", "",
             f"Median sb_vs_best: measured {s['median_sb_vs_best']['measured']:.3f}x, bucket-mean "
             f"{s['median_sb_vs_best']['bucket_mean']:.3f}x (target >= 1.10x with measured densities).", "",
             "| model | context | PP | DP | CP | sb_vs_best measured | bucket-mean | SAB/WLB measured | "
             "bucket-mean | SAB/megatron measured | bucket-mean | estimator MAPE | length-bucket oracle MAPE "
             "| estimator share of step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["cells"]:
        m, b = r["measured"], r["bucket_mean"]
        fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
        lines.append(f"| {r['model']} | {r['context'] // 1024}K | {r['pp']} | {r['dp']} | {r['cp']} | "
                     f"{m['sb_vs_best']:.3f} | {b['sb_vs_best']:.3f} | {m['sab_vs_wlb']:.3f} | {b['sab_vs_wlb']:.3f} | "
                     f"{m['sab_vs_megatron']:.3f} | {b['sab_vs_megatron']:.3f} | "
                     f"{fmt(r['estimator_mape'], '.4f')} | {fmt(r['length_bucket_oracle_mape'], '.4f')} | "
                     f"{fmt(r['estimator_share_of_step'], '.2%')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--measured", required=True)
    p.add_argument("--bucket-mean", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with open(a.measured) as fh, open(a.bucket_mean) as gh:
        s = summarise(json.load(fh), json.load(gh))
    if not s["cells"]:
        print("threshold_summary: the two runs share no cell", file=sys.stderr)
        return 1
    os.makedirs(a.out, exist_ok=True)
    from sparsebalance.io import atomic_write_text

    atomic_write_text(os.path.join(a.out, "summary.json"), json.dumps(s, indent=1) + "\n")
    atomic_write_text(os.path.join(a.out, "summary.md"), markdown(s))
    print(markdown(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
