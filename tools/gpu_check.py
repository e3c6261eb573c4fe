#!/usr/bin/env python
"""`make gpu-check`: prove the GPU path on one CUDA machine, in parts that each pass or fail.

Parts, in order (one failing never hides the rest; each has a time cap):

* ``deps``   install the pure-Python needs from wheels put in ``--wheels DIR`` beforehand
             (never torch, triton or nvidia-*: the machine's own stay), then import them;
* ``build``  build the C++/CUDA extension in place for this GPU's architecture;
* ``tests``  tests/ops/test_gpu_backends.py and every other test module that needs CUDA, with
             ``SPARSEBALANCE_TRITON_AUTOTUNE=0``: one launch config per Triton kernel, no
             autotuning (the tests check correctness, not speed);
* ``bench``  triton and cuda backends vs torch SDPA (flash, dense causal), one process per
             backend for all its points (imports and Triton autotuning are paid once; the
             bench does autotune): fwd and fwd+bwd, bf16, head dim 128, GQA, 16K-128K, block
             64 and 128, densities ~5%, 12%, 25%: ms, TFLOP/s on kept pairs, efficiency =
             speedup x density. Each finished point is kept even if its process later dies
             or runs out of its share of the time. The cuda rows are the extension's
             tensor-core kernels (``SPARSEBALANCE_CUDA_TENSOR_CORES=1``, opt-in until
             they have passed the tests part on a GPU).
* ``train``  pretrain_gpt.py, 20 iterations on one GPU in bf16 (Qwen2.5-0.5B-like layers cut
             to 4, 32K micro-batches, --sparse-balance --sb-cost-model h100-analytic): the loss
             must decrease and the summary JSON must hold the run's metrics.

Everything lands in ``--out DIR``: gpu_check.json (every part's status, seconds, data) and
gpu_check.md (the same as tables). Exit 0 if every part passed, 1 otherwise, 2 on bad
arguments. Without CUDA it prints one line and exits 0: there is nothing to check.

On the GPU machine (no internet; python3 already has torch and triton)::

    make gpu-check                      # = bash tools/gpu_check.sh
    WHEELS=/data/wheels OUT=/data/gpu_check bash tools/gpu_check.sh --parts tests,bench

The wheels, downloaded once on a connected machine::

    pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \\
        --no-deps -d wheels megatron-core==0.16.1 pybind11 ninja tqdm tensorboard
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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron.training.presets import PROJECT_RUN_FLAGS  # noqa: E402
PARTS = ("deps", "build", "tests", "bench", "train")
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


def parse_args(argv=None) -> argparse.Namespace:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="gpu_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "runs", "gpu_check"), help="report folder")
    p.add_argument("--wheels", default=os.path.join(REPO, "wheels"),
                   help="folder of wheels for the deps part (missing: use what is installed)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list from {','.join(PARTS)}")
    p.add_argument("--seq-lens", default="16384,32768,65536,131072", help="bench: tokens")
    p.add_argument("--backends", default="triton,cuda", help="bench: comma list from triton,cuda")
    p.add_argument("--bench-reps", type=int, default=3,
                   help="bench: timed repetitions per point (bench_attention.py --reps)")
    p.add_argument("--lengths", default="prolong",
                   help="train: document lengths for make_corpus.py (a shared/ name or a .json path)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="wall-clock budget of all parts; a part that would start after it is failed")
    # Internal: the bench part's per-backend process (see bench_worker).
    p.add_argument("--bench-worker", nargs=2, metavar=("POINTS_JSON", "OUT_JSONL"),
                   help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in a.parts if x not in PARTS]
    if bad or not a.parts:
        p.error(f"--parts must be a comma list from {','.join(PARTS)}, got {bad or a.parts}")
    try:
        a.seq_lens = [int(x) for x in a.seq_lens.split(",") if x]
    except ValueError:
        p.error(f"--seq-lens must be comma-separated integers, got {a.seq_lens!r}")
    a.backends = [x for x in a.backends.split(",") if x]
    if not a.backends or set(a.backends) - {"triton", "cuda"}:
        p.error(f"--backends must be a comma list from triton,cuda, got {a.backends}")
    if not a.seq_lens or min(a.seq_lens) < 1024:
        p.error("--seq-lens must be integers >= 1024")
    if a.budget_s <= 0:
        p.error("--budget-s must be > 0")
    if a.bench_reps < 1:
        p.error(f"--bench-reps must be >= 1, got {a.bench_reps}")
    if os.path.isfile(a.out):
        p.error(f"--out {a.out} is a file, expected a folder")
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
    wheels = sorted(w for w in glob.glob(os.path.join(a.wheels, "*.whl"))
                    if not os.path.basename(w).lower().startswith(SKIP_WHEELS))
    part = Part("deps", data={"wheels": [os.path.basename(w) for w in wheels]})
    if wheels:
        proc = _run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                     *wheels], left)
        if proc.returncode != 0:
            part.detail = "pip install from wheels failed: " + _last_line(proc)
            return part
    proc = _run([sys.executable, "-c", "import megatron.core, torch, triton; "
                 "print(megatron.core.__version__, torch.__version__, triton.__version__)"], left)
    part.passed = proc.returncode == 0
    part.detail = (f"megatron-core, torch, triton: {proc.stdout.strip()}" if part.passed else
                   "import failed: " + _last_line(proc) + f" (put the wheels in {a.wheels})")
    return part


def part_build(a, left: float) -> Part:
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}.{minor}"
    proc = _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], left,
                env={"TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(os.cpu_count() or 4)})
    ok = proc.returncode == 0
    if ok:  # the built extension must hold the CUDA kernels
        probe = _run([sys.executable, "-c", "from sparsebalance.ops import HAS_CUDA_EXT; "
                      "import sys; sys.exit(0 if HAS_CUDA_EXT else 1)"], 60)
        ok = probe.returncode == 0
        if not ok:
            return Part("build", False, detail="built, but sparsebalance.ops has no CUDA kernels",
                        data={"arch": arch})
    return Part("build", ok, detail=f"sm_{major}{minor}" if ok else _last_line(proc),
                data={"arch": arch})


def cuda_test_modules() -> List[str]:
    """Test modules that need CUDA: the GPU backends test and every module that skips
    itself without CUDA (``torch.cuda.is_available()`` at module level)."""
    out = []
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)):
        with open(path) as fh:
            text = fh.read()
        if "allow_module_level=True" in text and "cuda.is_available()" in text:
            out.append(os.path.relpath(path, REPO))
    return out


def part_tests(a, left: float) -> Part:
    mods = cuda_test_modules()
    if not mods:
        return Part("tests", False, detail="no CUDA test module found under tests/")
    junit = os.path.join(a.out, "gpu_tests.xml")
    # Correctness, not speed: one Triton launch config, no autotuning over every test shape.
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 f"--junitxml={junit}", *mods], left, env={"SPARSEBALANCE_TRITON_AUTOTUNE": "0"})
    tail = (proc.stdout or "").strip().splitlines()
    summary = tail[-1] if tail else _last_line(proc)
    return Part("tests", proc.returncode == 0, detail=summary, data={"modules": mods})


def topk_for_density(seq_len: int, block: int, density: float) -> int:
    """Top-k whose kept share of one causal document of ``seq_len`` tokens is about
    ``density``: with a cap of c = (topk + 2) x block keys per query, kept / causal pairs
    is ~2x - x^2 for x = c / seq_len, so x = 1 - sqrt(1 - density)."""
    from sparsebalance.attention.routing import density as exact

    x = 1.0 - (1.0 - density) ** 0.5
    guess = max(1, int(round(x * seq_len / block - 2)))
    # The estimate ignores block granularity; settle it with the exact routing count.
    return min(range(max(1, guess - 2), guess + 3),
               key=lambda k: abs(exact([seq_len], k, block) - density))


def bench_points(seq_lens: List[int], backends=("triton", "cuda")) -> List[dict]:
    """The benchmark grid, one backend after the other in the order given."""
    return [dict(backend=b, seq_len=s, block=blk, density=d,
                 topk=topk_for_density(s, blk, d))
            for b in backends for s in seq_lens for blk in (64, 128)
            for d in (0.05, 0.12, 0.25)]


def kept_tflops(res: dict) -> Dict[str, float]:
    """TFLOP/s on the kept pairs: forward 4 flops per kept (query, key) pair and head dim
    per head (QK^T and PV), backward 2.5x the forward (FlashAttention's accounting)."""
    pairs = res["density"] * res["seq_len"] * (res["seq_len"] + 1) / 2 * res["heads"]
    fwd = 4.0 * pairs * res["head_dim"]
    return {"fwd_tflops": fwd / (res["sparse_fwd_ms"] * 1e-3) / 1e12,
            "fwd_bwd_tflops": 3.5 * fwd / (res["sparse_ms"] * 1e-3) / 1e12}


def point_key(pt: dict) -> str:
    """A grid point in one line, as the ``failed`` entries name it."""
    return f"{pt['backend']} {pt['seq_len']}/{pt['block']}/{pt['density']}"


def bench_argv(pt: dict, reps: int, out: str) -> List[str]:
    """tools/bench_attention.py's arguments for one grid point."""
    return ["--seq-len", str(pt["seq_len"]), "--heads", "16", "--kv-heads", "2",
            "--head-dim", "128", "--block-size", str(pt["block"]), "--topk", str(pt["topk"]),
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
            "speedup": res["speedup"], "efficiency_fwd": fwd_speedup * res["density"],
            "efficiency": res["efficiency"], "gate_share": res["gate_share"],
            **kept_tflops(res)}


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


def part_bench(a, left: float) -> Part:
    rows, failed = [], []
    t0 = time.time()
    points = bench_points(a.seq_lens, a.backends)
    for i, backend in enumerate(a.backends):
        mine = [pt for pt in points if pt["backend"] == backend]
        # A fair share of the time left; the last backend gets all of it.
        cap = (left - (time.time() - t0)) / (len(a.backends) - i)
        if cap < 20:
            failed += [f"{point_key(pt)}: no time left" for pt in mine]
            continue
        with tempfile.TemporaryDirectory(prefix="gpu_check_bench-") as tmp:
            pts_file, out_file = os.path.join(tmp, "points.json"), os.path.join(tmp, "out.jsonl")
            with open(pts_file, "w") as fh:
                json.dump(mine, fh)
            proc = _run([sys.executable, os.path.abspath(__file__), "--bench-worker",
                         pts_file, out_file, "--bench-reps", str(a.bench_reps)], cap,
                        env={"SPARSEBALANCE_CUDA_TENSOR_CORES": "1"})
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


def part_train(a, left: float) -> Part:
    work = os.path.join(a.out, "train")
    os.makedirs(work, exist_ok=True)
    corpus = os.path.join(work, "corpus")
    if not os.path.isfile(corpus + ".idx"):
        proc = _run([sys.executable, "tools/make_corpus.py", "--output-prefix", corpus,
                     "--lengths", a.lengths, "--num-docs", "400", "--max-length", "32768"], left)
        if proc.returncode != 0:
            return Part("train", False, detail="corpus: " + _last_line(proc))
    summary = os.path.join(work, "summary.json")
    if os.path.exists(summary):
        os.unlink(summary)
    proc = _run([sys.executable, "pretrain_gpt.py", *PROJECT_RUN_FLAGS, "--data-path", corpus, "--bf16",
                 "--num-layers", "4", "--hidden-size", "896", "--ffn-hidden-size", "4864",
                 "--num-attention-heads", "14", "--num-query-groups", "2", "--swiglu",
                 "--normalization", "RMSNorm", "--rotary-base", "1000000",
                 "--seq-length", "32768", "--global-batch-size", "2", "--lr", "3e-4",
                 "--train-iters", "20", "--log-interval", "5", "--no-progress-bar",
                 "--sparse-balance", "--sb-block-size", "128", "--sb-topk", "16",
                 "--sb-cost-model", "h100-analytic", "--summary-json", summary], left)
    if proc.returncode != 0 or not os.path.isfile(summary):
        return Part("train", False, detail="pretrain_gpt.py: " + _last_line(proc))
    with open(summary) as fh:
        s = json.load(fh)
    return check_train_summary(s)


def check_train_summary(s: dict) -> Part:
    """The train part's verdict from the driver's summary JSON."""
    need = ("losses", "tokens_per_s", "step_ms_median", "density_mean", "plan_ms_median",
            "attention_backend")
    missing = [k for k in need if s.get(k) is None]
    if missing:
        return Part("train", False, detail=f"summary JSON lacks {missing}", data=s)
    losses = s["losses"]
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    ok = len(losses) >= 8 and last < first
    return Part("train", ok, detail=(f"loss {first:.3f} -> {last:.3f} (mean of first / last {k}), "
                                     f"{s['tokens_per_s']:.0f} tokens/s, "
                                     f"{s['step_ms_median']:.0f} ms/step, density "
                                     f"{s['density_mean']:.3f}, backend {s['attention_backend']}"),
                data={k2: s[k2] for k2 in need if k2 != "losses"} | {"losses": losses})


RUNNERS: Dict[str, Callable] = {"deps": part_deps, "build": part_build, "tests": part_tests,
                                "bench": part_bench, "train": part_train}


def run_parts(a, runners: Dict[str, Callable] = RUNNERS) -> List[Part]:
    """Every requested part in order, each isolated: an exception or a spent budget
    fails that part only."""
    t_start, out = time.time(), []
    for name in a.parts:
        left = a.budget_s - (time.time() - t_start)
        t0 = time.time()
        if left <= 5:
            part = Part(name, False, detail="not started: the time budget was spent")
        else:
            try:
                part = runners[name](a, left)
            except Exception as e:  # one part's bug must not hide the others' results
                part = Part(name, False, detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        part.seconds = round(time.time() - t0, 1)
        print(f"gpu-check: {name}: {'pass' if part.passed else 'FAIL'} ({part.seconds:.0f} s) "
              f"{part.detail}", flush=True)
        out.append(part)
    return out


def write_report(out_dir: str, parts: List[Part], device: str) -> None:
    """gpu_check.json and gpu_check.md, each written to a temp file and renamed."""
    os.makedirs(out_dir, exist_ok=True)
    doc = {"device": device, "passed": all(p.passed for p in parts),
           "parts": [asdict(p) for p in parts]}
    md = [f"# gpu-check on {device}", "", "| part | result | seconds | detail |", "|---|---|---|---|"]
    md += [f"| {p.name} | {'pass' if p.passed else '**FAIL**'} | {p.seconds:.0f} | {p.detail} |"
           for p in parts]
    bench = next((p for p in parts if p.name == "bench" and p.data.get("rows")), None)
    if bench:
        md += ["", "| backend | tokens | block | density | fwd ms (flash) | fwd+bwd ms (flash) | "
               "fwd+bwd TFLOP/s kept | efficiency fwd | efficiency fwd+bwd | routing share |",
               "|---|---|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['backend']} | {r['seq_len']} | {r['block']} | {r['density_measured']:.3f} | "
               f"{r['sparse_fwd_ms']:.2f} ({r['dense_fwd_ms']:.2f}) | {r['sparse_ms']:.2f} "
               f"({r['dense_ms']:.2f}) | {r['fwd_bwd_tflops']:.0f} | {r['efficiency_fwd']:.2f} | "
               f"{r['efficiency']:.2f} | {r['gate_share']:.1%} |" for r in bench.data["rows"]]
    for name, text in (("gpu_check.json", json.dumps(doc, indent=1)), ("gpu_check.md", "\n".join(md) + "\n")):
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, os.path.join(out_dir, name))


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.bench_worker:
        return bench_worker(*a.bench_worker, reps=a.bench_reps)
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} has no torch")
        return 0
    if not torch.cuda.is_available():
        print(f"gpu-check: skipped: no CUDA device ({sys.executable}: torch "
              f"{torch.__version__}, torch.cuda.is_available() is False)")
        return 0
    os.makedirs(a.out, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    parts = run_parts(a)
    write_report(a.out, parts, device)
    print(f"gpu-check: {sum(p.passed for p in parts)}/{len(parts)} parts passed; report: "
          f"{os.path.join(a.out, 'gpu_check.md')}")
    return 0 if all(p.passed for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
