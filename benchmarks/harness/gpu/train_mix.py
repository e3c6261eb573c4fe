"""What the training corpus's document mix does to the sparse/dense ratio, estimated from a
profiled GPU run: prints one JSON object.

A profiled training pair (a ``gpu_check`` report's train part, dense and sparse arm at one
micro-batch length, the last step under ``--use-pytorch-profiler``) splits each arm's
kernel time into attention and the rest. Per token of a step, dense attention work grows
with the causal pairs of its documents and sparse attention with the kept pairs; the rest
(projections, MLP, logits, routing) does not depend on the mix. For each corpus quantile
(make_corpus.py's ``--quantile``: the source quantile mapped to the micro-batch length)
this resamples the documents as ``gpu_check`` does and scales the measured attention times
by the pairs per token relative to the profiled run's corpus::

    dense(mix)  = rest_dense  + attention_dense  * causal_per_token(mix) / causal_per_token(run)
    sparse(mix) = rest_sparse + attention_sparse * kept_per_token(mix)   / kept_per_token(run)

An estimate from kernel time, not a measurement: the sparse arm's host waits and any
change in kernel efficiency with document length are not in it. Run 5 (H200, 0.5B preset,
64K, ``--quantile 0.999``)::

    .venv/bin/python benchmarks/harness/gpu/train_mix.py --report results/gpu_check/h200_run5.json \\
        --run-quantile 0.999 --quantiles 0.999,0.99,0.95,0.9
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from megatron.training.arguments import usage_error  # noqa: E402
from tools.make_corpus import lengths_path, scaled_lengths  # noqa: E402

PROG = "train_mix.py"


def _train_pair(report: dict, seq_len: int) -> tuple:
    """(dense, sparse) run records of ``seq_len`` with profiled kernel times."""
    train = next((p for p in report.get("parts", []) if p.get("name") == "train"), None)
    runs = {r.get("name"): r for r in ((train or {}).get("data") or {}).get("runs", [])}
    pair = runs.get(f"dense {seq_len}"), runs.get(f"sparse {seq_len}")
    for r in pair:
        if not r or r.get("kernel_ms") is None or r.get("attention_kernel_ms") is None:
            raise ValueError(f"the report has no profiled dense and sparse train run at {seq_len} tokens")
    return pair


def pairs_per_token(lengths: np.ndarray, topk: int, block: int) -> tuple:
    """(causal, kept) (query, key) pairs per token of documents of ``lengths`` (the corpus
    clips them at the micro-batch length, so each is one attention segment)."""
    from sparsebalance.pairs import causal_pairs, kept_pairs

    return causal_pairs(lengths).sum() / lengths.sum(), kept_pairs(lengths, topk, block).sum() / lengths.sum()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--report", required=True, help="gpu_check report JSON with a profiled train part")
    p.add_argument("--lengths", default="prolong",
                   help="document lengths the corpus was resampled from (make_corpus.py's --lengths: "
                        "a shared/ name or a .json path)")
    p.add_argument("--run-quantile", type=float, required=True, help="the profiled run's corpus quantile")
    p.add_argument("--quantiles", default="0.999,0.99,0.95,0.9", help="corpus quantiles to estimate")
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--num-docs", type=int, default=600, help="documents per corpus (gpu_check's)")
    a = p.parse_args(argv)
    try:
        qs = [float(x) for x in a.quantiles.split(",") if x]
    except ValueError:
        usage_error(f"--quantiles must be comma-separated numbers, got {a.quantiles!r}", prog=PROG)
    if not qs or not all(0 < q <= 1 for q in [*qs, a.run_quantile]) or min(a.seq_len, a.topk, a.block_size,
                                                                         a.num_docs) < 1:
        usage_error("quantiles must lie in (0, 1]; --seq-len, --topk, --block-size, --num-docs >= 1", prog=PROG)
    try:
        with open(a.report) as fh:
            dense, sparse = _train_pair(json.load(fh), a.seq_len)
        with open(lengths_path(a.lengths)) as fh:
            source = np.asarray(json.load(fh), dtype=np.float64)
    except (OSError, ValueError) as e:
        usage_error(str(e), prog=PROG)

    def mix(q):
        L = scaled_lengths(source, a.num_docs, a.seq_len, q, np.random.default_rng(0))
        return L, pairs_per_token(L, a.topk, a.block_size)

    _, (c0, k0) = mix(a.run_quantile)
    att_d, att_s = dense["attention_kernel_ms"], sparse["attention_kernel_ms"]
    rest_d, rest_s = dense["kernel_ms"] - att_d, sparse["kernel_ms"] - att_s
    rows = []
    for q in qs:
        L, (c, k) = mix(q)
        d_ms, s_ms = rest_d + att_d * c / c0, rest_s + att_s * k / k0
        rows.append({"quantile": q, "median_length": int(np.median(L)), "density": round(float(k / c), 4),
                     "dense_kernel_ms": round(float(d_ms), 1), "sparse_kernel_ms": round(float(s_ms), 1),
                     "speedup_estimate": round(float(d_ms / s_ms), 3),
                     "speedup_if_sparse_attention_were_free": round(float(d_ms / rest_s), 3)})
    print(json.dumps({"report": a.report, "run_quantile": a.run_quantile, "seq_len": a.seq_len, "topk": a.topk,
                      "block_size": a.block_size, "profiled": {"dense_attention_ms": att_d, "dense_rest_ms": rest_d,
                                                              "sparse_attention_ms": att_s, "sparse_rest_ms": rest_s},
                      "estimates": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
