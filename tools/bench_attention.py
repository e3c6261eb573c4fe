"""Benchmark block top-k sparse attention against torch's dense causal SDPA.

Forward+backward of both, in one process, interleaved repetitions, medians,
fixed threads. Prints one JSON object: dense_ms, sparse_ms (gate and selection
included), density, speedup = dense_ms / sparse_ms, efficiency = speedup x
density (1.0 = the work saved is fully turned into time), gate_ms (routing plan:
block means, gate, top-k, as every layer runs it: the plan's skeleton, built once per
micro-batch, is cached; for flex also the buffer layout and the block mask, for fa4 its
descriptors; gate_parts_ms times the parts alone, fa4's with the skeleton),
gate_share = gate_ms / sparse_ms, route (``fused``: the plan by three Triton kernels, the
default on CUDA; ``torch``: by torch ops) with gate_torch_ms (fused: the same gate by torch
ops, for comparison), and speedup_min (ratio of the fastest repetitions, a
cross-check on a loaded machine). On CUDA the dense baseline is the fastest of SDPA's
flash and cuDNN kernels (--dense-backends), named in dense_backend; flex also reports
padding_ratio (rows of its block-aligned buffer / tokens).

Threshold routing (``--routing threshold``): the sparse run routes with a count per (query
block, head) and a second sparse run with one count per query block (the largest head's) is
timed alongside; ``counts`` gives each one's kept_pairs, sparse_ms and ms_per_mpair (ms per
million kept pairs; ``_min``: of the fastest repetition; ``cpu_ms``: the process's CPU
time, steadier than wall time on a shared machine, best with ``--threads 1``), and
``per_head_over_per_block`` the ratios (pairs, ms, ms per pair).
Random q/k give flat gates (every head keeps its cap); ``--inputs blocks`` gives each block
a shared direction seen by each head at its own strength (heads from peaked to flat:
:func:`block_inputs`), and
``--qk FILE`` takes a model's q/k (a torch .pt dict: ``q [T, H, D]``, ``k [T, Hkv, D]``,
optional ``v`` and int ``cu_seqlens [n_docs + 1]``; ``--seq-len`` then defaults to T and
cuts the first tokens). ``--no-dense`` skips the dense baseline.

Tiny CPU run:
    OMP_NUM_THREADS=2 .venv/bin/python tools/bench_attention.py --seq-len 2048 --heads 2 \\
        --head-dim 64 --block-size 64 --topk 4 --backend cpu --reps 3 --json
The project's CPU point (16K tokens, density ~0.08):
    OMP_NUM_THREADS=2 .venv/bin/python tools/bench_attention.py --seq-len 16384 --heads 8 \\
        --head-dim 64 --block-size 64 --topk 8 --backend cpu --json
Document mix (lengths resampled from the ProLong length file, packed to 16K):
    ... --seq-len 16384 --doc-mix data/lengths/prolong.json
Threshold routing, per-head vs per-block counts (16K tokens, TAU 0.9):
    OMP_NUM_THREADS=2 .venv/bin/python tools/bench_attention.py --seq-len 16384 --heads 8 \
        --head-dim 64 --block-size 64 --topk 64 --routing threshold --threshold 0.9 \
        --inputs blocks --no-dense --backend cpu --json
    ... --qk runs/qk/smollm2_layer12.pt   (a model's q/k instead of --inputs)
GPU cluster (one H100; dense = torch SDPA on CUDA):
    srun -N1 --gpus=1 python tools/bench_attention.py --seq-len 65536 --heads 16 \\
        --head-dim 128 --block-size 128 --topk 32 --backend cuda --dtype bf16 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"bench_attention.py: error: {message}\n")
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens in the packed batch (required without --qk)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: heads)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--backend", default="cpu", help="auto, reference, cpu, triton, cuda, flex, fa4")
    p.add_argument("--dense-backends", default="auto",
                   help="dense kernels to time, comma list from flash,cudnn,efficient,math (SDPA "
                        "per document) and fa4 (FlashAttention-4 varlen, one call); the fastest is "
                        "the baseline; auto: flash,cudnn (+fa4 when installed) on CUDA, torch's "
                        "own choice on the CPU")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--threads", type=int, default=None, help="default: $OMP_NUM_THREADS or 2")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (medians reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--doc-mix", default=None, metavar="LENGTHS_JSON",
                   help="pack documents with lengths resampled from this JSON list")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=("topk", "threshold"), default="topk",
                   help="threshold: --topk is the cap; per-head and per-block counts both timed")
    p.add_argument("--threshold", type=float, default=0.9, metavar="TAU",
                   help="threshold routing's share of the gate softmax, 0 < TAU <= 1")
    p.add_argument("--topk-min", type=int, default=0, help="threshold routing's least count")
    p.add_argument("--inputs", choices=("randn", "blocks"), default="randn",
                   help="synthetic q/k: randn, or blocks (a shared direction per block, heads "
                        "from peaked to flat)")
    p.add_argument("--qk", default=None, metavar="FILE",
                   help="q/k from a torch .pt dict (q [T, H, D], k [T, Hkv, D], optional v, cu_seqlens)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline")
    p.add_argument("--json", action="store_true", help="print only the JSON object")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    a = p.parse_args(argv)
    a.qk_data = None if a.qk is None else _read_qk(a.qk, p)
    if a.qk_data is not None:
        T, a.heads, a.head_dim = a.qk_data["q"].shape
        a.kv_heads = a.qk_data["k"].shape[1]
        if a.seq_len is not None and a.seq_len > T:
            p.error(f"--seq-len {a.seq_len} is more than the {T} tokens of --qk {a.qk}")
        a.seq_len = a.seq_len or T
    if a.seq_len is None:
        p.error("--seq-len is required (or give --qk)")
    if not 0.0 < a.threshold <= 1.0 or a.topk_min < 0:
        p.error("--threshold must be in (0, 1] and --topk-min >= 0")
    for name in ("seq_len", "heads", "head_dim", "block_size", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.topk < 0 or a.warmup < 0:
        p.error("--topk and --warmup must be >= 0")
    a.kv_heads = a.kv_heads or a.heads
    if a.heads % a.kv_heads:
        p.error("--kv-heads must divide --heads")
    if a.doc_mix is not None and not os.path.isfile(a.doc_mix):
        p.error(f"--doc-mix file not found: {a.doc_mix}")
    a.doc_pool = None if a.doc_mix is None else _read_doc_mix(a.doc_mix, p)
    a.dense_backends = [x for x in a.dense_backends.split(",") if x]
    if a.dense_backends != ["auto"] and (not a.dense_backends
                                        or set(a.dense_backends) - set(_SDPA_NAMES)):
        p.error(f"--dense-backends must be auto or a comma list from {','.join(_SDPA_NAMES)}")
    env_threads = os.environ.get("OMP_NUM_THREADS", "2")
    a.threads = a.threads or (int(env_threads) if env_threads.isdigit() else 2)
    return a


_SDPA_NAMES = ("flash", "cudnn", "efficient", "math", "fa4")


def dense_kernels(names, on_cuda: bool) -> dict:
    """name -> context manager factory restricting SDPA to that kernel (None: torch's choice)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if names == ["auto"]:
        from sparsebalance.ops.fa4 import HAS_FA4

        names = (["flash", "cudnn"] + (["fa4"] if HAS_FA4 else [])) if on_cuda else []
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    if not names:
        return {"sdpa": contextlib.nullcontext}
    # fa4 is not an SDPA kernel: causal_varlen_attention calls it directly (see dense_run)
    return {n: (contextlib.nullcontext if n == "fa4" else (lambda b=kinds[n]: sdpa_kernel([b])))
            for n in names}


def _read_doc_mix(path: str, p: argparse.ArgumentParser) -> list[int]:
    """The positive document lengths (tokens) of a JSON list; bad files are usage errors."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        p.error(f"--doc-mix {path}: not a JSON list of document lengths ({exc})")
    if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        p.error(f"--doc-mix {path}: expected a JSON list of integer document lengths")
    pool = [x for x in data if x > 0]
    if not pool:
        p.error(f"--doc-mix {path}: no positive document length")
    return pool


def _read_qk(path: str, p: argparse.ArgumentParser) -> dict:
    """The ``--qk`` file's tensors (checked: q [T, H, D], k [T, Hkv, D] with H % Hkv == 0,
    v like k when present, cu_seqlens rising from 0 to T when present)."""
    import pickle

    import torch

    if not os.path.isfile(path):
        p.error(f"--qk file not found: {path}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        p.error(f"--qk {path}: not a torch .pt file of tensors ({first[:200]})")
    if not isinstance(data, dict) or not all(isinstance(data.get(n), torch.Tensor) for n in ("q", "k")):
        p.error(f"--qk {path}: expected a dict with tensors 'q' [T, H, D] and 'k' [T, Hkv, D]")
    q, k = data["q"], data["k"]
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] \
            or k.shape[1] < 1 or q.shape[1] % k.shape[1]:
        p.error(f"--qk {path}: q {tuple(q.shape)} and k {tuple(k.shape)} are not [T, H, D] and [T, Hkv, D]")
    v = data.get("v")
    if v is not None and (not isinstance(v, torch.Tensor) or v.shape != k.shape):
        p.error(f"--qk {path}: v must be shaped like k {tuple(k.shape)}")
    cu = data.get("cu_seqlens")
    if cu is not None:
        cu = torch.as_tensor(cu).to(torch.int64).reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((cu[1:] < cu[:-1]).any()):
            p.error(f"--qk {path}: cu_seqlens must rise from 0 to T={q.shape[0]}")
    return {"q": q, "k": k, "v": v, "cu_seqlens": cu}


def qk_lengths(cu, seq_len: int) -> list[int]:
    """Document lengths of a ``--qk`` file's ``cu_seqlens`` (None: one document), cut to the
    first ``seq_len`` tokens."""
    if cu is None:
        return [seq_len]
    ends = [min(int(e), seq_len) for e in cu[1:].tolist()]
    return [e - s for s, e in zip([0] + ends[:-1], ends) if e > s]


def block_inputs(q, k, lens: list, block_size: int, g):
    """``--inputs blocks``: q, k plus a random direction per block (of its document), seen by
    the query heads at strengths from 4 (head 0: peaked gates) down to 0.5 (flat). At 16K
    tokens, block 64, TAU 0.9, cap 64, per-head counts then keep ~0.55x the pairs of
    per-block ones (SmolLM2 at 4K, issue 49: 0.245 / 0.51 = 0.48x)."""
    import torch

    blk = torch.cat([torch.arange(L) // block_size + i * 10 ** 7 for i, L in enumerate(lens)])
    _, blk = torch.unique(blk, return_inverse=True)
    n, D, H = int(blk.max()) + 1, q.shape[2], q.shape[1]
    strength = torch.linspace(4.0, 0.5, H).view(1, H, 1)
    return (q + torch.randn(n, 1, D, generator=g)[blk] * strength,
            k + torch.randn(n, k.shape[1], D, generator=g)[blk])


def doc_lengths(a: argparse.Namespace) -> list[int]:
    """One document of seq_len, or resampled lengths packed to exactly seq_len (``--qk``:
    its documents)."""
    if a.qk_data is not None and a.doc_pool is None:
        return qk_lengths(a.qk_data["cu_seqlens"], a.seq_len)
    if a.doc_pool is None:
        return [a.seq_len]
    import numpy as np

    pool = np.asarray(a.doc_pool, dtype=np.int64)
    rng = np.random.default_rng(a.seed)
    lens, room = [], a.seq_len
    while room > 0:  # the last document is cut to fill the batch exactly
        n = int(min(rng.choice(pool), room))
        lens.append(n)
        room -= n
    return lens


def fa4_gate_parts(q, k, cu, topk, block_size: int, scale: float, timed):
    """ms of the fa4 gate's parts, each alone: ``(plan, layout, descriptors, skeleton)``.
    plan and descriptors run in every layer (the plan's skeleton cached); the skeleton
    (host metadata and its upload) and the layout once per micro-batch."""
    from sparsebalance.ops import build_plan
    from sparsebalance.ops.fa4 import fa4_descriptors
    from sparsebalance.ops.flex import flex_layout
    from sparsebalance.ops.plan import _build_skeleton, fused_route, host_cu

    plan, t_plan = timed(lambda: build_plan(q, k, cu, topk, block_size, scale))
    _, t_lay = timed(lambda: flex_layout(cu, block_size, q.device, bucket=False))
    _, t_desc = timed(lambda: fa4_descriptors(plan))
    _, t_skel = timed(lambda: _build_skeleton(host_cu(cu), topk, block_size, q.shape[1], q.device,
                                              host_route=not fused_route(q.device)))
    return t_plan, t_lay, t_desc, t_skel


def flex_gate_parts(q, k, cu, topk, block_size: int, scale: float, compiled: bool, timed):
    """ms of the flex gate's three parts, each alone: ``(plan, layout, block_mask)``;
    ``timed(fn) -> (result, ms)`` synchronises the device around ``fn``."""
    from sparsebalance.ops import build_plan
    from sparsebalance.ops.flex import flex_block_mask, flex_layout

    plan, t_plan = timed(lambda: build_plan(q, k, cu, topk, block_size, scale))
    lay, t_lay = timed(lambda: flex_layout(cu, block_size, q.device, reuse=compiled))
    _, t_mask = timed(lambda: flex_block_mask(plan, lay, exact_mask_mod=not compiled))
    return t_plan, t_lay, t_mask


def _nan_to_none(x):
    """``x`` with every NaN float (in dicts and lists) replaced by None: strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    import warnings

    import torch

    # megatron-core (imported by the dense baseline) warns about absent TE/Apex on CPU
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from sparsebalance.attention.dense import causal_varlen_attention
    from sparsebalance.ops import build_plan, resolve_backend, sparse_attention
    from sparsebalance.ops.plan import fused_route
    from sparsebalance.pairs import density as exact_density

    torch.set_num_threads(a.threads)
    gpu_names = ("cuda", "triton", "flex", "fa4") if torch.cuda.is_available() else ("cuda", "triton", "fa4")
    dev = torch.device("cuda" if a.backend in gpu_names else "cpu")
    if a.backend == "flex" and dev.type == "cpu":
        sys.stderr.write("bench_attention.py: error: flex has no CPU backward (FlexAttention); "
                         "bench it on CUDA\n")
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    try:
        backend = resolve_backend(a.backend, dev, a.head_dim, a.block_size, dtype)
    except ValueError as exc:
        sys.stderr.write(f"bench_attention.py: error: {exc}\n")
        return 2
    lens = doc_lengths(a)
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    g = torch.Generator().manual_seed(a.seed)
    mk = lambda h: torch.randn(a.seq_len, h, a.head_dim, generator=g)
    q, k, v = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads)
    if a.qk_data is not None:
        q, k = a.qk_data["q"][:a.seq_len].float(), a.qk_data["k"][:a.seq_len].float()
        v = v if a.qk_data["v"] is None else a.qk_data["v"][:a.seq_len].float()
    elif a.inputs == "blocks":
        q, k = block_inputs(q, k, lens, a.block_size, g)
    q, k, v = (t.to(dev, dtype).contiguous().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, generator=g).to(dev, dtype)
    from sparsebalance.ops.plan import RoutingRule, routing_rule

    threshold = a.routing == "threshold"
    rules = {"per-head": RoutingRule(a.threshold, a.topk_min, per_head=True),
             "per-block": RoutingRule(a.threshold, a.topk_min, per_head=False)} if threshold else {}
    scale = a.head_dim ** -0.5
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        return out, (time.perf_counter() - t0) * 1e3

    def dense_run(ctx, name):
        kernel = "fa4" if name == "fa4" else "sdpa"

        def run_dense():
            with ctx():
                out, f = timed(lambda: causal_varlen_attention(q, k, v, cu, scale, backend=kernel))
            _, b = timed(lambda: torch.autograd.grad(out, (q, k, v), dout))
            return f, f + b

        return run_dense

    def sparse_run(rule=None):
        kw = {} if rule is None else dict(threshold=rule.threshold, topk_min=rule.topk_min, per_head=rule.per_head)

        def run():
            cpu0 = time.process_time()
            (out, dens), f = timed(lambda: sparse_attention(
                q, k, v, cu, topk=a.topk, block_size=a.block_size, backend=backend, return_density=True, **kw))
            _, b = timed(lambda: torch.autograd.grad(out, (q, k, v), dout))
            run.density = dens
            run.cpu_ms.append((time.process_time() - cpu0) * 1e3)
            return f, f + b

        run.cpu_ms = []  # process CPU time of each call (warm-up included; medians reported)

        return run

    run_sparse = sparse_run(rules.get("per-head"))

    if backend == "flex":  # routing + what FlexAttention needs before its kernel
        from sparsebalance.ops.flex import flex_prepare, padding_ratio, use_compiled

        route = lambda: flex_prepare(q, k, cu, a.topk, a.block_size, scale, use_compiled(dev))
    elif backend == "fa4":
        from sparsebalance.ops.fa4 import fa4_prepare

        route = lambda: fa4_prepare(q, k, cu, a.topk, a.block_size, scale)
    else:
        route = lambda: build_plan(q, k, cu, a.topk, a.block_size, scale)

    def run_gate():
        with routing_rule(rules.get("per-head")):
            _, t = timed(route)
        return t, t

    def run_gate_torch():  # the same gate by torch ops: what the fused route saves
        before = os.environ.get("SPARSEBALANCE_ROUTE")
        os.environ["SPARSEBALANCE_ROUTE"] = "torch"
        try:
            return run_gate()
        finally:
            if before is None:
                del os.environ["SPARSEBALANCE_ROUTE"]
            else:
                os.environ["SPARSEBALANCE_ROUTE"] = before

    runs = {"sparse": run_sparse, "gate": run_gate}
    if threshold:  # the same attention with one count per query block, timed alongside
        runs["sparse:per-block"] = sparse_run(rules["per-block"])
    if fused_route(dev):
        runs["gate_torch"] = run_gate_torch
    if backend == "flex":  # where the gate's time goes: routing plan, buffer layout, block mask
        runs["gate_parts"] = lambda: flex_gate_parts(q, k, cu, a.topk, a.block_size, scale,
                                                     use_compiled(dev), timed)
    elif backend == "fa4":  # routing plan, buffer layout, FA4's descriptors
        runs["gate_parts"] = lambda: fa4_gate_parts(q, k, cu, a.topk, a.block_size, scale, timed)
    fa4_padding = 1.0
    if backend == "fa4":  # rows of the block-aligned buffer (no bucket) / tokens
        lb = [-(-L // a.block_size) for L in lens]
        fa4_padding = sum(lb) * a.block_size / a.seq_len
    dense_failed = {}
    for name, ctx in ({} if a.no_dense else dense_kernels(a.dense_backends, dev.type == "cuda")).items():
        try:  # a kernel this GPU / shape / dtype does not support is left out, and said so
            dense_run(ctx, name)()
            runs["dense:" + name] = dense_run(ctx, name)
        except (RuntimeError, ValueError) as exc:
            dense_failed[name] = str(exc).splitlines()[0][:200] if str(exc) else "RuntimeError"
    if not a.no_dense and not any(n.startswith("dense:") for n in runs):
        sys.stderr.write(f"bench_attention.py: error: no dense kernel ran: {dense_failed}\n")
        return 2
    for _ in range(a.warmup):
        for fn in runs.values():
            fn()
    times = {n: [] for n in runs}
    for _ in range(a.reps):  # interleaved so that load changes hit both sides
        for n, fn in runs.items():
            times[n].append(fn())
    med = lambda n, i: statistics.median(t[i] for t in times[n])
    dense_names = [n for n in runs if n.startswith("dense:")]
    best = min(dense_names, key=lambda n: med(n, 1)) if dense_names else None
    times["dense"] = times[best] if best else [(float("nan"),) * 2]
    dense_ms, sparse_ms, gate_ms = med("dense", 1), med("sparse", 1), med("gate", 1)
    speedup = dense_ms / sparse_ms
    causal = sum(L * (L + 1) // 2 for L in lens) * a.heads
    counts = None
    if threshold:  # kept pairs, ms and ms per million kept pairs of both count rules
        dens = {"per-head": run_sparse.density, "per-block": runs["sparse:per-block"].density}
        ms = {"per-head": sparse_ms, "per-block": med("sparse:per-block", 1)}
        cpu = {"per-head": run_sparse.cpu_ms[a.warmup:], "per-block": runs["sparse:per-block"].cpu_ms[a.warmup:]}
        fastest = {"per-head": min(t[1] for t in times["sparse"]),
                "per-block": min(t[1] for t in times["sparse:per-block"])}
        counts = {n: {"kept_pairs": round(dens[n] * causal), "density": round(dens[n], 5),
                      "sparse_ms": round(ms[n], 2), "ms_per_mpair": round(ms[n] / (dens[n] * causal) * 1e6, 4),
                      # the fastest repetition: less sensitive to other load on a shared machine
                      "sparse_ms_min": round(fastest[n], 2),
                      "ms_per_mpair_min": round(fastest[n] / (dens[n] * causal) * 1e6, 4),
                      # CPU time of the process (all threads): the work, whatever else runs
                      # on the machine (on the CPU backend; spinning OpenMP threads count)
                      "cpu_ms": round(statistics.median(cpu[n]), 2),
                      "cpu_ms_per_mpair": round(statistics.median(cpu[n]) / (dens[n] * causal) * 1e6, 4)}
                  for n in rules}
    res = {
        "backend": backend, "dtype": a.dtype, "threads": a.threads, "reps": a.reps,
        "seq_len": a.seq_len, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
        "block_size": a.block_size, "topk": a.topk, "n_docs": len(lens),
        "doc_mix": a.doc_mix, "max_doc_len": max(lens),
        "routing": a.routing, "threshold": a.threshold if threshold else None,
        "topk_min": a.topk_min if threshold else None,
        "inputs": a.qk if a.qk else a.inputs,
        "dense_backend": best.split(":", 1)[1] if best else None,
        "dense_ms_by_backend": {n.split(":", 1)[1]: [round(med(n, 0), 2), round(med(n, 1), 2)]
                                for n in dense_names},
        "dense_failed": dense_failed,
        "padding_ratio": round(padding_ratio(cu, a.block_size), 4) if backend == "flex"
        else round(fa4_padding, 4) if backend == "fa4" else 1.0,
        "dense_ms": round(dense_ms, 2), "sparse_ms": round(sparse_ms, 2),
        "dense_fwd_ms": round(med("dense", 0), 2), "sparse_fwd_ms": round(med("sparse", 0), 2),
        "density": round(run_sparse.density, 5),
        # top-k routing's density (under threshold routing: of the caps)
        "density_exact": round(exact_density(lens, a.topk, a.block_size), 5),
        "counts": counts,
        "per_head_over_per_block": {
            k: round(counts["per-head"][k] / counts["per-block"][k], 4)
            for k in ("kept_pairs", "sparse_ms", "ms_per_mpair", "ms_per_mpair_min", "cpu_ms_per_mpair")}
        if counts else None,
        "sparse_ms_all_per_block": [round(t[1], 1) for t in times["sparse:per-block"]] if counts else None,
        "speedup": round(speedup, 3), "efficiency": round(speedup * run_sparse.density, 3),
        "gate_ms": round(gate_ms, 2), "gate_share": round(gate_ms / sparse_ms, 4),
        # routing by the three Triton kernels (fused) or torch ops; fused: the torch gate too
        "route": "fused" if fused_route(dev) else "torch",
        "gate_torch_ms": round(med("gate_torch", 1), 2) if "gate_torch" in times else None,
        # flex: the gate's parts, each timed alone (the layout is built once per micro-batch
        # in training, where every layer reuses it; the plan and the mask once per layer)
        "gate_parts_ms": {n: round(statistics.median(t[i] for t in times["gate_parts"]), 2)
                          for i, n in enumerate(("plan", "layout", "descriptors", "skeleton") if backend == "fa4"
                                                else ("plan", "layout", "block_mask"))}
        if "gate_parts" in times else None,
        # best-of-reps view: less sensitive to other load on a shared machine
        "speedup_min": round(min(t[1] for t in times["dense"]) / min(t[1] for t in times["sparse"]), 3),
        "sparse_ms_all": [round(t[1], 1) for t in times["sparse"]],
        "dense_ms_all": [round(t[1], 1) for t in times["dense"]],
    }
    text = json.dumps(_nan_to_none(res))  # --no-dense: the dense figures are null
    if a.out:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(a.out, text + "\n")
    if not a.json:
        print(f"# OMP_NUM_THREADS={a.threads} backend={backend} docs={len(lens)}", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
