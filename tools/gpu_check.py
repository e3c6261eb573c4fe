#!/usr/bin/env python
"""`make gpu-check`: one GPU turned into the whole body of evidence, part by part.

The chain, in order (each part pass / fail / skip with its data; one failing never stops
the next; each has a time cap, :data:`PART_BUDGET_S`, inside the run's ``--budget-s``):

* ``deps``     the wheels tools/gpu_check.sh installed offline (``.whl/`` into
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
               profile written under --out, then tools/compare.py --mode sim with it;
* ``accuracy`` examples/longctx/gpu.sh, only when enough time is left (else skipped).

The report, --out/gpu_check.json + gpu_check.md (atomic writes), holds every part and
the issue's targets, each met / not met / not measured. Parts of an earlier run on the
same device stay in the report unless redone, so a machine that allows 10 minutes per
command runs the chain in pieces (docs/gpu.md). Exit 0 when no part failed, 1
otherwise, 2 on bad arguments. Without CUDA it prints one line and exits 0, unless
``--dry-run``: the chain with tiny sizes on the CPU (numbers meaningless; report under
runs/gpu_check_dry by default).

On the GPU machine (no internet; python3 has torch and triton; wheels from
``make gpu-prep`` in ``.whl/``, data in ``gpudata/``)::

    make gpu-check                                   # = bash tools/gpu_check.sh
    bash tools/gpu_check.sh --parts deps,build,tests --budget-s 560   # in pieces
    bash tools/gpu_check.sh --parts bench --budget-s 560
    bash tools/gpu_check.sh --parts train,profile --budget-s 560
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.harness.gpu import report as gpu_report  # noqa: E402
from tools.harness.gpu import stages as gpu_stages  # noqa: E402
from tools.harness.gpu.report import OPTIONAL_PARTS, PARTS  # noqa: E402

PART_BUDGET_S = {"deps": 60, "build": 240, "tests": 400, "bench": 480, "train": 330,
                 "profile": 150, "accuracy": 1800}
"""Most seconds each part may take (also capped by what is left of --budget-s)."""
BENCH_BACKENDS = ("fa4", "flex", "triton", "cuda")
SKIP_WHEELS = ("torch-", "triton-", "nvidia_", "nvidia-")
"""Wheels never installed over the machine's own CUDA stack."""


@dataclass
class Part:
    """The outcome of one part."""

    name: str
    passed: bool = False
    seconds: float = 0.0
    detail: str = ""
    """One line: what was checked, or why it failed."""
    data: dict = field(default_factory=dict)
    skipped: bool = False
    """Not run, and allowed not to be (optional parts)."""

    @property
    def status(self) -> str:
        return "skip" if self.skipped else ("pass" if self.passed else "fail")

    def as_dict(self) -> dict:
        return {**asdict(self), "status": self.status}


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
    p.add_argument("--test-modules", default="",
                   help="tests: only these CUDA test modules (comma list of file names)")
    p.add_argument("--train-backend", default=None,
                   help="train/profile: the sparse backend (default: the bench's most efficient, "
                        "else auto)")
    p.add_argument("--lengths", default=None,
                   help="train: document lengths for make_corpus.py (a shared/ name or a .json "
                        "path; default gpudata/prolong.json if present, else prolong)")
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


def _run(cmd: List[str], timeout: float, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Run a command from the repo root; a timeout is returned as exit code 124."""
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f} s")


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or "").strip().splitlines() or (proc.stdout or "").strip().splitlines()
    return lines[-1][:300] if lines else f"exit code {proc.returncode}"


def part_deps(a, left: float) -> Part:
    """The offline install happened in gpu_check.sh (PYTHONPATH=/tmp/site); here: the
    wheels it had and whether the stack imports."""
    wheels = sorted(os.path.basename(w) for w in glob.glob(os.path.join(a.wheels, "*.whl"))
                    if not os.path.basename(w).lower().startswith(SKIP_WHEELS))
    proc = _run([sys.executable, "-c", "import megatron.core, torch, triton; "
                 "print(megatron.core.__version__, torch.__version__, triton.__version__)"], left)
    ok = proc.returncode == 0
    fa4 = _run([sys.executable, "-c", "import flash_attn.cute, cutlass; print(cutlass.__version__)"], left)
    fa4_said = f"cutlass-dsl {fa4.stdout.strip()}" if fa4.returncode == 0 else "not importable: " + _last_line(fa4)
    detail = (f"megatron-core, torch, triton: {proc.stdout.strip()}; flash-attn-4: {fa4_said}" if ok else
              "import failed: " + _last_line(proc) + f" (run `make gpu-prep` on a connected "
              f"machine and carry {os.path.relpath(a.wheels, REPO)}/)")
    return Part("deps", ok, detail=detail, data={"wheels": wheels, "fa4": fa4_said,
                                                 "pythonpath": os.environ.get("PYTHONPATH", "")})


def part_build(a, left: float) -> Part:
    """setup.py build_ext for this GPU's architecture; the CUDA kernels must load after."""
    if a.dry_run:  # the CPU machine's extension is already built (`make build`)
        probe = _run([sys.executable, "-c", "from sparsebalance.ops import HAS_CPU_EXT; "
                      "import sys; sys.exit(0 if HAS_CPU_EXT else 1)"], left)
        return Part("build", probe.returncode == 0, detail="dry run: the CPU extension imports"
                    if probe.returncode == 0 else "dry run: no CPU extension (run make build)")
    import torch
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    if cpp_extension.CUDA_HOME is None or not (shutil.which("nvcc") or os.path.isfile(
            os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))):
        return Part("build", False, detail="nvcc not found (no CUDA toolkit): the cuda backend "
                    "cannot be built; flex and triton need no build", data={"arch": arch})
    proc = _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], left,
                env={"TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(os.cpu_count() or 4)})
    if proc.returncode != 0:
        return Part("build", False, detail=_last_line(proc), data={"arch": arch})
    probe = _run([sys.executable, "-c", "from sparsebalance.ops import HAS_CUDA_EXT; "
                  "import sys; sys.exit(0 if HAS_CUDA_EXT else 1)"], 60)
    if probe.returncode != 0:
        return Part("build", False, detail="built, but sparsebalance.ops has no CUDA kernels",
                    data={"arch": arch})
    return Part("build", True, detail=f"sm_{major}{minor}", data={"arch": arch})


TEST_MODULES_FIRST = ("test_fa4_gpu.py", "test_flex_gpu.py", "test_gpu_backends.py")
"""CUDA test modules run first, in this order (the kernels' correctness); the others
(the measured ``auto``, which times every backend) follow alphabetically."""


def cuda_test_modules() -> List[str]:
    """Test modules that need CUDA: the GPU backends test and every module that skips
    itself without CUDA (``torch.cuda.is_available()`` at module level), in run order
    (:data:`TEST_MODULES_FIRST` first)."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)):
        with open(path) as fh:
            text = fh.read()
        if "allow_module_level=True" in text and "cuda.is_available()" in text:
            out.append(os.path.relpath(path, REPO))
    rank = lambda m: (TEST_MODULES_FIRST.index(os.path.basename(m)) if os.path.basename(m) in TEST_MODULES_FIRST
                      else len(TEST_MODULES_FIRST), m)
    return sorted(out, key=rank)


def junit_summary(path: str, module: str = "?") -> dict:
    """Per-module counts and the failed test ids of a pytest junit XML file (``module``
    names the entries without a class name, such as a module's own skip)."""
    if not os.path.isfile(path):
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return {}
    mods, failed = {}, []
    for case in root.iter("testcase"):
        mod = case.get("classname") or module  # module (or module.Class)
        m = mods.setdefault(mod, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            m["failed"] += 1
            failed.append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            m["skipped"] += 1
        else:
            m["passed"] += 1
    return {"by_module": mods, "failed_tests": failed}


_VERBOSE_RESULT = re.compile(r"^(\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
"""One finished test in ``pytest -v`` output: path, test id, result."""


def stdout_summary(text: str, module: str) -> dict:
    """:func:`junit_summary`'s shape from ``pytest -v`` output (one ``path::test RESULT``
    line per finished test), for a module killed before pytest wrote its junit file: the
    tests that finished before the cut still count."""
    mods, failed = {}, []
    for line in (text or "").splitlines():
        m = _VERBOSE_RESULT.match(line.strip())
        if not m:
            continue
        path, name, result = m.groups()
        key = path[:-3].replace("/", ".") if path.endswith(".py") else module
        counts = mods.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
        if result in ("FAILED", "ERROR"):
            counts["failed"] += 1
            failed.append(f"{key}::{name}")
        elif result in ("SKIPPED", "XFAIL"):
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {"by_module": mods, "failed_tests": failed} if mods else {}


def part_tests(a, left: float) -> Part:
    """Each CUDA test module in its own pytest (a module that hangs or runs out of time
    does not hide the others' results); a module may use what is left of the part's time
    but 45 s for each module after it."""
    mods = cuda_test_modules()
    only = getattr(a, "test_modules", None)
    if only:
        mods = [m for m in mods if os.path.basename(m) in only]
    if not mods:
        return Part("tests", False, detail="no CUDA test module found under tests/"
                    + (f" named {','.join(only)}" if only else ""))
    os.makedirs(a.work, exist_ok=True)
    t0, by_module, failed_tests, lines, ok = time.time(), {}, [], [], True
    for i, mod in enumerate(mods):
        # all that is left but a 45 s reserve for each module still to come
        cap = max(left - (time.time() - t0) - 45.0 * (len(mods) - 1 - i), 10.0)
        junit = os.path.join(a.work, f"gpu_tests_{i}.xml")
        if os.path.exists(junit):
            os.unlink(junit)
        # Correctness, not speed: one Triton launch config, no autotuning over every test shape.
        # -v: one line per finished test, so a module cut at its cap still reports those
        proc = _run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                     f"--junitxml={junit}", mod], cap, env={"SPARSEBALANCE_TRITON_AUTOTUNE": "0"})
        got = junit_summary(junit, mod) or stdout_summary(proc.stdout, mod)
        by_module.update(got.get("by_module", {}))
        failed_tests += got.get("failed_tests", [])
        tail = (proc.stdout or "").strip().splitlines()
        said = tail[-1].strip("= ") if tail and proc.returncode != 124 else _last_line(proc)
        if proc.returncode == 124:
            done = got.get("by_module", {}).values()
            said += (f" ({sum(m['passed'] for m in done)} passed, {sum(m['failed'] for m in done)} failed "
                     f"before the cut)")
        lines.append(f"{os.path.basename(mod)}: {said}")
        mod_ok = proc.returncode == 0 or (getattr(a, "dry_run", False) and proc.returncode == 5)
        ok &= mod_ok  # exit 5 (nothing collected: every module skips itself) only in a dry run
    counts = {k: sum(m[k] for m in by_module.values()) for k in ("passed", "failed", "skipped")}
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if getattr(a, "dry_run", False):
        summary = f"dry run (CUDA modules skip on the CPU): {summary}"
    return Part("tests", ok, detail=summary, data={"modules": mods, "by_module": by_module,
                                                   "failed_tests": failed_tests, "per_module": lines})


def topk_for_density(seq_len: int, block: int, density: float) -> int:
    """Top-k whose kept share of one causal document of ``seq_len`` tokens is about
    ``density``: with a cap of c = (topk + 2) x block keys per query, kept / causal pairs
    is ~2x - x^2 for x = c / seq_len, so x = 1 - sqrt(1 - density)."""
    from sparsebalance.pairs import density as exact

    x = 1.0 - (1.0 - density) ** 0.5
    guess = max(1, int(round(x * seq_len / block - 2)))
    # The estimate ignores block granularity; settle it with the exact routing count.
    return min(range(max(1, guess - 2), guess + 3),
               key=lambda k: abs(exact([seq_len], k, block) - density))


def bench_points(seq_lens: List[int], backends=BENCH_BACKENDS) -> List[dict]:
    """The benchmark grid, one backend after the other in the order given; inside a
    backend the target point (:data:`gpu_report.TARGET_POINT`) first, then its length and
    block, then the rest in the order of ``seq_lens``, so a worker cut short by its time
    share has measured what matters most."""
    tp = gpu_report.TARGET_POINT
    rank = lambda s, blk, d: (s != tp["seq_len"] or blk != tp["block"], s != tp["seq_len"],
                              blk != tp["block"], d != tp["density"])
    grid = sorted(((s, blk, d) for s in seq_lens for blk in (128, 64) for d in (0.12, 0.05, 0.25)),
                  key=lambda p: (rank(*p), seq_lens.index(p[0])))
    pts = []
    for b in backends:
        for s, blk, d in grid:
            if b == "fa4" and blk != 128:  # FA4's Hopper key tile is the routing block
                continue
            pts.append(dict(backend=b, seq_len=s, block=blk, density=d, topk=topk_for_density(s, blk, d)))
            if b == "fa4" and (s, blk, d) == (tp["seq_len"], tp["block"], tp["density"]):
                # the Qwen2.5-0.5B preset's own attention shape, right after the target
                pts.append(dict(pts[-1], **PRESET_SHAPE))
    return pts


def kept_tflops(res: dict) -> Dict[str, float]:
    """TFLOP/s on the kept pairs: forward 4 flops per kept (query, key) pair and head dim
    per head (QK^T and PV), backward 2.5x the forward (FlashAttention's accounting)."""
    pairs = res["density"] * res["seq_len"] * (res["seq_len"] + 1) / 2 * res["heads"]
    fwd = 4.0 * pairs * res["head_dim"]
    return {"fwd_tflops": fwd / (res["sparse_fwd_ms"] * 1e-3) / 1e12,
            "fwd_bwd_tflops": 3.5 * fwd / (res["sparse_ms"] * 1e-3) / 1e12}


def point_key(pt: dict) -> str:
    """A grid point in one line, as the ``failed`` entries name it."""
    return f"{pt['backend']} {pt['seq_len']}/{pt['block']}/{pt['density']}" + (
        f" {pt['shape']}" if pt.get("shape") else "")


BENCH_SHAPE = {"heads": 16, "kv_heads": 2, "head_dim": 128}
"""The attention layer the bench times (Qwen2.5-3B's: 16 query heads, 2 KV groups, hd128)."""
PRESET_SHAPE = {"heads": 14, "kv_heads": 2, "head_dim": 64, "shape": "qwen2.5-0.5b"}
"""Qwen2.5-0.5B's attention layer (the train part's model), timed at the target point too."""
DRY_RUN_BENCH_SHAPE = {"heads": 4, "kv_heads": 2, "head_dim": 64}
"""``--dry-run``: a tiny layer of the same kind (grouped queries), so a CPU times it in
about a second a point; the orchestration around it is the same."""


def bench_argv(pt: dict, reps: int, out: str) -> List[str]:
    """tools/bench_attention.py's arguments for one grid point (the layer's shape:
    :data:`BENCH_SHAPE`, unless the point names its own, as a dry run's do)."""
    shape = {k: pt.get(k, v) for k, v in BENCH_SHAPE.items()}
    return ["--seq-len", str(pt["seq_len"]), "--heads", str(shape["heads"]), "--kv-heads", str(shape["kv_heads"]),
            "--head-dim", str(shape["head_dim"]), "--block-size", str(pt["block"]), "--topk", str(pt["topk"]),
            "--backend", pt["backend"], "--dtype", "bf16", "--reps", str(reps),
            "--json", "--out", out]


def _bench_main() -> Callable:
    spec = importlib.util.spec_from_file_location(
        "bench_attention", os.path.join(REPO, "tools", "bench_attention.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def bench_worker(points_json: str, out_jsonl: str, reps: int,
                 bench_main: Optional[Callable] = None) -> int:
    """One backend's points in this process, one after the other (imports and Triton's
    compile and autotune caches are shared). Each point appends one line to ``out_jsonl``
    as soon as it is done: ``{"point", "result"}`` or ``{"point", "error"}``; a point that
    fails does not stop the next. A crash or a kill keeps the lines already written."""
    bench_main = bench_main or _bench_main()
    with open(points_json) as fh:
        points = json.load(fh)
    tmp = out_jsonl + ".point.json"
    for pt in points:
        if os.path.exists(tmp):
            os.unlink(tmp)
        said, error = io.StringIO(), None
        try:
            with contextlib.redirect_stderr(said):
                rc = bench_main(bench_argv(pt, reps, tmp))
        except SystemExit as e:  # bench_attention's argument errors
            rc = e.code if isinstance(e.code, int) else 1
        except Exception as e:  # e.g. CUDA out of memory at 128K: the next point may fit
            rc, error = None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        sys.stderr.write(said.getvalue())
        if rc == 0 and os.path.isfile(tmp) and os.path.getsize(tmp):
            with open(tmp) as fh:
                line = {"point": pt, "result": json.load(fh)}
        else:
            last = said.getvalue().strip().splitlines()
            line = {"point": pt, "error": error or (f"bench_attention.py exit code {rc}"
                                                    + (f": {last[-1][:300]}" if last else ""))}
        with open(out_jsonl, "a") as fh:  # one write per point: a kill loses no finished line
            fh.write(json.dumps(line) + "\n")
        gc.collect()  # free the point's tensors before the next, larger one
        if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
            sys.modules["torch"].cuda.empty_cache()
    if os.path.exists(tmp):
        os.unlink(tmp)
    return 0


def read_worker_lines(path: str) -> List[dict]:
    """The complete lines of a worker's JSONL file (a line cut by a kill is dropped)."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as fh:
        for text in fh:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and "point" in line:
                out.append(line)
    return out


def bench_row(pt: dict, res: dict) -> dict:
    """One row of the bench table from bench_attention.py's JSON."""
    fwd_speedup = res["dense_fwd_ms"] / res["sparse_fwd_ms"]
    return {**pt, "density_measured": res["density"], "dense_fwd_ms": res["dense_fwd_ms"],
            "sparse_fwd_ms": res["sparse_fwd_ms"], "dense_ms": res["dense_ms"],
            "sparse_ms": res["sparse_ms"], "speedup_fwd": fwd_speedup,
            "dense_ms_by_backend": res.get("dense_ms_by_backend"),
            "speedup": res["speedup"], "efficiency_fwd": fwd_speedup * res["density"],
            "efficiency": res["efficiency"], "gate_share": res["gate_share"],
            "gate_parts_ms": res.get("gate_parts_ms"),
            "dense_backend": res.get("dense_backend", "sdpa"),
            "padding_ratio": res.get("padding_ratio", 1.0), **kept_tflops(res)}


def collect_backend(points: List[dict], lines: List[dict],
                    proc: subprocess.CompletedProcess) -> Tuple[List[dict], List[str]]:
    """(rows, failed) of one backend's worker: its finished points are rows, its failed
    points name their error, and the points it never reached name why the worker stopped."""
    done = {point_key(x["point"]): x for x in lines}
    if proc.returncode == 124:
        why = proc.stderr or "timed out"
    else:
        why = f"worker exit code {proc.returncode}: {_last_line(proc)}"
    rows, failed = [], []
    for pt in points:
        line = done.get(point_key(pt))
        if line is None:
            failed.append(f"{point_key(pt)}: not run: {why}")
        elif "result" in line:
            try:
                rows.append(bench_row(pt, line["result"]))
            except (KeyError, TypeError, ZeroDivisionError) as e:
                failed.append(f"{point_key(pt)}: bad result ({type(e).__name__}: {e})")
        else:
            failed.append(f"{point_key(pt)}: {line.get('error')}")
    return rows, failed


def bench_workers(points: List[dict], backends) -> List[Tuple[bool, List[dict]]]:
    """The bench's worker processes in run order, ``(first_tier, points)``: every
    backend's points at the target length and block (its target point first) before any
    backend's other points, so that one backend's slow secondary compilations (flex's
    block-64 autotuning, say) cannot take the time of another backend's target point."""
    tp = gpu_report.TARGET_POINT
    first = lambda pt: pt["seq_len"] == tp["seq_len"] and pt["block"] == tp["block"]
    out = []
    for tier in (True, False):
        for b in backends:
            mine = [pt for pt in points if pt["backend"] == b and first(pt) == tier]
            if mine:
                out.append((tier, mine))
    return out


def part_bench(a, left: float) -> Part:
    rows, failed = [], []
    t0 = time.time()
    points = bench_points(a.seq_lens, a.backends)
    if getattr(a, "dry_run", False):
        points = [dict(pt, **DRY_RUN_BENCH_SHAPE) for pt in points]
    workers = bench_workers(points, a.backends)
    for i, (tier, mine) in enumerate(workers):
        # A fair share of the time left: a first-tier worker shares with the first-tier
        # workers still to come and one share for all the second tier; a second-tier
        # worker with every worker still to come; the last gets all of it.
        todo = workers[i:]
        n_first = sum(1 for t, _ in todo if t)
        shares = n_first + (1 if len(todo) > n_first else 0) if tier else len(todo)
        cap = (left - (time.time() - t0)) / shares
        if cap < 20:
            failed += [f"{point_key(pt)}: no time left" for pt in mine]
            continue
        with tempfile.TemporaryDirectory(prefix="gpu_check_bench-") as tmp:
            pts_file, out_file = os.path.join(tmp, "points.json"), os.path.join(tmp, "out.jsonl")
            with open(pts_file, "w") as fh:
                json.dump(mine, fh)
            proc = _run([sys.executable, os.path.abspath(__file__), "--bench-worker",
                         pts_file, out_file, "--bench-reps", str(a.bench_reps)], cap,
                        env={"SPARSEBALANCE_CUDA_TENSOR_CORES": "1",
                             # bench_attention resolves names itself; keep auto off the clock
                             "SPARSEBALANCE_AUTO_MEASURE": "0"})
            r, f = collect_backend(mine, read_worker_lines(out_file), proc)
        rows += r
        failed += f
    best = {}
    for r in rows:
        if r["seq_len"] == 65536 and r["block"] == 128:
            best[r["backend"]] = max(best.get(r["backend"], 0.0), r["efficiency"])
    detail = (f"{len(rows)} points, {len(failed)} failed; efficiency at 64K block 128 (fwd+bwd): "
              + (", ".join(f"{b} {e:.2f}" for b, e in best.items()) or "n/a"))
    return Part("bench", bool(rows) and not failed, detail=detail,
                data={"rows": rows, "failed": failed, "best_efficiency_64k_b128": best})


def best_backend(parts: List[Part], earlier: Optional[dict] = None) -> str:
    """The bench's most efficient backend at the target point (fwd+bwd), else at any
    point; the bench of this run, else of ``earlier`` (the report of an earlier run on
    this device: the chain run in pieces); ``auto`` (measured on first use) without one."""
    bench = next((p for p in parts if p.name == "bench"), None)
    rows = bench.data.get("rows", []) if bench else []
    if not rows and earlier:
        rows = next((p.get("data", {}).get("rows", []) for p in earlier.get("parts", [])
                     if p.get("name") == "bench"), [])
    rows = gpu_report.target_rows(rows) or rows
    return max(rows, key=lambda r: r["efficiency"])["backend"] if rows else "auto"


def _staged(name: str, fn: Callable) -> Callable:
    """A gpu_stages part as a runner: it gets gpu_check's runner and the best backend."""

    def runner(a, left: float) -> Part:
        ok, detail, data = fn(a, left, lambda *x, **k: _run(*x, **k),
                              getattr(a, "train_backend", None)
                              or best_backend(getattr(a, "done", []), getattr(a, "earlier", None)))
        return Part(name, bool(ok), detail=detail, data=data, skipped=ok is None)

    return runner


RUNNERS: Dict[str, Callable] = {
    "deps": part_deps, "build": part_build, "tests": part_tests, "bench": part_bench,
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
    """gpu_check.json and gpu_check.md (see tools/harness/gpu/report.py)."""
    return gpu_report.write_report(out_dir, [p.as_dict() for p in parts], device, dry_run)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.bench_worker:
        return bench_worker(*a.bench_worker, reps=a.bench_reps)
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
