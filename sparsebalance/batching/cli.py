"""Command line: pack a length file and report predicted balance.

Tiny CPU run::

    python -m sparsebalance.batching pack --lengths data/lengths/prolong.json \
        --dp 2 --micro-batches 4 --seq-length 8192 --strategy sab \
        --cost-model h100-analytic --steps 5 --seed 0 --json

GPU-cluster planning (the README table; every strategy on the same documents)::

    python -m sparsebalance.batching pack --lengths data/lengths/wlb_reconstruction.json \
        --dp 4 --micro-batches 8 --seq-length 32768 --pp 4 --cost-model h100-analytic \
        --steps 50 --seed 0 --compare
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import numpy as np

from sparsebalance.batching.report import headroom_share, packing_json, summarize
from sparsebalance.batching.sampler import PackingSampler, check_lengths
from sparsebalance.batching.strategies import STRATEGIES


class UsageError(Exception):
    """Bad command-line input (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        raise UsageError(message)


def read_lengths(path: str) -> np.ndarray:
    """Document lengths from a JSON list or a text file with one integer per line."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"cannot read --lengths {path}: {e.strerror}") from None
    s = text.strip()
    try:
        vals = json.loads(s) if s.startswith("[") else [int(t) for t in s.split()]
    except ValueError:
        raise UsageError(f"--lengths {path}: not a JSON list or one integer per line") from None
    if not isinstance(vals, list) or not vals:
        raise UsageError(f"--lengths {path}: no document lengths")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        raise UsageError(f"--lengths {path}: lengths must be integers")
    try:
        return check_lengths(np.array(vals, dtype=np.int64))
    except ValueError as e:
        raise UsageError(f"--lengths {path}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sparsebalance.batching")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    k = sub.add_parser("pack", help="pack a length file and report predicted balance")
    k.add_argument("--lengths", required=True, help="JSON list or one integer per line")
    k.add_argument("--dp", type=int, default=4)
    k.add_argument("--micro-batches", type=int, default=8)
    k.add_argument("--seq-length", type=int, default=32768)
    k.add_argument("--strategy", default="sab", choices=sorted(STRATEGIES))
    k.add_argument("--cost-model", default="h100-analytic")
    k.add_argument("--block-size", type=int, default=256)
    k.add_argument("--topk", type=int, default=32)
    k.add_argument("--pp", type=int, default=4)
    k.add_argument("--steps", type=int, default=50)
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--max-carry-steps", type=int, default=2)
    k.add_argument("--model-config", default=None,
                   help="JSON object of predictor ModelShape fields (default: its defaults)")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.add_argument("--compare", action="store_true", help="run every strategy")
    return p


def _run(lengths, strategy: str, predictor, *, steps: int, **sampler):
    """``steps`` packing steps of ``strategy``; ``sampler``: PackingSampler keywords."""
    s = PackingSampler(lengths, strategy=strategy, predictor=predictor, **sampler)
    packings = [s.next_step() for _ in range(steps)]
    return packings, summarize(packings, len(s.carried), s.seq_length)


def _table(results: dict) -> str:
    base = results["megatron"]["predicted_ms_per_ktok"]
    rows = ["| strategy | ms/ktok | speedup vs megatron | lower bound ms/ktok | headroom captured "
            "| imbalance_rank | imbalance_microbatch | tokens | carried | pack ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        share = headroom_share(r["predicted_ms_per_ktok"], r["lower_bound_ms_per_ktok"], base)
        label = name if STRATEGIES[name].whole_documents else f"{name} (cuts documents; not ranked)"
        rows.append(f"| {label} | {r['predicted_ms_per_ktok']:.4f} | "
                    f"{base / r['predicted_ms_per_ktok']:.3f}x | "
                    f"{r['lower_bound_ms_per_ktok']:.4f} | "
                    f"{share:.0%} | {r['imbalance_rank']:.3f} | {r['imbalance_microbatch']:.3f} | "
                    f"{r['tokens']} | {r['carried_docs']} | {r['pack_ms']:.2f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        for name in ("dp", "micro_batches", "seq_length", "steps", "block_size", "pp"):
            if getattr(args, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} must be >= 1, got {getattr(args, name)}")
        if args.topk < 0 or args.max_carry_steps < 0:
            raise UsageError("--topk and --max-carry-steps must be >= 0")
        lengths = read_lengths(args.lengths)
        from sparsebalance.predictor import get_predictor

        try:
            shape = json.loads(args.model_config) if args.model_config else {}
            if not isinstance(shape, dict):
                raise ValueError("--model-config must be a JSON object")
            shape.update(block_size=args.block_size, topk=args.topk)
            with warnings.catch_warnings():
                # A stale profile warns and then raises; the raised error is the one line.
                warnings.filterwarnings("ignore", message="latency profile .* does not match")
                predictor = get_predictor(args.cost_model, **shape)
            names = list(STRATEGIES) if args.compare else [args.strategy]
            sampler = dict(dp=args.dp, micro_batches=args.micro_batches, seq_length=args.seq_length,
                           seed=args.seed, max_carry_steps=args.max_carry_steps, topk=args.topk,
                           pp=args.pp)
            runs = {n: _run(lengths, n, predictor, steps=args.steps, **sampler) for n in names}
        except (ValueError, TypeError, OSError) as e:
            raise UsageError(str(e).splitlines()[0]) from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compare:
        results = {n: r[1] for n, r in runs.items()}
        if args.json:
            print(json.dumps({"threads": os.environ.get("OMP_NUM_THREADS"),
                              "summary": results}, indent=1))
        else:
            print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
            print(_table(results))
        return 0
    packings, summary = runs[args.strategy]
    if args.json:
        print(json.dumps({"steps": [packing_json(p) for p in packings], "summary": summary}))
    else:
        print(json.dumps(summary, indent=1))
    return 0
