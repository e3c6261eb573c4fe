"""Budget planner CLI.

    python -m sparsebalance.tuning plan --instance FILE.json --policy critical-path \
        --attn-slack 0.0 --json
    python -m sparsebalance.tuning plan --instance FILE.json --policy anchor \
        --anchor mean --p 0.1 --json
    python -m sparsebalance.tuning plan --instance FILE.json --sensitivity --json

Prints the plan as JSON (``budget``, ``step_ms``, ``baseline_step_ms``, ``attn``,
``baseline_attn``, ``critical_path``) or, without ``--json``, a one-line summary.
``--sensitivity``: the plan refined by the instance's ``weight`` (``sensitivity.py``).
A bad instance or argument gives one error line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from sparsebalance.config import DSTConfig

from . import instance_from_json
from .policies import DST_POLICIES


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sparsebalance.tuning")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    pl = sub.add_parser("plan", help="plan per-op budgets for one step")
    pl.add_argument("--instance", required=True, help="instance JSON file")
    pl.add_argument("--policy", choices=sorted(DST_POLICIES), default="critical-path")
    pl.add_argument("--attn-slack", type=float, default=0.0,
                    help="critical-path: fraction of static attention that may be lost")
    pl.add_argument("--anchor", choices=("mean", "max", "min"), default="mean")
    pl.add_argument("--p", type=float, default=0.1, help="anchor: budget window +-p * k0")
    pl.add_argument("--sensitivity", action="store_true",
                    help="refine the plan by the instance's 'weight' (per micro-batch or per op; same "
                         "step time and kept pairs, budget toward sensitive micro-batches and stages)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with open(args.instance) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        sys.stderr.write(f"error: cannot read instance {args.instance}: {e}\n")
        return 2
    try:
        inst = instance_from_json(raw)
        dst = DSTConfig(policy=args.policy, topk_min=int(inst.kmin), topk_max=int(inst.kmax),
                        anchor=args.anchor, p=args.p, attn_slack=args.attn_slack)
        plan = DST_POLICIES[args.policy](inst, dst)
        if args.sensitivity:
            if inst.weight is None:
                raise ValueError("--sensitivity needs the instance's 'weight'")
            from .sensitivity import sensitivity_plan

            plan = sensitivity_plan(inst, plan)
    except ValueError as e:
        sys.stderr.write(f"error: bad instance or arguments: {e}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plan.to_json()) + "\n")
    else:
        sys.stdout.write(f"{plan.policy}: step {plan.step_ms:.3f} ms (static "
                         f"{plan.baseline_step_ms:.3f}), attention {plan.attn:.6g} "
                         f"({100 * (1 - plan.attn_loss):.2f}% of static)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
