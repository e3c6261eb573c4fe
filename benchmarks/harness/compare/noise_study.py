"""DST under op-time noise, in the simulator: does its gain survive scatter, and does
choosing the plan by its *expected* noisy step recover it?

The real CPU runs (docs/dst_real_runs.md) measured single op times scattering around
their predictions with a std of 0.10-0.14, and found DST adding nothing to SAB there.
The cluster simulation replays noiseless op times. Here every op of a planned step is
multiplied by an independent mean-1 log-normal factor of std ``sigma`` (i.i.d. per op:
real scatter is partly correlated across ops, which this leaves out) and the step
replayed through the 1F1B model; the expected step is the mean over ``draws``.

Compared on the same SAB packing (same tokens, so step-time ratios are throughput
ratios): static top-k (``sab``), the critical-path plan (``sparsebalance``), and a
noise-aware choice per step between the two by their expected noisy step, estimated on
draws independent of the ones it is scored on (no selection bias).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.harness.compare.noise_study \\
        --cpu-profile runs/compare/profile_sparse.json --out results/scaling/dst_noise.json

``--cpu-profile``: the real runs' measured CPU layer profile (``benchmarks/compare.py --mode
real`` writes it under its workdir; block 64, top-30, one thread) as the cost model of
the CPU-shaped cell; without it that cell uses h100-analytic, where attention at 8K is
too small a share for DST to matter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from typing import Dict, Sequence

import numpy as np

from sparsebalance.pipeline import simulate
from sparsebalance.tuning import critical_path_indices
from sparsebalance.tuning.from_predictor import build_instance
from sparsebalance.tuning.instance import Instance

from .cluster_sim import MODELS, SimConfig, _nested, _packed_steps


def expected_step_ms(inst: Instance, idx: np.ndarray, sigma: float, draws: int,
                     rng: np.random.Generator) -> float:
    """Mean step (ms) of plan ``idx`` with every op time times a mean-1 log-normal
    factor of std ``sigma`` (``draws`` samples; the noiseless step when sigma is 0)."""
    f, b, _ = inst.at(idx)
    if sigma == 0:
        return float(simulate(f, b, schedule=inst.schedule, p2p_ms=inst.p2p_ms).step_ms)
    s2 = np.log1p(sigma * sigma)  # log-normal with mean 1 and std sigma
    out = []
    for _ in range(draws):
        nf = rng.lognormal(-s2 / 2, np.sqrt(s2), f.shape)
        nb = rng.lognormal(-s2 / 2, np.sqrt(s2), b.shape)
        out.append(simulate(f * nf, b * nb, schedule=inst.schedule, p2p_ms=inst.p2p_ms).step_ms)
    return float(np.mean(out))


def study(lengths: np.ndarray, seq_length: int, cfg: SimConfig, sigmas: Sequence[float],
          draws: int) -> Dict[str, dict]:
    """Per sigma: expected-step throughput of the critical-path plan and of the
    noise-aware choice, each over static top-k on the same packing."""
    predictor = cfg.predictor()
    insts = [build_instance(predictor, _nested(p), pp=cfg.pp, k0=cfg.topk)
             for p in _packed_steps(lengths, "sab", seq_length, cfg, predictor)]
    plans = [(np.full((i.dp, i.microbatches, i.stages), i.k0_index), critical_path_indices(i, 0.0))
             for i in insts]
    out = {}
    for sigma in sigmas:
        pick_rng, eval_rng = np.random.default_rng(cfg.seed), np.random.default_rng(cfg.seed + 1)
        t_static = t_dst = t_aware = 0.0
        chose_dst = 0
        for inst, (k0, cp) in zip(insts, plans):
            # Choose on one set of draws, score on another.
            use_dst = (expected_step_ms(inst, cp, sigma, draws, pick_rng)
                       < expected_step_ms(inst, k0, sigma, draws, pick_rng))
            s, d = (expected_step_ms(inst, x, sigma, draws, eval_rng) for x in (k0, cp))
            t_static, t_dst = t_static + s, t_dst + d
            t_aware += d if use_dst else s
            chose_dst += int(use_dst)
        out[f"{sigma:g}"] = {"dst_vs_static": t_static / t_dst, "aware_vs_static": t_static / t_aware,
                             "aware_chose_dst": chose_dst / len(insts)}
    return out


CELLS = {
    # Lengths clipped at 8K as in the real runs' corpus recipe.
    "cpu-like: qwen05b 8K PP2 DP1 M8": ("qwen05b", 8192, dict(pp=2, dp=1, micro_batches=8)),
    "cluster: qwen3b 128K PP4 DP8 M32": ("qwen3b", 131072, dict(pp=4, dp=8, micro_batches=32)),
}
"""The two settings studied: one shaped like the real CPU runs, one cluster cell."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.compare.noise_study",
                                description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="data/lengths/wlb_reconstruction.json")
    p.add_argument("--sigmas", default="0,0.05,0.1,0.14")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--draws", type=int, default=20)
    p.add_argument("--cpu-profile", default=None,
                   help="latency profile of the real CPU runs for the CPU-shaped cell")
    p.add_argument("--out", default=None, help="write the JSON here (atomically)")
    a = p.parse_args(argv)
    try:
        lengths = np.asarray(json.load(open(a.lengths)), dtype=np.int64)
        sigmas = [float(x) for x in a.sigmas.split(",") if x]
        if a.steps < 1 or a.draws < 1 or not sigmas or min(sigmas) < 0:
            raise ValueError("--steps and --draws must be >= 1, --sigmas >= 0")
        if a.cpu_profile and not os.path.isfile(a.cpu_profile):
            raise ValueError(f"--cpu-profile {a.cpu_profile} does not exist")
    except (OSError, ValueError) as e:
        print(f"noise_study: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    base = SimConfig(steps=a.steps, cost_model="h100-analytic")
    res = {"sigmas_are": "std of a mean-1 log-normal factor per op (i.i.d.)",
           "cost_model": {}, "command": " ".join(["python -m benchmarks.harness.compare.noise_study"]
                                                  + list(argv if argv is not None else sys.argv[1:])),
           "cells": {}}
    for name, (model, seq, shape) in CELLS.items():
        cfg = replace(base, model=tuple(MODELS[model].items()), **shape)
        if a.cpu_profile and name.startswith("cpu-like"):
            # The profiled model itself, at the real runs' routing and thread count.
            cfg = replace(cfg, cost_model=a.cpu_profile, model=(), block_size=64, topk=30,
                          threads=1)
        res["cost_model"][name] = cfg.cost_model
        L = np.minimum(lengths, seq) if seq <= 8192 else lengths
        res["cells"][name] = study(L, seq, cfg, sigmas, a.draws)
        print(name, json.dumps(res["cells"][name]), flush=True)
    if a.out:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(a.out, json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
