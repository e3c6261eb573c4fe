"""Time the collectives megatron-core's sequence parallelism calls, as the backend runs them,
against the emulations a bridge would use (why ``megatron/training/cpu_bridge.py`` bridges
none of them on gloo).

Per size (fp32 elements per rank): ``reduce_scatter_tensor`` (after the row-parallel
linears) and ``all_gather_into_tensor`` (before the column-parallel ones), each against an
emulation from older collectives (all-reduce + narrow; all-gather into a list + cat), and
``all_reduce`` of the same input for scale. Medians of ``--reps`` calls after a warm-up;
each emulation's result is checked against the real collective. Prints one JSON object.

CPU (gloo), 2 ranks:
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --standalone \\
        benchmarks/bench_sp_collectives.py
GPU node (NCCL), 8 ranks:
    torchrun --nproc-per-node 8 benchmarks/bench_sp_collectives.py --backend nccl --sizes 4194304,67108864
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.arguments import OneLineParser  # noqa: E402


def _ms(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    import torch
    import torch.distributed as dist

    p = OneLineParser(prog="benchmarks/bench_sp_collectives.py", description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    p.add_argument("--sizes", default="16384,262144,1048576", help="fp32 elements per rank, comma-separated")
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args()
    try:
        sizes = [int(s) for s in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        p.error(f"--sizes: positive integers separated by commas, got {a.sizes!r}")
    if a.reps < 1:
        p.error("--reps must be >= 1")
    dist.init_process_group(a.backend)
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if a.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    rows = []
    for size in sizes:
        size -= size % n
        x = torch.randn(size, device=device)
        shard, full = torch.empty(size // n, device=device), torch.empty(size * n, device=device)
        parts = [torch.empty(size, device=device) for _ in range(n)]

        def rs_emulated():
            y = x.clone()
            dist.all_reduce(y)
            return y.narrow(0, rank * (size // n), size // n)

        def ag_emulated():
            dist.all_gather(parts, x)
            return torch.cat(parts)

        dist.reduce_scatter_tensor(shard, x)
        dist.all_gather_into_tensor(full, x)
        exact = bool(torch.allclose(rs_emulated(), shard, rtol=1e-5, atol=1e-5) and torch.equal(ag_emulated(), full))
        rows.append({
            "elements_per_rank": size, "mb_per_rank": size * 4 / 2**20, "emulations_match": exact,
            "reduce_scatter_tensor_ms": _ms(lambda: dist.reduce_scatter_tensor(shard, x), a.reps, sync),
            "all_reduce_narrow_ms": _ms(rs_emulated, a.reps, sync),
            "all_gather_into_tensor_ms": _ms(lambda: dist.all_gather_into_tensor(full, x), a.reps, sync),
            "all_gather_list_cat_ms": _ms(ag_emulated, a.reps, sync),
            "all_reduce_ms": _ms(lambda: dist.all_reduce(x.clone()), a.reps, sync),
        })
    if rank == 0:
        print(json.dumps({"backend": a.backend, "ranks": n, "torch": torch.__version__, "sizes": rows}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
