"""gpu-check's ``bench`` part: the grid of (backend, length, block, density) points, one
worker process per backend and tier running tools/bench_attention.py point by point, the
rows (ms, TFLOP/s on kept pairs, efficiency, routing share) and the best backend."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

from benchmarks.harness.gpu import proc as gpu_proc
from benchmarks.harness.gpu import report
from benchmarks.harness.gpu.proc import Part

BENCH_BACKENDS = ("fa4", "flex", "triton", "cuda")


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
    backend the target point (:data:`report.TARGET_POINT`) first, then its length and
    block, then the rest in the order of ``seq_lens``, so a worker cut short by its time
    share has measured what matters most."""
    tp = report.TARGET_POINT
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
        "bench_attention", os.path.join(gpu_proc.REPO, "tools", "bench_attention.py"))
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
            "gate_parts_ms": res.get("gate_parts_ms"), "gate_ms": res.get("gate_ms"),
            "route": res.get("route"), "gate_torch_ms": res.get("gate_torch_ms"),
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
        why = f"worker exit code {proc.returncode}: {gpu_proc.last_line(proc)}"
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
    tp = report.TARGET_POINT
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
            proc = gpu_proc.run([sys.executable, os.path.join(gpu_proc.REPO, "benchmarks", "gpu_check.py"),
                                 "--bench-worker",
                         pts_file, out_file, "--bench-reps", str(a.bench_reps)], cap,
                        env={"SPARSEBALANCE_CUDA_TENSOR_CORES": "1",
                             # bench_attention resolves names itself; keep auto off the clock
                             "SPARSEBALANCE_AUTO_MEASURE": "0"})
            r, f = collect_backend(mine, read_worker_lines(out_file), proc)
        rows += r
        failed += f
    best = {}  # at the target point only (64K, block 128, ~12%): Run 6 printed the 25% row's
    for r in report.target_rows(rows):
        best[r["backend"]] = max(best.get(r["backend"], 0.0), r["efficiency"])
    detail = (f"{len(rows)} points, {len(failed)} failed; efficiency at 64K block 128 density 0.12 (fwd+bwd): "
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
    rows = report.target_rows(rows) or rows
    return max(rows, key=lambda r: r["efficiency"])["backend"] if rows else "auto"
