#!/usr/bin/env python
"""Simulate a step of megatron's pipeline schedule: static vs a DST plan, trace + Gantt.

Subcommands:

* ``synth``: write a seeded synthetic planning instance (documents packed into
  micro-batches, exact block top-k pair counts, see benchmarks/harness/synthetic_instances.py).
* ``from-lengths``: write an instance from a document-lengths file (a JSON list, in
  dataset order, packed whole into micro-batches of at most ``--seq-length`` tokens
  as Megatron's sequential packing does) and a latency predictor.
* ``run``: plan an instance with a policy, simulate static and planned budgets,
  write a Chrome trace (chrome://tracing, Perfetto) and a side-by-side Gantt PNG,
  print a JSON summary.
* ``bench``: time the planners (median of repeats, CPU time of this process) and
  print JSON.

Tiny CPU run (seconds)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulate.py synth --pp 4 --dp 2 \\
        --microbatches 8 --out /tmp/inst.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulate.py run --instance /tmp/inst.json \\
        --policy critical-path --trace /tmp/step.trace.json --gantt /tmp/step.png
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulate.py bench --pp 8 --dp 8 --microbatches 32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/simulate.py from-lengths \
        --lengths data/lengths/prolong.json --predictor h100-analytic \
        --num-layers 24 --pp 4 --dp 2 --microbatches 8 --out /tmp/prolong.json

GPU cluster (instance written by the driver from the predictor; same commands)::

    python benchmarks/simulate.py run --instance runs/qwen05b/dst/step_000100.json \\
        --policy anchor --anchor mean --p 0.1 --trace runs/qwen05b/step100.trace.json \\
        --gantt runs/qwen05b/step100.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness.synthetic_instances import random_instance  # noqa: E402
from sparsebalance.io import atomic_write_text  # noqa: E402
from sparsebalance.pipeline.trace import write_chrome_trace, write_gantt  # noqa: E402
from sparsebalance.tuning import anchor_indices, critical_path_indices, instance_from_json, instance_to_json  # noqa: E402
from sparsebalance.tuning.plan import make_plan, timeline_at  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _levels(text: str) -> list:
    return [int(x) for x in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="benchmarks/simulate.py")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    for name in ("synth", "bench"):
        s = sub.add_parser(name)
        s.add_argument("--pp", type=int, default=8)
        s.add_argument("--vpp", type=int, default=1)
        s.add_argument("--dp", type=int, default=8)
        s.add_argument("--microbatches", type=int, default=32)
        s.add_argument("--levels", type=_levels, default=[16, 20, 24, 28, 32, 36, 40, 48])
        s.add_argument("--k0", type=int, default=32)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--seq-length", type=int, default=32768)
        s.add_argument("--block-size", type=int, default=256)
    sub.choices["synth"].add_argument("--out", required=True)
    sub.choices["bench"].add_argument("--repeats", type=int, default=7)
    sub.choices["bench"].add_argument("--attn-slack", type=float, default=0.0)
    f = sub.add_parser("from-lengths")
    f.add_argument("--lengths", required=True, help="JSON list of document lengths")
    f.add_argument("--predictor", default="h100-analytic", help="name or profile JSON")
    f.add_argument("--num-layers", type=int, default=24)
    for dest in ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        f.add_argument("--" + dest.replace("_", "-"), type=int, default=None,
                       help="the predictor's model shape (default: its Qwen2.5-0.5B-like shape)")
    f.add_argument("--stage-layers", type=_levels, default=None,
                   help="layers of each stage, comma-separated (default: the even split; see tools/propose_layout.py)")
    f.add_argument("--block-size", type=int, default=256)
    f.add_argument("--seq-length", type=int, default=32768)
    f.add_argument("--pp", type=int, default=4)
    f.add_argument("--dp", type=int, default=2)
    f.add_argument("--microbatches", type=int, default=8)
    f.add_argument("--k0", type=int, default=32)
    f.add_argument("--levels", type=_levels, default=None)
    f.add_argument("--p2p-ms", type=float, default=0.0)
    f.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--instance", required=True)
    r.add_argument("--policy", choices=("critical-path", "anchor"), default="critical-path")
    r.add_argument("--attn-slack", type=float, default=0.0)
    r.add_argument("--floor", choices=("stage", "total"), default="stage",
                   help="critical-path: keep each stage's static attention (default) or the step's total")
    r.add_argument("--anchor", choices=("mean", "max", "min"), default="mean")
    r.add_argument("--p", type=float, default=0.1)
    r.add_argument("--trace", help="Chrome-trace JSON output")
    r.add_argument("--gantt", help="Gantt PNG output")
    return p


_POSITIVE = ("pp", "vpp", "dp", "microbatches", "seq_length", "block_size", "num_layers", "repeats")
"""Size flags that must be >= 1 in every subcommand that has them."""


def _parse(argv) -> argparse.Namespace:
    p = _parser()
    a = p.parse_args(argv)
    for name in _POSITIVE:
        if getattr(a, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def _read_instance(path: str):
    """The planning instance stored in ``path``; ValueError naming the file if unreadable."""
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        return instance_from_json(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a planning instance ({e})") from None


def _synth(a):
    return random_instance(a.seed, pp=a.pp, vpp=a.vpp, dp=a.dp, microbatches=a.microbatches,
                           levels=a.levels, k0=a.k0, seq_length=a.seq_length,
                           block_size=a.block_size,
                           schedule="interleaved" if a.vpp > 1 else "1f1b")


def _pack_in_order(lengths, seq_length: int, count: int) -> list:
    """``count`` micro-batches of whole documents in order (longer ones cut to seq_length)."""
    from sparsebalance.pipeline.split import pack_in_order

    out = pack_in_order(lengths, seq_length, count)
    if len(out) < count:
        raise ValueError(f"lengths file holds fewer than {count} micro-batches of documents")
    return out


def _from_lengths(a) -> dict:
    from sparsebalance.predictor import get_predictor
    from sparsebalance.tuning.from_predictor import build_instance

    with open(a.lengths) as fh:
        lengths = json.load(fh)
    if not isinstance(lengths, list):
        raise ValueError(f"{a.lengths}: expected a JSON list of document lengths")
    mbs = _pack_in_order(lengths, a.seq_length, a.dp * a.microbatches)
    nested = [mbs[d * a.microbatches:(d + 1) * a.microbatches] for d in range(a.dp)]
    with warnings.catch_warnings():
        # A stale profile warns and then raises; the raised error is the one line to show.
        warnings.filterwarnings("ignore", message="latency profile .* does not match")
        stages = None if a.stage_layers is None else tuple(a.stage_layers)
        shape = {k: getattr(a, k) for k in ("hidden_size", "num_attention_heads", "num_query_groups",
                                             "ffn_hidden_size", "vocab_size") if getattr(a, k) is not None}
        pred = get_predictor(a.predictor, num_layers=a.num_layers, block_size=a.block_size, stage_layers=stages,
                             **shape)
    inst = build_instance(pred, nested, pp=a.pp, k0=a.k0, levels=a.levels, p2p_ms=a.p2p_ms)
    return instance_to_json(inst)


def _write_json(path: str, obj) -> None:
    atomic_write_text(path, json.dumps(obj))


def _bench(a) -> dict:
    inst = _synth(a)
    out = {"omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "pp": a.pp, "vpp": a.vpp,
           "dp": a.dp, "microbatches": a.microbatches, "levels": len(inst.levels),
           "repeats": a.repeats, "clock": "process_time"}
    for name, fn in (("critical_path_ms", lambda: critical_path_indices(inst, a.attn_slack)),
                     ("anchor_ms", lambda: anchor_indices(inst, "mean", 0.1))):
        ts = []
        for _ in range(a.repeats):
            t0 = time.process_time()
            idx = fn()
            ts.append(1e3 * (time.process_time() - t0))
        out[name] = statistics.median(ts)
        plan = make_plan(inst, idx, name)
        out[name.replace("_ms", "_speedup")] = plan.baseline_step_ms / plan.step_ms
        out[name.replace("_ms", "_attn_ratio")] = plan.attn / plan.baseline_attn
    return out


def main(argv=None) -> int:
    a = _parse(argv)
    try:
        if a.cmd == "synth":
            _write_json(a.out, instance_to_json(_synth(a)))
            return 0
        if a.cmd == "from-lengths":
            _write_json(a.out, _from_lengths(a))
            return 0
        if a.cmd == "bench":
            print(json.dumps(_bench(a)))
            return 0
        inst = _read_instance(a.instance)
        idx = (critical_path_indices(inst, a.attn_slack, floor=a.floor) if a.policy == "critical-path"
               else anchor_indices(inst, a.anchor, a.p))
        plan = make_plan(inst, idx, a.policy)
        base = timeline_at(inst, np.full_like(idx, inst.k0_index))
        tuned = timeline_at(inst, idx)
        results = {"static": base, a.policy: tuned}
        if a.trace:
            write_chrome_trace(a.trace, results)
        if a.gantt:
            write_gantt(a.gantt, results)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    summary = {"policy": a.policy}
    summary.update((k, v) for k, v in plan.to_json().items() if k not in ("budget", "critical_path"))
    summary["speedup"] = plan.baseline_step_ms / plan.step_ms
    # per stage: the share of micro-batches (over replicas) whose budget is below / above k0;
    # None for a stage without attention (no layers: its budget changes nothing)
    live = inst.attn.max(axis=(0, 1, 2)) > 0
    for key, moved in (("cut_share", plan.budget < inst.k0), ("raised_share", plan.budget > inst.k0)):
        summary[key] = [float(x) if on else None for x, on in zip(moved.mean(axis=(0, 1)), live)]
    summary["bubble_ms_static"] = base.bubble_ms.tolist()
    summary["bubble_ms_plan"] = tuned.bubble_ms.tolist()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
