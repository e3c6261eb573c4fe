"""Under ``--sb-routing threshold`` SAB packs with a density estimator that learns from the
attention records after every step (all-reduced, lag 2); a resumed run continues exactly:
same packing, estimator state and losses as the uninterrupted run (PP=2 over gloo,
planning ahead, a source sidecar on the corpus)."""

import json
import os

from conftest import ROOT, TINY
from test_exact_resume import DET, keep_only, read_dump

WORKER = os.path.join(ROOT, "tests", "training", "_fault_worker.py")
FLAGS = [*TINY, "--pipeline-model-parallel-size", "2", "--lr-decay-style", "constant",
         "--global-batch-size", "6", "--sparse-balance", "--sb-block-size", "16", "--sb-topk", "8",
         "--sb-routing", "threshold", "--sb-threshold", "0.6", "--sb-topk-min", "0",
         "--sb-cost-model", "h100-analytic"]
TOTAL, AT = 5, 2


def _run(world, data, tmp_path, name, more):
    dump = str(tmp_path / f"d_{name}")
    proc = world.launch(WORKER, [*FLAGS, "--data-path", data, "--train-iters", str(TOTAL), *more], nproc=2,
                        extra_env={**DET, "SB_TEST_DUMP": dump})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_dump(dump)


def test_threshold_estimator_resumes_exactly(corpus, tmp_path, world):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = str(tmp_path / "data")
    for ext in (".bin", ".idx"):
        os.symlink(corpus + ext, data + ext)
    n = len(IndexedDataset(data))
    with open(data + "_sources.json", "w") as fh:  # two sources, alternating
        json.dump({"doc_source": ["code" if i % 2 else "prose" for i in range(n)]}, fh)
    save = str(tmp_path / "full")
    full, _ = _run(world, data, tmp_path, "full", ["--save", save, "--save-interval", str(AT)])
    res, loaded = _run(world, data, tmp_path, "res", ["--load", keep_only(save, AT, str(tmp_path / "ck"))])
    assert loaded == {0: AT, 1: AT}
    for rank in (0, 1):
        for key in ("packing", "sampler", "loss_sum", "loss_tokens"):
            assert [s[key] for s in res[rank]] == [s[key] for s in full[rank][AT:]], (rank, key)
    # not vacuous: the estimator learnt per-source cells from the records of both ranks
    state = full[0][-1]["sampler"]["density"]
    cells = {(c[0], c[1]) for c in state["estimator"]["cells"]}
    assert {("s", "code"), ("s", "prose")} <= cells, cells
    assert state == full[1][-1]["sampler"]["density"]  # every rank learnt the same
