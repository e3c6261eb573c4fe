"""The distributed optimizer (``--use-distributed-optimizer``) over gloo, DP=2, fp32.

Training runs through pretrain_gpt.py's ``pretrain()`` (this file is the torchrun
worker, ``worker`` mode): with the optimizer state sharded over the two DP ranks,
per-step losses, grad norms and the final parameters equal the run without it
(1e-5 relative), dense and sparse (``--sparse-balance``: SAB packing and critical-path
DST budgets from the analytic cost model; the tests check that both runs planned the
same, varying budgets, so the comparison is neither vacuous nor luck), the sparse one
with ``--overlap-grad-reduce --overlap-param-gather``. A checkpoint written by a
distributed-optimizer run at step 2 resumes to the uninterrupted run's losses and
parameters. Each rank holds half of the optimizer state (Adam moments). (The overlap
flags ride on the sparse run to keep the file at four training runs plus a resume.)

Optimizer-state memory per rank at a bigger size is this file as a script::

    .venv/bin/python tests/training/test_distributed_optimizer.py memory

(two DP=2 runs of one step, with and without the flag; prints bytes of optimizer
state tensors per rank and the peak RSS of each rank).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS  # noqa: E402

STEPS = 4
FLAGS = [*PROJECT_RUN_FLAGS, "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--num-attention-heads", "4", "--seq-length", "512", "--global-batch-size", "4",
         "--lr", "1e-3", "--no-progress-bar", "--seed", "5", "--train-iters", str(STEPS)]
# as in test_recompute.py: documents longer than (4 + 2) x 32 tokens are sparse, so the
# DST budgets change the routing
SPARSE = ["--sparse-balance", "--sb-block-size", "32", "--sb-topk", "4", "--sb-cost-model", "h100-analytic"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = [*DISTOPT, "--overlap-grad-reduce", "--overlap-param-gather"]
RTOL = 1e-5

# ----------------------------------------------------------------------------- worker


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer-state tensors this rank holds: Adam's moments (and any
    other per-parameter state tensor) plus fp32 main-parameter copies where the
    optimizer keeps them apart from the model's weights (bf16 training; at fp32 the
    main params are the weights themselves and cost nothing extra)."""
    import torch

    total = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if torch.is_tensor(v) and v.dim() > 0)
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or []:
                total += sum(p.numel() * p.element_size() for p in group if p is not None)
    return total


def _worker(argv) -> None:
    """pretrain(argv); per rank ``$SB_TEST_DUMP/rank<r>.json`` (summary, per-step DST
    budget tables, optimizer-state bytes) and ``rank<r>.npz`` (final parameters by
    global name)."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import torch

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import shutdown
    from megatron.training.model import global_param_names
    from megatron.training.training import pretrain

    args = parse_args(argv)
    budgets, params, state_bytes = [], {}, []

    def on_step(iteration, state, result):
        budgets.append(None if result.budget is None else np.asarray(result.budget).tolist())
        state_bytes.append(optimizer_state_bytes(state.optimizer))
        if iteration == args.train_iters:
            for chunk in state.model:
                if chunk.ddp_config.overlap_param_gather:  # the gather is still pending
                    chunk.start_param_sync(force_sync=True)
                for name, p in global_param_names(chunk).items():
                    params[name] = p.detach().double().numpy().copy()

    summary = pretrain(args, on_step=on_step)
    rank, dump = torch.distributed.get_rank(), os.environ["SB_TEST_DUMP"]
    os.makedirs(dump, exist_ok=True)
    with open(os.path.join(dump, f"rank{rank}.json"), "w") as f:
        json.dump({"summary": summary, "budgets": budgets, "state_bytes": state_bytes,
                   "params": int(sum(v.size for v in params.values()))}, f)
    np.savez(os.path.join(dump, f"rank{rank}.npz"), **params)
    shutdown()


# ----------------------------------------------------------------------------- memory

MEMORY_MODEL = [*PROJECT_RUN_FLAGS, "--num-layers", "8", "--hidden-size", "512", "--ffn-hidden-size", "2048",
                "--num-attention-heads", "8", "--seq-length", "1024", "--global-batch-size", "2",
                "--train-iters", "1", "--lr", "1e-4", "--no-progress-bar", "--seed", "1"]


def _memory(argv) -> None:
    """DP=2, one step, with and without --use-distributed-optimizer: optimizer-state
    bytes and peak RSS per rank."""
    import argparse
    import tempfile

    sys.path.insert(0, HERE)
    from conftest import launch, make_test_corpus

    p = argparse.ArgumentParser(prog="test_distributed_optimizer.py memory")
    p.add_argument("--data-path", default=None, help="corpus prefix (default: a fresh one)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data_path or make_test_corpus(os.path.join(tmp, "c"), 200, 2048)
        out = {}
        for name, extra in (("adam", []), ("distributed", DISTOPT)):
            dump = os.path.join(tmp, name)
            proc = launch(os.path.abspath(__file__), ["worker", *MEMORY_MODEL, *extra, "--data-path", data],
                          nproc=2, timeout=600, extra_env={"SB_TEST_DUMP": dump})
            if proc.returncode:
                sys.exit(f"error: the {name} run failed: {proc.stderr.strip().splitlines()[-1]}")
            ranks = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
            out[name] = {"params": ranks[0]["params"],
                         "optimizer_state_bytes_per_rank": [r["state_bytes"][-1] for r in ranks],
                         "peak_rss_mb_per_rank": ranks[0]["summary"]["peak_memory_mb"]}
        out["ratio_per_rank"] = [a / b for a, b in zip(out["adam"]["optimizer_state_bytes_per_rank"],
                                                       out["distributed"]["optimizer_state_bytes_per_rank"])]
        print(json.dumps(out, indent=1))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in ("worker", "memory"):
    (_worker if sys.argv[1] == "worker" else _memory)(sys.argv[2:])
    sys.exit(0)

# ----------------------------------------------------------------------------- tests

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from conftest import make_test_corpus  # noqa: E402

RUNS = {
    "dense": [],
    "dense_distopt": DISTOPT,  # also saves at step 2 (see _run): the resume test's checkpoint
    "sparse": SPARSE,
    "sparse_distopt_overlap": [*SPARSE, *OVERLAP],
}
_RUNS: dict = {}


@pytest.fixture(scope="module")
def long_corpus(tmp_path_factory, world):
    """300 documents up to 1024 tokens (this module's own: its runs were tuned on it)."""
    return make_test_corpus(str(tmp_path_factory.mktemp("long") / "c"), 300, 1024, world)


def _run(name, corpus, tmp_path_factory, world, extra=()):
    if name not in _RUNS:
        root = tmp_path_factory.mktemp(name)
        dump = str(root / "dump")
        more = list(extra)
        if name == "dense_distopt":
            more += ["--save", str(root / "ckpt"), "--save-interval", "2"]
        proc = world.launch(os.path.abspath(__file__), ["worker", *FLAGS, *RUNS.get(name, []), *more,
                                                        "--data-path", corpus],
                            nproc=2, extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
        params = [dict(np.load(os.path.join(dump, f"rank{r}.npz"))) for r in range(2)]
        _RUNS[name] = {"ranks": ranks, "params": params, "summary": ranks[0]["summary"], "root": root}
    return _RUNS[name]


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-30))


def _assert_same_training(run, base, steps=slice(None)):
    s, b = run["summary"], base["summary"]
    assert _rel(s["losses"], b["losses"][steps]) <= RTOL, (s["losses"], b["losses"])
    assert _rel(s["grad_norms"], b["grad_norms"][steps]) <= RTOL, (s["grad_norms"], b["grad_norms"])
    for got, ref in zip(run["params"], base["params"]):
        assert sorted(got) == sorted(ref) and len(ref) > 20
        worst = max((_rel(got[k], ref[k]), k) for k in ref)
        assert worst[0] <= RTOL, worst


@pytest.mark.parametrize("name,base", [("dense_distopt", "dense"), ("sparse_distopt_overlap", "sparse")])
def test_distributed_optimizer_matches_adam(name, base, long_corpus, tmp_path_factory, world):
    ref = _run(base, long_corpus, tmp_path_factory, world)
    run = _run(name, long_corpus, tmp_path_factory, world)
    assert len(set(np.round(ref["summary"]["losses"], 4))) == STEPS, "training did not move"
    _assert_same_training(run, ref)
    # every DP rank ends with the whole, identical model (the shards were all-gathered)
    for k in run["params"][0]:
        np.testing.assert_array_equal(run["params"][0][k], run["params"][1][k])
    # same plans: DST budgets identical step by step (and really varying under SparseBalance)
    assert [r["budgets"] for r in run["ranks"]] == [r["budgets"] for r in ref["ranks"]]
    if name.startswith("sparse"):
        tables = [np.asarray(t) for t in ref["ranks"][0]["budgets"]]
        assert all(t is not None for t in ref["ranks"][0]["budgets"])
        assert any(len(np.unique(t)) > 1 for t in tables), "DST planned no budget changes"


def test_each_rank_holds_half_the_optimizer_state(long_corpus, tmp_path_factory, world):
    adam = _run("dense", long_corpus, tmp_path_factory, world)
    dist = _run("dense_distopt", long_corpus, tmp_path_factory, world)
    n = adam["ranks"][0]["params"]
    full = [r["state_bytes"][-1] for r in adam["ranks"]]
    shard = [r["state_bytes"][-1] for r in dist["ranks"]]
    assert full == [2 * 4 * n] * 2  # exp_avg + exp_avg_sq, fp32, every parameter
    assert sum(shard) == 2 * 4 * n  # the shards cover every parameter once
    assert all(abs(s / full[0] - 0.5) < 0.02 for s in shard), shard


def test_resume_from_a_distributed_optimizer_checkpoint(long_corpus, tmp_path_factory, world):
    full = _run("dense_distopt", long_corpus, tmp_path_factory, world)
    ckpt = os.path.join(full["root"], "ckpt")
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", f"iter_{STEPS:07d}", "latest_checkpointed_iteration.txt"]
    load = tmp_path_factory.mktemp("resume_from")
    shutil.copytree(os.path.join(ckpt, "iter_0000002"), load / "iter_0000002")
    (load / "latest_checkpointed_iteration.txt").write_text("2\n")
    resumed = _run("resume", long_corpus, tmp_path_factory, world,
                   extra=[*DISTOPT, "--load", str(load)])
    assert len(resumed["summary"]["losses"]) == STEPS - 2
    # steps 3 and 4: the second one depends on Adam's restored moments and step count
    _assert_same_training(resumed, full, steps=slice(2, None))
