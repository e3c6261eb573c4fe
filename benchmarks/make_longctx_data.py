"""Write the long-context training mix and held-out evaluation sets (RULER-style tasks).

Outputs in ``--output-dir``:

* ``train.jsonl`` — ``{"text": prompt + answer + "\\n"}`` per document: task
  samples (split "train") mixed with ``--filler-share`` ordinary prose documents
  whose lengths are resampled from ``data/lengths/<--lengths>.json``;
  feed it to ``tools/preprocess_data.py``.
* ``eval.jsonl`` — held-out samples (split "eval"), ``--eval-samples`` per
  (task, length), read by ``benchmarks/eval_longctx.py --data``.
* ``manifest.json`` — the settings and document counts.

Tiny CPU run::

    .venv/bin/python benchmarks/make_longctx_data.py --output-dir data/longctx-tiny \\
        --num-train-docs 200 --train-lengths 1024 --max-tokens 1024 \\
        --eval-lengths 1024 --eval-samples 4

Recipe / GPU cluster run (longer contexts, more data)::

    python benchmarks/make_longctx_data.py --output-dir /lustre/data/longctx --num-train-docs 200000 \\
        --train-lengths 4096,8192,16384 --max-tokens 16384 --eval-lengths 4096,8192,16384 \\
        --eval-samples 100 --lengths wlb_reconstruction
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness.longctx.mix import MixConfig, write_eval_set, write_training_mix  # noqa: E402
from benchmarks.harness.longctx.tasks import ALL_TASKS, TASKS, TaskConfig, generate_set  # noqa: E402
from sparsebalance.io import atomic_write_text  # noqa: E402

PROG = "make_longctx_data.py"
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")


def fail(message: str, code: int = 2) -> NoReturn:
    """One error line on stderr, then exit."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(code)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def int_list(text: str) -> tuple[int, ...]:
    """``"1024,2048"`` -> ``(1024, 2048)``."""
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def task_list(text: str) -> tuple[str, ...]:
    """``"niah_single,freq_words"`` (or ``all``: the evaluation suite) -> task names."""
    if text == "all":
        return TASKS
    out = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in out if t not in ALL_TASKS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown task {bad[0] if bad else text!r}; choose from "
                                         f"{', '.join(ALL_TASKS)} or all")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--num-train-docs", type=int, default=2000, help="documents in train.jsonl (0: none)")
    p.add_argument("--train-lengths", type=int_list, default=(1024, 2048, 4096),
                   help="context lengths (tokens) of task documents")
    p.add_argument("--train-tasks", type=task_list, default=TASKS,
                   help="comma list or all (the evaluation suite); copy is a training-only warm-up task")
    p.add_argument("--filler-share", type=float, default=0.25, help="fraction of filler documents")
    p.add_argument("--lengths", default="prolong",
                   help="filler lengths: a name in data/lengths or a JSON file path")
    p.add_argument("--filler-quantile", type=float, default=0.99,
                   help="quantile of the length file mapped to --max-tokens")
    p.add_argument("--max-tokens", type=int, default=4096, help="longest document (= --seq-length)")
    p.add_argument("--eval-lengths", type=int_list, default=(1024, 2048, 4096))
    p.add_argument("--eval-tasks", type=task_list, default=TASKS, help="comma list or all")
    p.add_argument("--eval-samples", type=int, default=20, help="samples per (task, length); 0: none")
    p.add_argument("--copy-chars", type=int, default=TaskConfig.copy_chars,
                   help="length of the copy task's code (training-only task)")
    p.add_argument("--value-digits", type=int, default=TaskConfig.value_digits,
                   help="digits of a needle's value (RULER's 7; longer values in a training mix "
                        "make copying them by position offset fail, so it has to match on content)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    lengths_file = args.lengths if args.lengths.endswith(".json") else os.path.join(
        LENGTHS_DIR, args.lengths + ".json")
    if args.num_train_docs < 0 or args.eval_samples < 0:
        fail("--num-train-docs and --eval-samples must be >= 0")
    if args.num_train_docs == 0 and args.eval_samples == 0:
        fail("nothing to write: --num-train-docs and --eval-samples are both 0")
    if args.num_train_docs and not os.path.isfile(lengths_file):
        fail(f"--lengths: {lengths_file} not found")
    try:
        tcfg = TaskConfig(copy_chars=args.copy_chars, value_digits=args.value_digits)
        mix = MixConfig(num_docs=max(args.num_train_docs, 1), lengths=args.train_lengths,
                        tasks=args.train_tasks, filler_share=args.filler_share,
                        lengths_file=lengths_file, filler_quantile=args.filler_quantile,
                        max_tokens=args.max_tokens, seed=args.seed, task_config=tcfg)
        evals = (generate_set(args.eval_tasks, args.eval_lengths, args.eval_samples, args.seed,
                              split="eval", config=tcfg) if args.eval_samples else [])
    except ValueError as e:
        fail(str(e))
    out = args.output_dir
    try:
        os.makedirs(out, exist_ok=True)
        counts = write_training_mix(os.path.join(out, "train.jsonl"), mix) if args.num_train_docs else {}
        n_eval = write_eval_set(os.path.join(out, "eval.jsonl"), evals) if evals else 0
        manifest = {"train_docs": counts, "eval_samples": n_eval, "mix": asdict(mix),
                    "eval": {"tasks": list(args.eval_tasks), "lengths": list(args.eval_lengths),
                             "samples_per_cell": args.eval_samples, "seed": args.seed}}
        if not args.num_train_docs:
            manifest.pop("mix")
        atomic_write_text(os.path.join(out, "manifest.json"), json.dumps(manifest, indent=1) + "\n")
    except (OSError, ValueError) as e:
        fail(str(e), code=1)
    print(json.dumps({"output_dir": out, "train_docs": sum(counts.values()), "eval_samples": n_eval,
                      "per_kind": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
