#!/usr/bin/env python
"""`make gpu-check`: one GPU turned into the whole body of evidence, part by part.

The chain, in order (each part pass / fail / skip with its data; one failing never stops
the next; each has a time cap, :data:`PART_BUDGET_S`, inside the run's ``--budget-s``):

* ``deps``     the wheels benchmarks/gpu_check.sh installed offline (``.whl/`` into
               ``/tmp/site``): megatron-core, torch and triton import;
* ``build``    the C++/CUDA extension for this GPU's architecture (setup.py; a clear
               failure when nvcc is missing: flex and triton still run);
* ``tests``    every CUDA test module (flex, triton, cuda incl. tensor cores): outputs
               and dq/dk/dv against the reference, ``SPARSEBALANCE_TRITON_AUTOTUNE=0``;
* ``bench``    flex, triton and cuda (tensor cores) against the fastest dense causal SDPA
               kernel of the same process (flash or cuDNN, named per row): fwd and
               fwd+bwd, bf16, head dim 128, GQA 16:2, 16K-128K, block 64 and 128,
               densities ~5/12/25%: ms, TFLOP/s on kept pairs, efficiency = speedup x
               density, routing share. Every backend's 64K / block 128 points (the
               target point, ~12%, first) run before any backend's other points, one
               process per backend and tier; finished points are kept when a worker dies;
* ``train``    --model-preset qwen2.5-0.5b (24 layers, random init, bf16, one GPU), 32K
               and 64K micro-batches of packed documents resampled from --lengths:
               dense (SDPA) and sparse (--sparse-balance, the bench's best backend) over
               the same steps: tokens/s, peak memory, loss decreasing in both;
* ``profile``  tools/profile_latency.py on this GPU for that model (held-out MAPE), the
               profile written under --out, then benchmarks/compare.py --mode sim with it;
* ``accuracy`` examples/longctx/gpu.sh, only when enough time is left (else skipped).

The report, --out/gpu_check.json + gpu_check.md (atomic writes), holds every part and
the issue's targets, each met / not met / not measured. Parts of an earlier run on the
same device stay in the report unless redone, so a machine that allows 10 minutes per
command runs the chain in pieces (docs/gpu.md). Exit 0 when no part failed, 1
otherwise, 2 on bad arguments. Without CUDA it prints one line and exits 0, unless
``--dry-run``: the chain with tiny sizes on the CPU (numbers meaningless; report under
runs/gpu_check_dry by default).

The parts live in benchmarks/harness/gpu/: ``checks.py`` (deps, build, tests), ``bench.py``,
``stages.py`` (train, profile, accuracy), ``report.py`` (the report and its targets), all
starting tools through ``proc.run``; this file is the command line and the chain.

On the GPU machine (no internet; python3 has torch and triton; wheels from
``make gpu-prep`` in ``.whl/``, data in ``gpudata/``)::

    make gpu-check                                   # = bash benchmarks/gpu_check.sh
    bash benchmarks/gpu_check.sh --parts deps,build,tests --budget-s 560   # in pieces
    bash benchmarks/gpu_check.sh --parts bench --budget-s 560
    bash benchmarks/gpu_check.sh --parts train,profile --budget-s 560
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.harness.gpu import bench as gpu_bench  # noqa: E402
from benchmarks.harness.gpu import checks as gpu_checks  # noqa: E402
from benchmarks.harness.gpu import proc as gpu_proc  # noqa: E402
from benchmarks.harness.gpu import report as gpu_report  # noqa: E402
from benchmarks.harness.gpu import stages as gpu_stages  # noqa: E402
from benchmarks.harness.gpu.bench import BENCH_BACKENDS  # noqa: E402
from benchmarks.harness.gpu.proc import Part  # noqa: E402
from benchmarks.harness.gpu.report import OPTIONAL_PARTS, PARTS  # noqa: E402
from benchmarks.harness.gpu.stages import TRAIN_QUANTILE  # noqa: E402

PART_BUDGET_S = {"deps": 60, "build": 240, "tests": 400, "bench": 480, "train": 330,
                 "profile": 150, "accuracy": 1800}
"""Most seconds each part may take (also capped by what is left of --budget-s)."""


def parse_args(argv=None) -> argparse.Namespace:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None,
                   help="report folder (default results/gpu_check; dry run runs/gpu_check_dry)")
    p.add_argument("--wheels", default=os.path.join(REPO, ".whl"),
                   help="folder of wheels gpu_check.sh installed (recorded by the deps part)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list from {','.join(PARTS)}")
    p.add_argument("--seq-lens", default="65536,16384,32768,131072", help="bench: tokens")
    p.add_argument("--backends", default=",".join(BENCH_BACKENDS),
                   help=f"bench: comma list from {','.join(BENCH_BACKENDS)}")
    p.add_argument("--bench-reps", type=int, default=3,
                   help="bench: timed repetitions per point (bench_attention.py --reps)")
    p.add_argument("--train-seq-lens", default="32768,65536", help="train: micro-batch tokens")
    p.add_argument("--train-arms", default="sparse,dense",
                   help="train: which arms run, sparse first (a lease too short for both: sparse)")
    p.add_argument("--test-modules", default="",
                   help="tests: only these CUDA test modules (comma list of file names)")
    p.add_argument("--train-backend", default=None,
                   help="train/profile: the sparse backend (default: the bench's most efficient, "
                        "else auto)")
    p.add_argument("--lengths", default=None,
                   help="train: document lengths for make_corpus.py (a shared/ name or a .json "
                        "path; default gpudata/prolong.json if present, else prolong)")
    p.add_argument("--train-quantile", type=float, default=TRAIN_QUANTILE,
                   help="train: the --lengths quantile make_corpus.py maps to the micro-batch length "
                        f"(default {TRAIN_QUANTILE}: the ProLong mix's 99th percentile at 64K tokens, "
                        "median ~7.8K, block-128 top-8 density ~0.10: the long-document mix at density "
                        "<= 0.12 the training target names; 0.999, Run 5's, gives ~0.17)")
    p.add_argument("--budget-s", type=float, default=1500.0,
                   help="wall-clock budget of all parts; a part that would start after it is failed")
    p.add_argument("--part-budgets", dest="part_budgets_arg", default="",
                   help="NAME=SECONDS,... overriding a part's time cap (defaults: "
                        + ", ".join(f"{k} {v}" for k, v in PART_BUDGET_S.items()) + ")")
    p.add_argument("--dry-run", action="store_true",
                   help="the chain with tiny sizes on the CPU (tests the orchestration)")
    # Internal: the bench part's per-backend process (see bench_worker).
    p.add_argument("--bench-worker", nargs=2, metavar=("POINTS_JSON", "OUT_JSONL"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.repo = REPO
    a.parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in a.parts if x not in PARTS]
    if bad or not a.parts:
        p.error(f"--parts must be a comma list from {','.join(PARTS)}, got {bad or a.parts}")
    try:
        a.seq_lens = [int(x) for x in a.seq_lens.split(",") if x]
        a.train_seq_lens = [int(x) for x in a.train_seq_lens.split(",") if x]
    except ValueError:
        p.error(f"--seq-lens and --train-seq-lens must be comma-separated integers, got "
                f"{a.seq_lens!r}, {a.train_seq_lens!r}")
    a.backends = [x for x in a.backends.split(",") if x]
    a.test_modules = [x for x in a.test_modules.split(",") if x]
    if not a.backends or set(a.backends) - set(BENCH_BACKENDS):
        p.error(f"--backends must be a comma list from {','.join(BENCH_BACKENDS)}, got {a.backends}")
    if not a.seq_lens or min(a.seq_lens) < 1024:
        p.error("--seq-lens must be integers >= 1024")
    if not a.train_seq_lens or min(a.train_seq_lens) < 1024:
        p.error("--train-seq-lens must be integers >= 1024")
    arms = [x for x in a.train_arms.split(",") if x]
    if not arms or set(arms) - {"sparse", "dense"} or len(set(arms)) != len(arms):
        p.error(f"--train-arms must be sparse, dense or both (comma list), got {a.train_arms!r}")
    a.train_arms = [m for m in ("sparse", "dense") if m in arms]  # sparse first, whatever the order given
    if not 0.0 < a.train_quantile <= 1.0:
        p.error(f"--train-quantile must be in (0, 1], got {a.train_quantile}")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if a.bench_reps < 1:
        p.error(f"--bench-reps must be >= 1, got {a.bench_reps}")
    if a.out is None:
        a.out = os.path.join(REPO, "runs", "gpu_check_dry") if a.dry_run else \
            os.path.join(REPO, "results", "gpu_check")
    if os.path.isfile(a.out):
        p.error(f"--out {a.out} is a file, expected a folder")
    # Bulky work files (corpora, junit, run logs) stay out of the report folder, which is
    # committed: under runs/ (git-ignored).
    a.work = os.path.join(a.out, "work") if a.dry_run else os.path.join(REPO, "runs", "gpu_check_work")
    if a.lengths is None:
        local = os.path.join(REPO, "gpudata", "prolong.json")
        a.lengths = local if os.path.isfile(local) else "prolong"
    a.part_budgets = dict(PART_BUDGET_S)
    if a.dry_run:  # tiny sizes: the CPU kernel, 1K tokens, a small layer (DRY_RUN_BENCH_SHAPE);
        # a shared CPU is slow to profile
        a.seq_lens, a.backends, a.bench_reps = [1024], ["cpu"], 1
        a.part_budgets.update(train=400, profile=400)
    for item in [x for x in a.part_budgets_arg.split(",") if x]:
        name, _, sec = item.partition("=")
        try:
            val = float(sec)
        except ValueError:
            val = -1.0
        if name not in PARTS or val <= 0:
            p.error(f"--part-budgets takes NAME=SECONDS with NAME from {','.join(PARTS)} and "
                    f"SECONDS > 0, got {item!r}")
        a.part_budgets[name] = val
    return a


def _staged(name: str, fn: Callable) -> Callable:
    """A gpu_stages part as a runner: it gets gpu_check's runner and the best backend."""

    def runner(a, left: float) -> Part:
        ok, detail, data = fn(a, left, lambda *x, **k: gpu_proc.run(*x, **k),
                              getattr(a, "train_backend", None)
                              or gpu_bench.best_backend(getattr(a, "done", []), getattr(a, "earlier", None)))
        return Part(name, bool(ok), detail=detail, data=data, skipped=ok is None)

    return runner


RUNNERS: Dict[str, Callable] = {
    "deps": gpu_checks.part_deps, "build": gpu_checks.part_build, "tests": gpu_checks.part_tests,
    "bench": gpu_bench.part_bench,
    "train": _staged("train", gpu_stages.part_train),
    "profile": _staged("profile", gpu_stages.part_profile),
    "accuracy": _staged("accuracy", gpu_stages.part_accuracy),
}


def run_parts(a, runners: Dict[str, Callable] = RUNNERS,
              on_part: Optional[Callable[[List[Part]], None]] = None) -> List[Part]:
    """Every requested part in the chain's order, each isolated: an exception or a spent
    budget fails that part only (an optional part is skipped). A part gets at most its
    :data:`PART_BUDGET_S` (``a.part_budgets`` overrides) and what is left of the budget.
    ``on_part(parts so far)`` runs after each part (main writes the report there, so a
    run killed from outside keeps its finished parts)."""
    budgets = getattr(a, "part_budgets", PART_BUDGET_S)
    t_start, out = time.time(), []
    for name in [n for n in PARTS if n in a.parts]:
        left = a.budget_s - (time.time() - t_start)
        t0 = time.time()
        if left <= 5:
            part = Part(name, False, detail="not started: the time budget was spent",
                        skipped=name in OPTIONAL_PARTS)
        else:
            try:
                a.done = out  # earlier parts' results (train and profile use the bench's)
                part = runners[name](a, min(left, budgets.get(name, left)))
            except Exception as e:  # one part's bug must not hide the others' results
                part = Part(name, False, detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        part.seconds = round(time.time() - t0, 1)
        print(f"gpu-check: {name}: {part.status.upper() if part.status == 'fail' else part.status} "
              f"({part.seconds:.0f} s) {part.detail}", flush=True)
        out.append(part)
        if on_part is not None:
            on_part(out)
    return out


def write_report(out_dir: str, parts: List[Part], device: str, dry_run: bool = False) -> dict:
    """gpu_check.json and gpu_check.md (see benchmarks/harness/gpu/report.py)."""
    return gpu_report.write_report(out_dir, [p.as_dict() for p in parts], device, dry_run)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.bench_worker:
        return gpu_bench.bench_worker(*a.bench_worker, reps=a.bench_reps)
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} has no torch")
        return 0
    if not torch.cuda.is_available() and not a.dry_run:
        print(f"gpu-check: skipped: no CUDA device ({sys.executable}: torch "
              f"{torch.__version__}, torch.cuda.is_available() is False)")
        return 0
    os.makedirs(a.out, exist_ok=True)
    device = "cpu (dry run)" if a.dry_run else torch.cuda.get_device_name(0)
    a.device_name = device
    a.earlier = gpu_report.read_report(a.out, device)
    parts = run_parts(a, on_part=lambda done: write_report(a.out, done, device, a.dry_run))
    doc = write_report(a.out, parts, device, a.dry_run)
    for t in doc["targets"]:
        met = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        print(f"gpu-check: target {t['target']}: {t['value']} ({t['threshold']}): {met}")
    failed = [p.name for p in parts if p.status == "fail"]
    print(f"gpu-check: {len(parts) - len(failed)}/{len(parts)} parts did not fail; report: "
          f"{os.path.join(a.out, 'gpu_check.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
