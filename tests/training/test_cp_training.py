"""Context parallelism (--context-parallel-size 2) and sequence parallelism
(--tensor-model-parallel-size 2 --sequence-parallel) equal their references, through
pretrain() over gloo.

Each pair of runs starts from the same seed and layout (CP does not change which
layers a rank builds, so initial weights agree) and trains 2 steps on the same
packed data: losses, grad norms and last-step gradients must agree within 1e-5
relative, every CP rank must hold the same (all-reduced) gradients, and with sparse
attention the kept-pair count (routing) must be identical.

Sparse case: --sparse-balance (SAB packing + DST budgets, anchor policy) with the
analytic cost model. Two things would make the runs plan differently, so the test
fixes them: (1) under CP the predictor answers per-rank times of the CP group (K/V
exchange included), so the CP=2 run builds its predictor as for CP=1
(``SB_TEST_PREDICT_AS_CP1``, tests/training/_harness.py): this test checks that CP
executes a given packing and budget table exactly, not the CP cost model; (2) DST
budgets depend on measured op times once the predictor's online correction has seen
a step; with planning ahead (the default) both steps of a 2-step run are planned
before any measurement arrives. The budget tables are asserted equal and not all
equal to --sb-topk.
The sparse CP=2 run also recomputes every layer (--recompute-granularity full).
PP=2 x CP=2 (4 ranks) against PP=2 (2 ranks), dense attention.

Sequence parallelism, sparse attention with DST budgets, 3 steps on the corpus's packed
documents of odd lengths: TP=2 + SP x PP=2 (4 ranks) against PP=2 (2 ranks; odd
micro-batches, so padding is exercised, and the SP-aware cost model plans the same
budgets), and TP=2 + SP x CP=2 (4 ranks, full recompute) against CP=1 (1 rank, 3 steps; planned as
for CP=1 like the CP run). Each rank dumps whole (TP-gathered) gradients (_harness.py).

--mock-data with CP=2 x PP=2 x DP=2 (8 ranks) against PP=2 x DP=2 (4 ranks): every rank
writes its own copy of the mock documents, which must be the same samples everywhere
(a CP pair splitting different samples, or DP ranks drawing from different datasets,
would change the losses); the run used to deadlock under CP.
"""

import glob
import json
import os

import numpy as np
import pytest
from conftest import HARNESS, TINY

STEPS = 2
SP_STEPS = 3
# DST's anchor policy with a wide band: at PP=1 the critical-path policy has no
# pipeline slack to trade and leaves every budget at --sb-topk (a vacuous check)
SPARSE = ["--sparse-balance", "--sb-cost-model", "h100-analytic", "--sb-block-size", "16",
          "--sb-topk", "4", "--sb-dst", "anchor", "--sb-p", "0.5"]
PP2 = ["--pipeline-model-parallel-size", "2"]
CP2 = ["--context-parallel-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
# Full recompute re-runs the K/V all-gather and the routing in backward; it is bitwise
# neutral without CP (tests/training/test_recompute.py), so the CP run carries it too.
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
AS_CP1 = {"SB_TEST_PREDICT_AS_CP1": "1"}
RUNS = {  # name: (ranks, flags, environment, steps)
    "sparse_cp1": (1, SPARSE, {}, STEPS),
    "sparse_cp2": (2, SPARSE + CP2 + RECOMPUTE, AS_CP1, STEPS),
    "pp2_cp1": (2, PP2, {}, STEPS),
    "pp2_cp2": (4, PP2 + CP2, {}, STEPS),
    "sparse_pp2": (2, SPARSE + PP2, {}, SP_STEPS),
    "sparse_pp2_tp2_sp": (4, SPARSE + PP2 + TP2_SP, {}, SP_STEPS),
    "sparse_sp_ref": (1, SPARSE, {}, SP_STEPS),
    "sparse_cp2_tp2_sp": (4, SPARSE + CP2 + TP2_SP + RECOMPUTE, AS_CP1, SP_STEPS),
}
SPARSE_PAIRS = [("sparse_cp2", "sparse_cp1"), ("sparse_pp2_tp2_sp", "sparse_pp2"),
                ("sparse_cp2_tp2_sp", "sparse_sp_ref")]
PAIRS = [*SPARSE_PAIRS, ("pp2_cp2", "pp2_cp1")]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory, world):
    root = tmp_path_factory.mktemp("context_parallel")
    out = {}
    for name, (nproc, extra, env, steps) in RUNS.items():
        dump = str(root / name)
        proc = world.launch(HARNESS, [*TINY, *extra, "--data-path", corpus, "--train-iters", str(steps)],
                            nproc=nproc, extra_env={"SB_TEST_DUMP": dump, **env})
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.load(open(os.path.join(dump, "rank0.json")))
        per_rank = []
        for f in sorted(glob.glob(os.path.join(dump, "rank*.npz"))):
            with np.load(f) as z:
                per_rank.append({k: z[k] for k in z.files})
        out[name] = (summary, per_rank)
    return out


def _rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


def _merged(per_rank):
    grads = {}
    for g in per_rank:
        for k, v in g.items():
            grads.setdefault(k, v)
    return grads


@pytest.mark.parametrize("got_name,ref_name", PAIRS)
def test_losses_and_gradients_equal_reference(runs, got_name, ref_name):
    ref, ref_ranks = runs[ref_name]
    got, got_ranks = runs[got_name]
    assert len(got["losses"]) == RUNS[got_name][3] == len(ref["losses"])
    assert len(set(np.round(ref["losses"], 4))) == len(ref["losses"]), "training did not move: vacuous comparison"
    assert got["tokens"] == ref["tokens"]
    assert _rel(got["losses"], ref["losses"]) < 1e-5, (got["losses"], ref["losses"])
    assert _rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    a, b = _merged(got_ranks), _merged(ref_ranks)
    assert sorted(a) == sorted(b) and len(b) > 20
    for name in b:
        assert np.linalg.norm(b[name]) > 0 or "bias" in name, f"{name}: zero gradient"
        assert _rel(a[name], b[name]) < 1e-5, name
    # CP ranks of one stage hold identical gradients (reduced over the DP x CP group)
    for r0, r1 in zip(got_ranks[0::2], got_ranks[1::2]):
        assert sorted(r0) == sorted(r1)
        assert all(np.array_equal(r0[k], r1[k]) for k in r0)


MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


@pytest.fixture(scope="module")
def mock_runs(tmp_path_factory, world):
    root = tmp_path_factory.mktemp("mock_cp")
    out = {}
    for name, nproc, extra in (("cp2_pp2_dp2", 8, PP2 + CP2), ("pp2_dp2", 4, PP2)):
        dump = str(root / name)
        proc = world.launch(HARNESS, [*TINY, *MOCK, *extra, "--train-iters", str(STEPS),
                                      "--step-timeout-minutes", "2"], nproc=nproc, extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.load(open(os.path.join(dump, "rank0.json")))
        assert summary["args"]["data_parallel_size"] == 2, summary["args"]
        per_rank = [dict(np.load(os.path.join(dump, f"rank{r}.npz"))) for r in range(nproc)]
        out[name] = (summary, per_rank)
    return out


def test_mock_data_cp2_pp2_dp2_trains_like_pp2_dp2(mock_runs):
    """Mock data under CP=2 x PP=2 x DP=2 trains 2 steps (no hang, no mismatched
    collective) with the losses, grad norms and gradients of PP=2 x DP=2 on the same mock
    samples; the two CP ranks of each stage and DP replica hold identical gradients."""
    ref, ref_ranks = mock_runs["pp2_dp2"]
    got, got_ranks = mock_runs["cp2_pp2_dp2"]
    assert got["iterations"] == ref["iterations"] == STEPS
    assert len(set(np.round(ref["losses"], 4))) == STEPS, "training did not move: vacuous comparison"
    assert got["tokens"] == ref["tokens"] == STEPS * 4 * 256  # 4 full mock samples a step
    assert _rel(got["losses"], ref["losses"]) < 1e-5, (got["losses"], ref["losses"])
    assert _rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    a, b = _merged(got_ranks), _merged(ref_ranks)
    assert sorted(a) == sorted(b) and len(b) > 20
    for name in b:
        assert _rel(a[name], b[name]) < 1e-5, name
    for r0, r1 in zip(got_ranks[0::2], got_ranks[1::2]):  # CP is the fastest-varying rank index
        assert sorted(r0) == sorted(r1) and all(np.array_equal(r0[k], r1[k]) for k in r0)


@pytest.mark.parametrize("got_name,ref_name", SPARSE_PAIRS)
def test_sparse_routing_and_dst_budgets_identical(runs, got_name, ref_name):
    ref, _ = runs[ref_name]
    got, _ = runs[got_name]
    assert 0.2 < ref["density_mean"] < 0.9  # routing really chooses blocks
    assert got["density_mean"] == ref["density_mean"]  # CP ranks' kept pairs add up exactly
    assert all(b is not None for b in ref["budgets"])
    assert got["budgets"] == ref["budgets"]
    flat = np.concatenate([np.ravel(b) for b in ref["budgets"]])
    assert len(set(flat.tolist())) > 1, "DST left every budget equal: vacuous"


def test_sequence_parallel_padding_is_exercised(runs):
    """The TP=2 + SP x PP=2 run trained micro-batches of an odd number of tokens (each
    padded by one row): the comparison covers the padding, not only even splits."""
    got, _ = runs["sparse_pp2_tp2_sp"]
    tokens = [t for step in got["microbatch_tokens"] for _, t in step]
    assert len(tokens) == SP_STEPS * 4 and any(t % 2 for t in tokens) and any(t % 2 == 0 for t in tokens)


def split_report(data_path: str, seq_length: int, steps: int, cp: int, seed: int) -> dict:
    """Per CP rank and micro-batch of the driver's first ``steps`` steps (DP=1, one
    micro-batch a step, megatron packing): tokens held (padding included), real tokens
    and causal work (sum over its real queries of the keys they attend to, dense)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron.training.data import PackedDataLoader, split_documents
    from sparsebalance.attention.context_parallel import layout_from_cu

    ds = IndexedDataset(data_path)
    ids = split_documents(len(ds), (1.0, 0.0, 0.0))[0]
    loaders = [PackedDataLoader(ds, ids, dp=1, dp_rank=0, micro_batches=1, seq_length=seq_length,
                                strategy="megatron", seed=seed, cp=cp, cp_rank=r) for r in range(cp)]
    rows = []
    for _ in range(steps):
        mbs = [ld.next_step().microbatches[0] for ld in loaders]
        lays = [layout_from_cu(mb["cu_seqlens"], mb["cu_seqlens_padded"], cp, r) for r, mb in enumerate(mbs)]
        work = [lay.causal_pairs for lay in lays]
        rows.append({"documents": len(mbs[0]["cu_seqlens"]) - 1,
                     "tokens": [int(mb["tokens"].shape[1]) for mb in mbs],
                     "real_tokens": [int(len(lay.local_rows)) for lay in lays],
                     "causal_work": work,
                     "work_diff": (max(work) - min(work)) / (sum(work) / cp)})
    return {"cp": cp, "seq_length": seq_length, "microbatches": rows,
            "max_work_diff": max(r["work_diff"] for r in rows)}


if __name__ == "__main__":
    # What each CP rank holds of the micro-batches a run trains, e.g. the 16K measurement
    # in docs/usage.md:
    #   .venv/bin/python tests/training/test_cp_training.py --data-path /tmp/cp16k/corpus \
    #       --seq-length 16384 --steps 4 --seed 7
    import argparse
    import sys

    from conftest import ROOT

    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-path", required=True)
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--context-parallel-size", type=int, default=2)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args()
    print(json.dumps(split_report(a.data_path, a.seq_length, a.steps, a.context_parallel_size, a.seed),
                     indent=1))
