"""What ``pretrain_gpt.py`` does with the flags of Megatron-LM's GPT functional-test configs.

Reads every ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a Megatron-LM
checkout, keeps the training cases (inference and RL cases are not ``pretrain_gpt.py``
launches), classifies each flag use with :func:`megatron.training.launch_check.classify`
and prints JSON: counts by status, the share honoured among the uses not refused for
hardware, per-config shares, and the most frequent refusals::

    git clone --depth 1 https://github.com/NVIDIA/Megatron-LM /tmp/Megatron-LM
    .venv/bin/python -m benchmarks.harness.megatron_lm_configs --megatron-lm /tmp/Megatron-LM          # this machine
    .venv/bin/python -m benchmarks.harness.megatron_lm_configs --megatron-lm /tmp/Megatron-LM --cuda   # a GPU node
"""

from __future__ import annotations

import collections
import glob
import json
import os
import statistics
import sys

NOT_TRAINING = ("--prompts", "--temperature", "--incoming-requests-per-sec", "--perform-rl-step")
"""A config with one of these flags runs Megatron-LM's inference or RL entry point."""


def config_flags(model_args: dict) -> list:
    """``[(flag, values)]`` of a config's ``MODEL_ARGS`` (``true``: a switch; ``false``: absent)."""
    out = []
    for key, value in model_args.items():
        if not str(key).startswith("--") or value is False or value == "false":
            continue
        out.append((str(key), [] if value is True or value is None or value == "true" else str(value).split()))
    return out


def measure(root: str, cuda: bool) -> dict:
    import yaml

    from megatron.training.launch_check import classify, summarize

    pattern = os.path.join(root, "tests", "functional_tests", "test_cases", "gpt", "*", "model_config.yaml")
    counts, shares, refused, unrecognized = collections.Counter(), [], collections.Counter(), collections.Counter()
    files = sorted(glob.glob(pattern))
    for path in files:
        with open(path, encoding="utf-8") as f:
            model_args = (yaml.safe_load(f) or {}).get("MODEL_ARGS") or {}
        if any(k in model_args for k in NOT_TRAINING):
            continue
        rows = classify(config_flags(model_args), cuda=cuda, te=cuda)
        shares.append(summarize(rows)["honoured_fraction"])
        for r in rows:
            counts[r["status"]] += 1
            if r["status"] == "unsupported":
                refused[f"{r['flag']}: {r['reason']}"] += 1
            elif r["status"] == "unrecognized":
                unrecognized[r["flag"]] += 1
    considered = sum(counts.values()) - counts["hardware"]
    return {"configs": len(files), "training_configs": len(shares), "cuda": cuda, "counts": dict(counts),
            "honoured_fraction": round(counts["honoured"] / considered, 4) if considered else None,
            "per_config_median": round(statistics.median(shares), 4) if shares else None,
            "per_config_at_least_95": sum(s >= 0.95 for s in shares),
            "top_refused": refused.most_common(8), "unrecognized": unrecognized.most_common()}


def main(argv=None) -> None:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="megatron_lm_configs.py", description=__doc__.splitlines()[0])
    p.add_argument("--megatron-lm", required=True, metavar="DIR", help="a Megatron-LM checkout")
    p.add_argument("--cuda", action="store_true", help="classify as on a GPU node with Transformer Engine")
    a = p.parse_args(argv)
    if not os.path.isdir(os.path.join(a.megatron_lm, "tests", "functional_tests")):
        p.error(f"--megatron-lm {a.megatron_lm}: no tests/functional_tests there (not a Megatron-LM checkout)")
    print(json.dumps(measure(a.megatron_lm, a.cuda), indent=1))


if __name__ == "__main__":
    sys.exit(main())
