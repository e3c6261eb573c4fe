"""One fa4 call on the GPU, forward and backward, against the reference: prints one JSON
line (errors, compile seconds, kernels compiled) or the traceback. gpu_lease.sh runs it
first so a broken FlashAttention-4 install or API change shows its whole error in the log.

    python3 benchmarks/harness/gpu/fa4_smoke.py [--heads 16 --kv-heads 2 --head-dim 128 --dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("fa4_smoke.py: error: needs a CUDA device", file=sys.stderr)
        return 2
    from sparsebalance.ops import fa4, sparse_attention

    if not fa4.fa4_importable():
        import flash_attn.cute  # noqa: F401  (raises: the traceback says what is missing)
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    lens = [1500, 1, 700, 2100]
    g = torch.Generator().manual_seed(0)
    mk = lambda h: torch.randn(sum(lens), h, a.head_dim, generator=g).to("cuda", dt)
    q, k, v, dout = mk(a.heads), mk(a.kv_heads), mk(a.kv_heads), mk(a.heads)
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    res = {}
    for name in ("fa4", "reference"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        t0, before = time.time(), fa4.compile_count()
        out, dens = sparse_attention(*xs, cu, topk=3, block_size=128, backend=name, return_density=True)
        grads = torch.autograd.grad(out, xs, dout)
        torch.cuda.synchronize()
        res[name] = {"out": out.float(), "grads": [x.float() for x in grads], "density": dens,
                     "s": round(time.time() - t0, 2), "compiled": fa4.compile_count() - before}
    f, r = res["fa4"], res["reference"]
    err = {"out": (f["out"] - r["out"]).abs().max().item()}
    for n, x, y in zip(("dq", "dk", "dv"), f["grads"], r["grads"]):
        err[n] = (x - y).abs().max().item()
    print(json.dumps({"shape": [a.heads, a.kv_heads, a.head_dim, a.dtype], "max_abs_err_vs_reference": err,
                      "density": [f["density"], r["density"]], "fa4_first_call_s": f["s"],
                      "fa4_kernels_compiled": f["compiled"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
