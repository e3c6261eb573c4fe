"""Step 4 of the long-context recipe: merge the runs into results/longctx_accuracy.json.

Reads ``RUNS_DIR/<arm>/seed<k>/{train_meta.json, eval_dense.json}`` (written by
train_arm.sh and eval_arm.sh) and writes, per arm: ``needle_4k`` (single-needle
accuracy at 4K), ``mean`` (mean over tasks of the 4K-8K cells), ``per_task``,
``seeds``, ``wall_clock_s`` (each averaged over seeds), plus ``per_seed``
numbers, binomial standard errors and the issue's comparisons with a
"within noise" verdict. Refuses to write anything if a run is missing.

    .venv/bin/python examples/longctx/collect.py --runs-dir runs/longctx \\
        --arms dense megatron sparsebalance --seeds 1 2 --output results/longctx_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from sparsebalance.io import atomic_write_text  # noqa: E402

PROG = "collect.py"
NEEDLE = "niah_single"


def fail(message: str, code: int = 2) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        fail(f"{path} is missing (run train_arm.sh / eval_arm.sh for it first)")
    except json.JSONDecodeError as e:
        fail(f"{path} is not valid JSON: {e}")


def seed_summary(ev: dict, meta: dict, path: str, needle_length: int,
                 mean_lengths: tuple[int, ...]) -> dict:
    """Numbers of one (arm, seed) run from its eval report and training metadata."""
    acc = ev.get("accuracy")
    if not isinstance(acc, dict) or ev.get("attention") != "dense":
        fail(f"{path}: expected a dense-attention report of benchmarks/eval_longctx.py")
    cells = {(t, int(n)): c for t, row in acc.items() for n, c in row.items()}
    if (NEEDLE, needle_length) not in cells:
        fail(f"{path}: no {NEEDLE} samples at {needle_length} tokens")
    per_task, var = {}, 0.0
    for t in acc:
        sel = [cells[(t, n)] for n in mean_lengths if (t, n) in cells]
        if len(sel) != len(mean_lengths):
            fail(f"{path}: task {t} lacks one of the lengths {mean_lengths}")
        per_task[t] = {str(n): cells[(t, n)]["accuracy"] for n in mean_lengths}
        per_task[t]["mean"] = sum(c["accuracy"] for c in sel) / len(sel)
        var += sum(c["accuracy"] * (1 - c["accuracy"]) / c["n"] for c in sel)
    k = len(per_task) * len(mean_lengths)
    # Answer tokens right given the gold prefix (greedy reports), over the same cells.
    tok = [cells[(t, n)].get("token_accuracy") for t in acc for n in mean_lengths]
    return {
        "seed": meta["seed"],
        "needle_4k": cells[(NEEDLE, needle_length)]["accuracy"],
        "mean": sum(v["mean"] for v in per_task.values()) / len(per_task),
        "mean_stderr": math.sqrt(var) / k,  # binomial, over the cells' samples
        "token_accuracy": None if None in tok else sum(tok) / len(tok),
        "per_task": per_task,
        "wall_clock_s": meta["wall_clock_s"],
        "train_iterations": meta.get("iterations"),
        "train_tokens": meta.get("tokens"),
        "samples_per_cell": min(c["n"] for c in cells.values()),
        "accuracy_by_length": {t: {n: c["accuracy"] for n, c in row.items()} for t, row in acc.items()},
    }


def base_summary(d: str) -> dict | None:
    """The shared base model (run directory ``d``: the curriculum's last stage), if the
    recipe had one: its training metadata and, when scored (``eval_arm.sh base``), its
    accuracy per task and length."""
    if not os.path.isfile(os.path.join(d, "train_meta.json")):
        return None
    meta = _load(os.path.join(d, "train_meta.json"))
    out = {k: meta.get(k) for k in ("wall_clock_s", "budget_s", "iterations", "tokens", "tokens_per_s",
                                    "first_loss", "last_loss")}
    ev_path = os.path.join(d, "eval_dense.json")
    if os.path.isfile(ev_path):
        acc = _load(ev_path).get("accuracy", {})
        out["accuracy_by_length"] = {t: {n: c["accuracy"] for n, c in row.items()} for t, row in acc.items()}
        out["token_accuracy_by_length"] = {t: {n: c.get("token_accuracy") for n, c in row.items()}
                                           for t, row in acc.items()}
    return out


def arm_summary(runs: list[dict]) -> dict:
    """Seed-averaged numbers of one arm."""
    avg = lambda xs: sum(xs) / len(xs)
    tasks = runs[0]["per_task"]
    return {
        "needle_4k": avg([r["needle_4k"] for r in runs]),
        "mean": avg([r["mean"] for r in runs]),
        "token_accuracy": (None if any(r["token_accuracy"] is None for r in runs)
                           else avg([r["token_accuracy"] for r in runs])),
        "per_task": {t: {k: avg([r["per_task"][t][k] for r in runs]) for k in tasks[t]} for t in tasks},
        "seeds": [r["seed"] for r in runs],
        "wall_clock_s": avg([r["wall_clock_s"] for r in runs]),
        "mean_stderr": math.sqrt(sum(r["mean_stderr"] ** 2 for r in runs)) / len(runs),
        "seed_spread": max(r["mean"] for r in runs) - min(r["mean"] for r in runs),
        "per_seed": runs,
    }


def compare(a: dict, b: dict) -> dict:
    """``a.mean - b.mean`` and whether it is within noise (2 combined stderr, or the seed spread)."""
    diff = a["mean"] - b["mean"]
    noise = max(2 * math.hypot(a["mean_stderr"], b["mean_stderr"]), a["seed_spread"], b["seed_spread"])
    return {"diff": diff, "noise": noise, "within_noise": abs(diff) <= noise}


def collect(runs_dir: str, arms: list[str], seeds: list[int], needle_length: int = 4096,
            mean_lengths: tuple[int, ...] = (4096, 8192), base_dir: str | None = None) -> dict:
    """The results file's content (``needle_4k`` is taken at ``needle_length``; ``mean``
    averages the ``mean_lengths`` cells: the issue's 4K and 4K-8K by default)."""
    out = {"arms": {}}
    for arm in arms:
        runs = []
        for seed in seeds:
            d = os.path.join(runs_dir, arm, f"seed{seed}")
            ev_path = os.path.join(d, "eval_dense.json")
            meta = _load(os.path.join(d, "train_meta.json"))
            runs.append(seed_summary(_load(ev_path), meta, ev_path, needle_length, mean_lengths))
        if len({tuple(sorted(r["per_task"])) for r in runs}) != 1:
            fail(f"arm {arm}: seeds were evaluated on different task sets")
        out["arms"][arm] = arm_summary(runs)
    a = out["arms"]
    checks = {}
    if "dense" in a:
        checks["dense_needle_4k_ge_0.9"] = a["dense"]["needle_4k"] >= 0.9
    if {"sparsebalance", "megatron"} <= set(a):
        c = compare(a["sparsebalance"], a["megatron"])
        checks["sparsebalance_vs_megatron"] = {**c, "sparsebalance_ge_megatron": c["diff"] >= 0}
    if {"sparsebalance", "dense"} <= set(a):
        c = compare(a["sparsebalance"], a["dense"])
        checks["sparsebalance_vs_dense"] = {**c, "within_2_points": c["diff"] >= -0.02}
    out["checks"] = checks
    base = base_summary(base_dir) if base_dir else None
    if base is not None:
        out["base"] = base
    out["setup"] = {"eval_attention": "dense", "needle_length": needle_length,
                    "mean_over_lengths": list(mean_lengths),
                    "needle_task": NEEDLE, "runs_dir": os.path.abspath(runs_dir)}
    return out


def main(argv=None) -> int:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--runs-dir", required=True)
    p.add_argument("--base-dir", help="the base model's run (the curriculum's last stage), reported as 'base'")
    p.add_argument("--arms", nargs="+", required=True)
    p.add_argument("--seeds", nargs="+", type=int, required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--needle-length", type=int, default=4096, help="length of needle_4k (tokens)")
    p.add_argument("--mean-lengths", type=int, nargs="+", default=[4096, 8192],
                   help="lengths averaged in mean (tokens)")
    args = p.parse_args(argv)
    result = collect(args.runs_dir, args.arms, args.seeds, args.needle_length, tuple(args.mean_lengths),
                     args.base_dir)
    atomic_write_text(args.output, json.dumps(result, indent=1))
    print(json.dumps({arm: {k: v[k] for k in ("needle_4k", "mean", "wall_clock_s")}
                      for arm, v in result["arms"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
