"""What sets the step time of a threshold-routing cell at M = PP, per arm (issue 59).

For each packer's steps of one cell (``cluster_sim``'s packing and instances, unchanged) and
each arm on it, the step time (true densities) split into what could be won back:

* ``dp_imbalance``: slowest replica / mean replica (what equal replicas would win);
* ``fill_drain_ms``: the 1F1B fill and drain of the slowest replica: its step time minus its
  last stage's compute (at M = PP about (PP - 1) / (M + PP - 1) of the step, whatever the packing);
* ``equal_bound``: ``cluster_sim.lower_bound_ms`` (every micro-batch at the step's mean, every
  replica equal). A packer can beat it at M = PP: SAB shapes micro-batches so the fill and
  drain run small ones (``sab.pipeline_profile``);
* ``shaped_bound``: the step's work split over the replicas equally and over the positions in
  ``pipeline_profile``'s optimal shares, as if documents could be cut anywhere: the packing
  bound of these documents at static TAU (DST's cuts can go below it, packing cannot);
* ``long_doc_share``: the costliest single document's share of the mean replica's work at the
  bottleneck stage (a document cannot be split across micro-batches: above the largest
  position's share it sets the replica's time);
* ``cap_binding``: share of the kept pairs a cap-free threshold route would keep above the cap
  (how often the cap, not TAU, decides);
* ``dst_{joint,per_replica}_{planned,oracle}``: SAB's packing with the critical-path plan
  (attention slack 0, per-stage floor) of the joint search or planned per replica
  (``critical_path._per_replica_indices``), made on the estimator's densities (planned: what
  the ``sparsebalance`` arm runs) or on the true ones (oracle: a perfect estimator), timed on
  the truth; with its kept pairs over static's;
* ``lowest_tau``: every op at the lowest TAU level (the lever's reach with no attention floor).

Throughputs are tokens per ms; the ``*_vs_best`` numbers divide by the best static baseline's
(megatron, wlb, dp-balanced) tokens per ms of the same steps.

Command (the issue's cell; ``--seq-lengths 65536`` and ``--pp 8 --micro-batches 8`` likewise)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.harness.compare.threshold_mpp \\
        --seq-lengths 131072 --pp 4 --micro-batches 4 --model llama7b \\
        --density-study results/real_study.json --out results/threshold_mpp/diag_llama7b_pp4_128k.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from typing import Dict, Sequence

import numpy as np

from sparsebalance.batching.strategies.sab import pipeline_profile
from sparsebalance.pairs import threshold_kept_pairs
from sparsebalance.pipeline import simulate
from sparsebalance.tuning import critical_path_indices
from sparsebalance.tuning.from_predictor import build_instance, build_tau_instance
from sparsebalance.tuning.plan import timeline_at

from .cluster_sim import MODELS, WARM_STEPS, SimConfig, _nested, _packed_steps, _study, lower_bound_ms
from .density_study import cell_content

PACKERS = ("megatron", "wlb", "dp-balanced", "sab")
BASELINES = ("megatron", "wlb", "dp-balanced")


def shaped_bound_ms(inst, idx) -> float:
    """Step time of the step's work split equally over replicas and in SAB's optimal position
    shares within each (documents cut anywhere)."""
    f, b, _ = inst.at(idx)
    S, M = inst.stages, inst.microbatches
    fm = f.reshape(-1, S).mean(axis=0)  # mean micro-batch per stage
    bm = b.reshape(-1, S).mean(axis=0)
    prof = pipeline_profile(M, tuple(fm / max(fm.max(), bm.max())), tuple(bm / max(fm.max(), bm.max())))
    fs = (prof[:, None] * fm[None, :])[None]
    bs = (prof[:, None] * bm[None, :])[None]
    return float(simulate(fs, bs, schedule=inst.schedule, p2p_ms=inst.p2p_ms).step_ms)


def _split(res, f, b) -> dict:
    rep = np.asarray(res.replica_step_ms)
    slow = int(np.argmax(rep))
    last = float((f[slow, :, -1] + b[slow, :, -1]).sum())
    return {"step_ms": float(res.step_ms), "dp_imbalance": float(rep.max() / rep.mean()),
            "fill_drain_ms": float(rep[slow] - last), "last_stage_busy_ms": last}


def diagnose_cell(lengths: np.ndarray, seq_length: int, cfg: SimConfig) -> dict:
    """Per packer, per step: the quantities of the module docstring (sums over steps)."""
    predictor = cfg.predictor()
    warm = WARM_STEPS * cfg.dp * cfg.micro_batches * seq_length
    content = cell_content(_study(cfg.density_study), cfg.density_mode, lengths, warm, cfg.seed)
    out: Dict[str, dict] = {}
    thr = dict(topk_min=cfg.topk_min)
    for s in PACKERS:
        acc: Dict[str, float] = {}

        def add(k, v):
            acc[k] = acc.get(k, 0.0) + float(v)

        steps = _packed_steps(lengths, s, seq_length, cfg, predictor, content)
        for packed in steps:
            nested = _nested(packed)
            inst = build_instance(predictor, nested, pp=cfg.pp, k0=cfg.topk,
                                  densities=packed.true_density, **thr)
            k0 = np.full((inst.dp, inst.microbatches, inst.stages), inst.k0_index)
            res = timeline_at(inst, k0)
            f, b, _ = inst.at(k0)
            sp = _split(res, f, b)
            for k, v in sp.items():
                add(k, v if k != "dp_imbalance" else v * sp["step_ms"])
            add("tokens", packed.tokens)
            add("equal_bound_ms", lower_bound_ms(inst))
            add("shaped_bound_ms", shaped_bound_ms(inst, k0))
            # the costliest document vs the mean replica's work on the bottleneck stage
            S = inst.stages
            one = [[[L] for L in np.concatenate([np.asarray(m) for r in nested for m in r])]]
            dens = [[[d] for d in np.concatenate([np.asarray(m) for r in packed.true_density for m in r])]]
            di = build_instance(predictor, one, pp=cfg.pp, k0=cfg.topk, densities=dens, **thr)
            dk = np.full((1, di.microbatches, S), di.k0_index)
            df, db, _ = di.at(dk)
            doc_cost = (df + db)[0]  # [docs, S]
            rep_work = (f + b).sum(axis=1).mean(axis=0)  # [S]
            bott = int(np.argmax(rep_work))
            acc["long_doc_share_max"] = max(acc.get("long_doc_share_max", 0.0),
                                            float(doc_cost[:, bott].max() / rep_work[bott]))
            # the cap: pairs kept under the cap vs with no cap
            L = np.concatenate([np.asarray(m) for r in nested for m in r])
            d = np.concatenate([np.asarray(m) for r in packed.true_density for m in r])
            capped = threshold_kept_pairs(L, d, cfg.topk, cfg.block_size, cfg.topk_min).sum()
            free = threshold_kept_pairs(L, d, 1 << 30, cfg.block_size, cfg.topk_min).sum()
            add("pairs_capped", capped)
            add("pairs_capfree", free)
            # DST's TAU lever: planned on the estimator's densities and on the truth
            taus = sorted(packed.true_at)
            kw = dict(pp=cfg.pp, cap=cfg.topk, tau0=content.docs.tau0, **thr)
            tinst = build_tau_instance(predictor, nested, densities=packed.true_at, **kw)
            tplan = build_tau_instance(predictor, nested, densities=packed.predicted_at, **kw)
            for name, plan_on in (("planned", tplan), ("oracle", tinst)):
                for how, per in (("joint", False), ("per_replica", True)):
                    if s != "sab" and how == "per_replica":  # (the sparsebalance arm's packing)
                        continue
                    idx = critical_path_indices(plan_on, 0.0, per_replica=per)
                    add(f"dst_{how}_{name}_ms", timeline_at(tinst, idx).step_ms)
                    add(f"dst_{how}_{name}_pairs", tinst.at(idx)[2].sum())
            add("static_pairs", tinst.at(np.full_like(k0, tinst.k0_index))[2].sum())
            lo = np.zeros_like(k0)  # every op at the lowest TAU: the lever's reach, no floor
            add("dst_lowest_tau_ms", timeline_at(tinst, lo).step_ms)
            acc["taus"] = taus
        n = acc["step_ms"]
        row = {"tokens": int(acc["tokens"]), "tokens_per_ms": acc["tokens"] / n,
               "dp_imbalance": acc["dp_imbalance"] / n,
               "fill_drain_share": acc["fill_drain_ms"] / n,
               "equal_bound_tokens_per_ms": acc["tokens"] / acc["equal_bound_ms"],
               "shaped_bound_tokens_per_ms": acc["tokens"] / acc["shaped_bound_ms"],
               "long_doc_share_max": acc["long_doc_share_max"],
               "cap_binding": 1.0 - acc["pairs_capped"] / acc["pairs_capfree"],
               **{f"dst_{h}_{n}_tokens_per_ms": acc["tokens"] / acc[f"dst_{h}_{n}_ms"]
                  for h in ("joint", "per_replica") for n in ("planned", "oracle")
                  if f"dst_{h}_{n}_ms" in acc},
               **{f"dst_{h}_{n}_pairs_vs_static": acc[f"dst_{h}_{n}_pairs"] / acc["static_pairs"]
                  for h in ("joint", "per_replica") for n in ("planned", "oracle")
                  if f"dst_{h}_{n}_ms" in acc},
               "lowest_tau_tokens_per_ms": acc["tokens"] / acc["dst_lowest_tau_ms"],
               "taus": acc["taus"]}
        out[s] = row
    best = max(BASELINES, key=lambda k: out[k]["tokens_per_ms"])
    ref = out[best]["tokens_per_ms"]
    for row in out.values():
        for k in list(row):
            if k.endswith("tokens_per_ms"):
                row[k.replace("tokens_per_ms", "vs_best")] = row[k] / ref
    return {"seq_length": seq_length, "best_baseline": best, "packers": out}


def pooled(cells: Sequence[dict]) -> dict:
    """Tokens-weighted pooling of the files' cells (as compare.py pools its cells)."""
    out = {}
    for s in PACKERS:
        tok = sum(c["packers"][s]["tokens"] for c in cells)
        row = {}
        for k in cells[0]["packers"][s]:
            if k.endswith("pairs_vs_static"):
                row[k] = [c["packers"][s][k] for c in cells]
            elif k.endswith("tokens_per_ms"):
                ms = sum(c["packers"][s]["tokens"] / c["packers"][s][k] for c in cells)
                row[k] = tok / ms
        out[s] = row
    best = max(BASELINES, key=lambda k: out[k]["tokens_per_ms"])
    for row in out.values():
        for k in list(row):
            if k.endswith("tokens_per_ms"):
                row[k.replace("tokens_per_ms", "vs_best")] = row[k] / out[best]["tokens_per_ms"]
    return {"best_baseline": best, "packers": out}


CELL_ARMS = ("megatron", "sab", "dst", "sparsebalance", "wlb", "dp-balanced", "dynamic-cp")


def _cells(files, seqs, cfg: SimConfig, a) -> dict:
    from .cells import make_cell, pooled_tokens_per_s
    from .cluster_sim import simulate_cell

    res = {"model": a.model, "pp": a.pp, "micro_batches": a.micro_batches,
           "density_study": a.density_study, "arms": CELL_ARMS, "cells": [], "tables": {}}
    for seq in seqs:
        tabs = []
        for f in files:
            t = simulate_cell(np.asarray(json.load(open(f)), dtype=np.int64), seq, cfg,
                              arms=CELL_ARMS, frontier=False).table
            tabs.append(t)
            res["tables"][f"{os.path.splitext(os.path.basename(f))[0]}:{seq}"] = t
        c = make_cell(a.model, seq, a.pp, a.dp, 1, pooled_tokens_per_s(tabs))
        res["cells"].append(c)
        print(json.dumps({k: c[k] for k in ("model", "context", "pp", "best_baseline", "sb_vs_best")}),
              flush=True)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="*", default=None, help="length files (default data/lengths/*.json)")
    p.add_argument("--model", default="llama7b", choices=sorted(MODELS))
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--seq-lengths", default="131072")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--density-study", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--per-replica", action="store_true",
                   help="with --cells: the sparsebalance / dst arms plan DST per replica too (the experiment "
                        "of cluster_sim.PER_REPLICA_DST, off by default)")
    p.add_argument("--cells", action="store_true",
                   help="instead: compare.py's cells (sb_vs_best pooled over the files) of the arms "
                        "below, without the frontier points (each arm's numbers are compare.py's)")
    a = p.parse_args(argv)
    if not os.path.exists(a.density_study):
        sys.exit(f"threshold_mpp: --density-study {a.density_study} does not exist")
    files = a.lengths or sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                       *[".."] * 3, "data", "lengths", "*.json")))
    if not files:
        sys.exit("threshold_mpp: no length files (pass --lengths)")
    try:
        seqs = [int(x) for x in a.seq_lengths.split(",")]
        cfg = SimConfig(pp=a.pp, dp=a.dp, micro_batches=a.micro_batches, steps=a.steps,
                        model=tuple(MODELS[a.model].items()), routing="threshold",
                        density_study=a.density_study)
    except ValueError as e:
        sys.exit(f"threshold_mpp: {e}")
    t0, load0 = time.time(), os.getloadavg()[0]
    if a.cells:
        from . import cluster_sim

        cluster_sim.PER_REPLICA_DST = a.per_replica
        res = _cells(files, seqs, cfg, a)
        res["per_replica"] = a.per_replica
        res.update(seconds=time.time() - t0, load_avg=[load0, os.getloadavg()[0]])
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        return
    res = {"model": a.model, "pp": a.pp, "dp": a.dp, "micro_batches": a.micro_batches,
           "density_study": a.density_study, "cells": {}}
    for seq in seqs:
        cells = []
        for f in files:
            name = os.path.splitext(os.path.basename(f))[0]
            c = diagnose_cell(np.asarray(json.load(open(f)), dtype=np.int64), seq, cfg)
            c["file"] = name
            cells.append(c)
        res["cells"][str(seq)] = {"files": cells, "pooled": pooled(cells)}
    res["seconds"] = time.time() - t0
    res["load_avg"] = [load0, os.getloadavg()[0]]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps({k: v["pooled"] for k, v in res["cells"].items()}, indent=1))


if __name__ == "__main__":
    main()
