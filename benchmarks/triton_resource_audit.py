"""Registers, spills and shared memory of the Triton kernels per autotune config, without a GPU.

Compiles each kernel of sparsebalance/ops/triton_kernels.py for a CUDA arch on the CPU
(triton.compile with a GPUTarget) and reads ``ptxas -v``: registers per thread, spill
stores/loads and stack bytes, whether ptxas serialized the wgmma instructions for lack of
registers, the dynamic shared memory, and the CTAs per SM those allow (H100/H200 limits).
``kept`` says whether the autotuner's prune hook keeps the config. Prints a JSON list.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/triton_resource_audit.py --head-dim 128 --block-size 128

Compiling takes ~10 s a config on a slow core; triton's cache makes reruns faster.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KERNELS = ("fwd", "dq", "dkdv", "reduce")
_DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {s!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers: {s!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    from megatron.training.arguments import OneLineParser

    p = OneLineParser(prog="triton_resource_audit.py", description=__doc__.split("\n")[0])
    p.add_argument("--head-dim", type=_ints, default=[128, 64], help="comma list (default 128,64)")
    p.add_argument("--block-size", type=_ints, default=[128, 64], help="comma list (default 128,64)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list from {','.join(KERNELS)}")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (default 90)")
    p.add_argument("--jobs", type=int, default=1, help="compile processes (default 1)")
    a = p.parse_args(argv)
    a.kernels = [k for k in a.kernels.split(",") if k]
    if not a.kernels or set(a.kernels) - set(KERNELS):
        p.error(f"--kernels must be a comma list from {','.join(KERNELS)}")
    if a.arch < 80 or a.jobs < 1:
        p.error("--arch must be >= 80 and --jobs >= 1")
    return a


def signature(kernel: str, dtype: str = "bf16") -> dict:
    """Argument name -> triton type of one kernel (constexprs excluded)."""
    ptr = _DTYPES[dtype]
    p = lambda names: {n: ptr for n in names.split()}
    t = lambda names, ty: {n: ty for n in names.split()}
    strides = "s_qt s_qh s_kt s_kh"
    if kernel == "fwd":
        return {**p("Q K V Out"), "LSE": "*fp32", **t("QB_START QB_LEN KV_IDX KV_CNT", "*i32"),
                "qk_scale": "fp32", **t(f"{strides} T NB W REP D", "i32")}
    if kernel == "dq":
        return {**p("Q K V DO DQ"), **t("LSE DELTA", "*fp32"), **t("QB_START QB_LEN KV_IDX KV_CNT", "*i32"),
                **t("qk_scale sm_scale", "fp32"), **t(f"{strides} T NB W REP D", "i32")}
    if kernel == "dkdv":
        return {**p("Q K V DO DK DV"), **t("WS_DK WS_DV LSE DELTA", "*fp32"),
                **t("QB_START QB_LEN ITEM_SEG ITEM_LO ITEM_HI ITEM_SLOT VISITS", "*i32"),
                **t("qk_scale sm_scale", "fp32"), **t(f"{strides} T NB REP D", "i32")}
    return {**p("DK DV"), **t("WS_DK WS_DV", "*fp32"), **t("QB_START QB_LEN RED_SEG RED_FIRST RED_N", "*i32"),
            "sm_scale": "fp32", **t("s_kt s_kh NB D", "i32")}


def _ptxas_info(log: str) -> dict:
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0
    return {"regs": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}


def audit_one(kernel: str, block: int, head_dim: int, dtype: str = "bf16", split: int = 1,
              num_warps: int = 4, num_stages: int = 3, arch: int = 90) -> dict:
    """Compile one kernel/config for ``arch`` and return its resource row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import compiler as nv
    from triton.compiler import ASTSource

    from sparsebalance.ops import triton_kernels as tk

    BLOCK, BLOCK_D = max(16, triton.next_power_of_2(block)), max(16, triton.next_power_of_2(head_dim))
    ce = {"BLOCK": BLOCK, "BLOCK_D": BLOCK_D}
    if kernel != "reduce":
        ce.update(F32=dtype == "fp32", SPLIT=split)
    fn = {"fwd": tk._fwd_kernel, "dq": tk._bwd_dq_kernel, "dkdv": tk._bwd_dkdv_kernel,
          "reduce": tk._reduce_kernel}[kernel]
    fn = fn if isinstance(fn, triton.runtime.JITFunction) else fn.fn  # unwrap the autotuner
    sig = signature(kernel, dtype)
    # A launch marks 16-aligned pointers and ints divisible by 16 (tt.divisibility): torch's
    # buffers, and the strides and D when head_dim % 16 == 0. Without it every load is 2 bytes
    # wide and unpipelined, which is not what runs.
    aligned = [n for n, ty in sig.items()
               if ty.startswith("*") or (head_dim % 16 == 0 and n in ("s_qt", "s_qh", "s_kt", "s_kh", "D"))]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in ce}}, constexprs=ce, attrs=attrs)
    buf = io.StringIO()
    old, triton.knobs.nvidia.dump_ptxas_log = triton.knobs.nvidia.dump_ptxas_log, True
    try:  # ptxas -v's log is printed when the cubin is built, i.e. not on a cache hit
        with contextlib.redirect_stdout(buf):
            out = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                 options={"num_warps": num_warps, "num_stages": num_stages})
    finally:
        triton.knobs.nvidia.dump_ptxas_log = old
    log = buf.getvalue()
    if "Function properties" not in log:  # cache hit: run ptxas -v on the cached PTX
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        with tempfile.TemporaryDirectory() as d:
            ptx = os.path.join(d, "k.ptx")
            with open(ptx, "w") as f:
                f.write(out.asm["ptx"])
            r = subprocess.run([nv.get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm}",
                                ptx, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        log = r.stdout + r.stderr
    row = {"kernel": kernel, "block": block, "head_dim": head_dim, "dtype": dtype,
           "split": split if kernel != "reduce" else None, "num_warps": num_warps, "num_stages": num_stages,
           **_ptxas_info(log), "smem": out.metadata.shared}
    threads = 32 * num_warps
    regs = -(-max(row["regs"], 1) // 8) * 8  # allocated in units of 8 per thread
    row["ctas_per_sm"] = min(65536 // (regs * threads), 2048 // threads, 32,
                             (228 * 1024) // (row["smem"] + 1024))  # Hopper: 228 KB, 1 KB per CTA
    return row


def _jobs(a: argparse.Namespace) -> list[tuple]:
    from sparsebalance.ops import triton_kernels as tk
    from sparsebalance.ops.triton_backend import _RED_WARPS

    jobs = []
    for d in a.head_dim:
        for b in a.block_size:
            for k in a.kernels:
                if k == "reduce":  # not autotuned: the launcher's warps
                    jobs.append((k, b, d, a.dtype, 1, _RED_WARPS, 3, a.arch))
                    continue
                for sp, w, s in tk.GPU_CONFIGS:
                    if max(16, b) // sp >= 16:  # the prune hook's tl.dot minimum
                        jobs.append((k, b, d, a.dtype, sp, w, s, a.arch))
    return jobs


def _kept(row: dict) -> bool:
    """Whether the autotuner's prune hook keeps this row's config."""
    import triton

    from sparsebalance.ops import triton_kernels as tk

    if row["kernel"] == "reduce":
        return True
    BLOCK, BLOCK_D = max(16, triton.next_power_of_2(row["block"])), max(16, triton.next_power_of_2(row["head_dim"]))
    configs = [triton.Config({"SPLIT": sp}, num_warps=w, num_stages=s) for sp, w, s in tk.GPU_CONFIGS]
    kept = tk._prune(configs, {}, BLOCK=BLOCK, BLOCK_D=BLOCK_D, F32=row["dtype"] == "fp32")
    return (row["split"], row["num_warps"], row["num_stages"]) in {
        (c.kwargs["SPLIT"], c.num_warps, c.num_stages) for c in kept}


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # the interpreter does not compile
    jobs = _jobs(a)
    if a.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(audit_one, *zip(*jobs)))
    else:
        rows = [audit_one(*j) for j in jobs]
    for r in rows:
        r["kept"] = _kept(r)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
