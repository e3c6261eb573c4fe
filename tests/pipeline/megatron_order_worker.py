"""Worker: run megatron-core's real pipeline schedule on CPU/gloo and record op order.

    OMP_NUM_THREADS=1 python tests/pipeline/megatron_order_worker.py --pp 2 \
        --runs 1:4,2:4 --out /tmp/order.json

``--runs`` lists ``vpp:microbatches`` configurations, run one after the other in
the same gloo process group (ranks are forked after megatron is imported once).

Each pipeline rank runs a tiny model chunk per virtual stage. The chunk records
("F", microbatch, chunk) when megatron's forward step runs it, with the micro-batch
id megatron itself sets (``layer.current_microbatch``), and ("B", microbatch,
chunk) from an autograd hook on its output when megatron's backward step reaches
it. The data iterators are the driver's (``megatron.training.data.StepBatches.iterators``)
with a known plan; each forward also records the budget and micro-batch id its batch
carried. Rank 0 writes ``[{rank: {"order": [...], "budgets": [...]}} per run]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, SEQ = 4, 3


def plan_budget(dp: int, microbatches: int, stages: int) -> list:
    """A plan whose every entry is distinct: 100 * microbatch + stage + 1."""
    return [[[100 * m + s + 1 for s in range(stages)] for m in range(microbatches)]
            for _ in range(dp)]


class _Tag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, key):
        ctx.log, ctx.key = log, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(["B", *ctx.key])
        return g, None, None


def _worker(rank: int, world: int, runs: list, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = [_run(rank, world, vpp, M) for vpp, M in runs]
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


def _run(rank: int, world: int, vpp: int, M: int) -> dict:
    from types import SimpleNamespace

    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from megatron.training.data import StepBatches
    from sparsebalance.balancer import PlannedStep

    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    cfg = TransformerConfig(num_layers=world * vpp, hidden_size=HIDDEN, num_attention_heads=1,
                            pipeline_model_parallel_size=world,
                            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                            pipeline_dtype=torch.float32, use_cpu_initialization=True)
    log: list = []
    budgets: list = []

    class Layer(torch.nn.Module):
        current_microbatch = None

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    class Chunk(torch.nn.Module):
        def __init__(self, chunk: int):
            super().__init__()
            self.config, self.model_type, self.chunk = cfg, ModelType.encoder_or_decoder, chunk
            self.decoder = Decoder()
            self.lin = torch.nn.Linear(HIDDEN, HIDDEN)
            self.inp = None

        def set_input_tensor(self, t):
            self.inp = t[0] if isinstance(t, list) else t

        def forward(self, x, microbatch, budget):
            m = self.decoder.layers[0].current_microbatch
            log.append(["F", m, self.chunk])
            budgets.append([m, self.chunk, microbatch, budget])
            h = x if self.inp is None else self.inp
            return _Tag.apply(torch.tanh(self.lin(h)), log, (m, self.chunk))

    torch.manual_seed(0)
    model = [Chunk(c) for c in range(vpp)]

    data = [{"x": torch.randn(SEQ, 1, HIDDEN), "id": m} for m in range(M)]

    def forward_step(it, chunk):
        batch = next(it)
        assert batch["microbatch"] == batch["id"]  # the iterator's index is the pull order
        out = chunk(batch["x"], batch["microbatch"], batch["budget"])
        return out, lambda o: (o.float().pow(2).mean(), {"loss": o.detach().pow(2).mean()})

    plan = plan_budget(1, M, world * vpp)
    planned = PlannedStep(None, [], forecast=SimpleNamespace(budget=np.asarray(plan)))
    batches = StepBatches(microbatches=data, global_tokens=0, global_docs=M, planned=planned, dp_rank=0,
                          pp_rank=rank, pp=world)
    iters = batches.iterators(vpp)
    get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters if vpp > 1 else iters[0],
        model=model if vpp > 1 else model[0], num_microbatches=M, seq_length=SEQ,
        micro_batch_size=1, forward_only=False)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"order": log, "budgets": budgets})
    parallel_state.destroy_model_parallel()
    return {str(r): g for r, g in enumerate(gathered)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--runs", required=True, help="comma list of vpp:microbatches")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs = [tuple(int(x) for x in r.split(":")) for r in a.runs.split(",")]
    sys.path.insert(0, ROOT)
    # Import and patch once in the parent; the forked ranks inherit it.
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.transformer  # noqa: F401

    from megatron.training.cpu_bridge import install_cpu_bridge
    install_cpu_bridge(force_cpu=True)
    fd, store = tempfile.mkstemp(prefix="gloo-")
    os.close(fd)
    os.unlink(store)
    mp.start_processes(_worker, args=(a.pp, runs, f"file://{store}", a.out), nprocs=a.pp,
                       join=True, start_method="fork")


if __name__ == "__main__":
    main()
