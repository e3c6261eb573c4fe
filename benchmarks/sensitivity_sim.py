#!/usr/bin/env python
"""Sensitivity-aware DST against slack-only DST in simulation (issue 50 item 4).

Given a sensitivity study (``documents`` with ``source``, ``length``, ``loss_delta`` and
optionally ``compression_ratio``; ``config.sens_topk`` and ``config.block_size``, as
``benchmarks/harness/sparsity_real.py`` writes it), each simulated step draws held-out documents, packs them
in order into ``dp x M`` micro-batches and plans, on SmolLM2-135M's layer (32 of them, so
that PP 4 and 8 divide the model) under the analytic H100 cost model, the arms

* ``static``: every op at k0 (the study's top-k);
* ``slack-only``: the critical-path plan (DST today);
* ``slack-only+raise``: it raised into its leftover float with the refinement's unweighted
  raise (``raise_indices``, as many rounds): what of the refinement's gain is just more pairs;
* ``sensitivity``: it refined by the weights the estimator (fitted on the other half of the
  study) predicts (:func:`sparsebalance.tuning.sensitivity.sensitivity_indices`);
* ``oracle``: the same refinement with the documents' measured sensitivities (a bound).

Proxy (stated, not measured): a document's loss grows linearly in the pairs its budget drops,
calibrated so that at the study's budget it is the measured ``loss_delta``; a plan's predicted
loss is ``sum_m w_m (attn_static - attn_plan) / layers`` over tokens (nats per token against
static top-k; :func:`~sparsebalance.tuning.sensitivity.loss_proxy`), with ``w_m`` from the
*measured* deltas whatever weights the plan used. Each arm reports its planned step time and
kept pairs (the sensitivity arms: equal step time, at least as many pairs); the paired
difference ``sensitivity - slack-only`` gets a 95% t-interval over steps.

Fixture: ``fixture`` writes a study of the right shape whose values are made up to resemble
issue 50's SmolLM2-135M numbers (code +0.155, prose +0.130, pydoc +0.073, CSV +0.037,
repeated passage +0.023, RULER filler -0.001 nats at block top-8, 4K tokens); its top-level
``fixture`` field says so. Rerun on the real study for a claim.

Tiny CPU run (about a minute)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sensitivity_sim.py fixture --out /tmp/study.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sensitivity_sim.py run --study /tmp/study.json \\
        --pp 4 8 --steps 4 --out /tmp/sens.json

On the real study (any machine; planning is CPU work)::

    python benchmarks/sensitivity_sim.py run --study runs/study/sparsity_real.json --pp 4 8 --steps 32 \\
        --out results/sensitivity/real.json
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.compare.heldout import mean_interval  # noqa: E402
from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402
from sparsebalance.balancer import SensitivityWeights  # noqa: E402
from sparsebalance.batching.sparsity_estimator import pack_in_order  # noqa: E402
from sparsebalance.io import atomic_write_text  # noqa: E402
from sparsebalance.pairs import causal_pairs, kept_pairs  # noqa: E402
from sparsebalance.predictor import get_predictor  # noqa: E402
from sparsebalance.tuning.critical_path import critical_path_indices, objective, raise_indices  # noqa: E402
from sparsebalance.tuning.from_predictor import build_instance  # noqa: E402
from sparsebalance.tuning.sensitivity import loss_proxy, microbatch_weights, sensitivity_indices  # noqa: E402

SMOLLM2 = dict(num_layers=32, hidden_size=576, num_attention_heads=9, num_query_groups=3,
               ffn_hidden_size=1536, vocab_size=49152, swiglu=True)
"""SmolLM2-135M's layer; 32 layers (it has 30) so that PP 4 and 8 divide the model."""
FIXTURE_SOURCES = {"code": (0.155, 0.30, 0.35), "prose": (0.130, 0.38, 0.30), "pydoc": (0.073, 0.33, 0.32),
                   "csv": (0.037, 0.25, 0.25), "repeat": (0.023, 0.05, 0.12), "filler": (-0.001, 0.12, 0.20)}
"""Source -> (loss delta at 4K tokens, block top-8: issue 50's values; made-up compression
ratio and threshold density)."""
ARMS = ("static", "slack-only", "slack-only+raise", "sensitivity", "oracle")
RAISE_ROUNDS = 8
"""Total-float rounds of the refinement's raise (``sensitivity_indices``' default)."""


def fixture_study(seed: int = 0, docs_per_source: int = 24, block_size: int = 64, topk: int = 8) -> dict:
    """A study of the right shape with made-up values (module docstring): lengths log-uniform
    in [1K, 16K] tokens; a document's delta is its source's at 4K scaled by the share of
    pairs top-k drops at its length relative to 4K, times log-normal noise (sigma 0.3)."""
    rng = np.random.default_rng(seed)

    def dropped_share(L):
        return 1.0 - kept_pairs(np.array([L]), topk, block_size)[0] / causal_pairs(np.array([L]))[0]

    docs = []
    for _ in range(docs_per_source):
        for src, (delta, ratio, dens) in FIXTURE_SOURCES.items():
            L = int(2 ** rng.uniform(10, 14))
            scale = dropped_share(L) / dropped_share(4096)
            docs.append({"source": src, "length": L, "density": dens,
                         "compression_ratio": round(float(ratio * np.exp(rng.normal(0, 0.1))), 4),
                         "loss_delta": round(float(delta * scale * np.exp(rng.normal(0, 0.3))), 5)})
    return {"fixture": "FIXTURE, not a measurement: values made up to resemble issue 50's "
                       "SmolLM2-135M sensitivities (benchmarks/sensitivity_sim.py fixture)",
            "config": {"sens_topk": topk, "block_size": block_size}, "documents": docs}


def _step(rng, held, M, dp, seq_length):
    """[dp][M] lists of held-out document indices, drawn with replacement and packed in order."""
    out = []
    while len(out) < dp * M:
        draw = rng.integers(0, len(held), size=4 * M)
        L = [min(int(held[i]["length"]), seq_length) for i in draw]
        out += [[int(draw[j]) for j in g] for g in pack_in_order(L, seq_length)][:-1]
    out = out[:dp * M]
    return [out[r * M:(r + 1) * M] for r in range(dp)]


def simulate(study: dict, pp: int, *, microbatches: int, dp: int = 1, steps: int = 8,
             seq_length: int = 16384, seed: int = 0, kmin=None, kmax=None) -> dict:
    """Per-arm means (step ms, kept pairs / static's, predicted loss vs static in nats per
    token) over ``steps`` steps of one pipeline depth, and the paired difference."""
    docs = [d for d in study["documents"] if d.get("loss_delta") is not None]
    half = len(docs) // 2
    if half < 1:
        raise ValueError("the study needs at least 2 documents with loss_delta")
    fit, held = docs[:half], docs[half:]
    cfg = study.get("config", {})
    k0, block = int(cfg.get("sens_topk", 8)), int(cfg.get("block_size", 64))
    weights = SensitivityWeights.from_study({"documents": fit, "config": cfg})
    pred = get_predictor("h100-analytic", **SMOLLM2, block_size=block, topk=k0)
    lo = max(1, k0 // 2) if kmin is None else kmin
    hi = 2 * k0 if kmax is None else kmax
    rng = np.random.default_rng(seed)
    rows = {a: [] for a in ARMS}
    for _ in range(steps):
        ids = _step(rng, held, microbatches, dp, seq_length)
        lengths = [[[min(int(held[i]["length"]), seq_length) for i in mb] for mb in rank] for rank in ids]
        true = [[[float(held[i]["loss_delta"]) for i in mb] for mb in rank] for rank in ids]
        est = [[list(weights.estimator.predict_many([held[i].get("source") for i in mb], L,
                                                    [held[i].get("compression_ratio") for i in mb]))
                for mb, L in zip(rank, lr)] for rank, lr in zip(ids, lengths)]
        w_true = microbatch_weights(lengths, true, k0, block)
        w_est = microbatch_weights(lengths, est, k0, block)
        inst = build_instance(pred, lengths, pp=pp, k0=k0, levels=list(range(lo, hi + 1)))
        base = critical_path_indices(inst)
        idx = {"static": np.full_like(base, inst.k0_index), "slack-only": base,
               "slack-only+raise": raise_indices(inst, base, shift_rounds=RAISE_ROUNDS),
               "sensitivity": sensitivity_indices(inst, base, w_est),
               "oracle": sensitivity_indices(inst, base, np.maximum(w_true, 0.0))}
        tokens = sum(sum(mb) for rank in lengths for mb in rank)
        a_static = objective(inst, idx["static"])[1]
        for arm, x in idx.items():
            t, a = objective(inst, x)
            rows[arm].append((t, a / a_static, loss_proxy(inst, x, w_true, SMOLLM2["num_layers"]) / tokens))
    out = {"microbatches": microbatches, "dp": dp, "steps": steps, "arms": {}}
    for arm, r in rows.items():
        r = np.array(r)
        out["arms"][arm] = {"step_ms": float(r[:, 0].mean()), "kept_pairs_vs_static": float(r[:, 1].mean()),
                            "loss_vs_static_nats_per_token": float(r[:, 2].mean())}
    s = np.array(rows["sensitivity"])
    for ref in ("slack-only", "slack-only+raise"):
        b = np.array(rows[ref])
        out[f"sensitivity_minus_{ref}"] = {
            "loss_nats_per_token": mean_interval(list(s[:, 2] - b[:, 2])),
            "step_ms_max_diff": float(np.max(s[:, 0] - b[:, 0])),
            "kept_pairs_ratio": [float(np.min(s[:, 1] / b[:, 1])), float(np.max(s[:, 1] / b[:, 1]))]}
    return out


def _read_study(path: str) -> dict:
    """The study JSON, or one usage error line naming what is wrong with it."""
    prog = "benchmarks/sensitivity_sim.py"
    try:
        with open(path) as fh:
            study = json.load(fh)
    except OSError as e:
        usage_error(f"--study: cannot read {path} ({e.strerror})", prog=prog)
    except ValueError as e:
        usage_error(f"--study: {path} is not JSON ({e})", prog=prog)
    docs = study.get("documents") if isinstance(study, dict) else None
    if not docs or not all(isinstance(d, dict) and {"source", "length", "loss_delta"} <= d.keys() for d in docs):
        usage_error(f"--study: {path} has no documents with source, length and loss_delta", prog=prog)
    return study


def main(argv=None) -> int:
    p = OneLineParser(prog="benchmarks/sensitivity_sim.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture", help="write the labelled fixture study")
    f.add_argument("--out", required=True)
    f.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="plan the arms over simulated steps, print JSON")
    r.add_argument("--study", required=True)
    r.add_argument("--pp", type=int, nargs="+", default=[4, 8])
    r.add_argument("--microbatches", type=int, default=None, help="per replica (default 2 x pp)")
    r.add_argument("--dp", type=int, default=1)
    r.add_argument("--steps", type=int, default=8)
    r.add_argument("--seq-length", type=int, default=16384, help="micro-batch capacity, tokens")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cmd == "fixture":
        atomic_write_text(a.out, json.dumps(fixture_study(a.seed), indent=1) + "\n")
        return 0
    study = _read_study(a.study)
    if min(a.pp) < 1 or a.steps < 1 or a.dp < 1 or a.seq_length < 1 or (a.microbatches or 1) < 1:
        usage_error("--pp, --steps, --dp, --seq-length and --microbatches must be >= 1", prog=p.prog)
    res = {"study": a.study, "fixture": study.get("fixture"),
           "model": "SmolLM2-135M's layer x 32 layers, h100-analytic",
           "proxy": "loss linear in dropped pairs, calibrated at the study's budget to each document's "
                    "measured loss_delta; nats per token against static top-k (negative: lower loss)",
           "pp": {str(pp): simulate(study, pp, microbatches=a.microbatches or 2 * pp, dp=a.dp, steps=a.steps,
                                    seq_length=a.seq_length, seed=a.seed) for pp in a.pp}}
    text = json.dumps(res, indent=1)
    if a.out:
        atomic_write_text(a.out, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
