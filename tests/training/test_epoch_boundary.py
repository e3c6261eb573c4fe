"""Epoch end: the sampler flushes carried items and may leave micro-batches empty.

Megatron's schedules need exactly M micro-batches per step on every rank, so
:class:`PackedDataLoader` turns an empty plan entry into one fully masked padding
token (the same on every pipeline rank, since all ranks run the same sampler). These
tests check that on a corpus whose epoch ends within three steps: every step still
has M micro-batches, the empty ones train on nothing, every token of the epoch is
trained exactly once, and the real driver (PP=1 and PP=2) trains across the boundary.
"""

import numpy as np
import pytest
from conftest import PRETRAIN, summary_of

from benchmarks.harness.run_flags import PROJECT_RUN_FLAGS

M, SEQ, SEED = 4, 256, 7


def _lengths():
    """40 documents, ~2.4K tokens: epoch 0 ends at step 2 with empty micro-batches."""
    return np.random.default_rng(0).integers(2, 120, size=40)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    from megatron.training.indexed_io import write_documents

    prefix = str(tmp_path_factory.mktemp("epoch") / "small")
    rng = np.random.default_rng(1)
    write_documents(prefix, [rng.integers(1, 250, size=int(n)) for n in _lengths()], 256)
    return prefix


MODEL = [*PROJECT_RUN_FLAGS, "--num-layers", "2", "--hidden-size", "32", "--ffn-hidden-size", "64",
         "--num-attention-heads", "2", "--seq-length", str(SEQ)]
SB = ["--sparse-balance", "--sb-cost-model", "h100-analytic", "--sb-block-size", "16", "--sb-topk", "2"]
"""The SparseBalance arm of the driver test (SAB packing + DST budgets) on MODEL."""


def _loader(prefix, strategy, dp=1, dp_rank=0, pad_to=None):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron.training.data import PackedDataLoader
    from sparsebalance.predictor import get_predictor

    pred = get_predictor("h100-analytic", num_layers=2, hidden_size=32, num_attention_heads=2,
                         ffn_hidden_size=64, block_size=16, topk=2) if strategy == "sab" else None
    ds = IndexedDataset(prefix)
    return ds, PackedDataLoader(ds, np.arange(len(ds)), dp=dp, dp_rank=dp_rank, micro_batches=M,
                                seq_length=SEQ, strategy=strategy, seed=SEED, pad_to=pad_to,
                                predictor=pred, pp=2)


@pytest.mark.parametrize("strategy", ["megatron", "sorted", "sab"])
@pytest.mark.parametrize("pad_to", [None, SEQ])
def test_epoch_end_steps_keep_m_microbatches_and_every_token_once(small_corpus, strategy, pad_to):
    ds, loader = _loader(small_corpus, strategy, pad_to=pad_to)
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    seen = [np.zeros(n, dtype=np.int64) for n in lengths]
    empty = 0
    for _ in range(10):
        step = loader.next_step()
        if step.packing.epoch > 0:
            break
        assert len(step.microbatches) == M
        for segs, mb in zip(step.packing.ranks[0], step.microbatches):
            cu = mb["cu_seqlens"].tolist()
            assert cu[0] == 0 and cu[-1] == mb["tokens"].shape[1]
            if not segs:
                empty += 1
                # Trains on nothing, attends only to itself.
                assert float(mb["loss_mask"].sum()) == 0.0
                assert cu == [0, pad_to or 1]
            for doc, off, n in segs:
                seen[doc][off:off + n] += 1
    if strategy == "sab":
        # SAB fills a micro-batch left empty from the stream while an item fits
        # (strategies/common.py: occupy_empty_bins), so here its epoch ends with none empty;
        # the loader's padding of an empty entry does not depend on the packer
        assert empty == 0, "on this fixture SAB fills every micro-batch up to the epoch end"
    else:
        assert empty > 0, "fixture no longer ends an epoch with an empty micro-batch"
    assert all((s == 1).all() for s in seen), "a token was trained zero or several times in epoch 0"


def test_epoch_end_plan_is_the_same_on_every_rank(small_corpus):
    """DP=2: both ranks see the same plan and each has M micro-batches every step."""
    a = _loader(small_corpus, "megatron", dp=2, dp_rank=0)[1]
    b = _loader(small_corpus, "megatron", dp=2, dp_rank=1)[1]
    for _ in range(4):
        sa, sb = a.next_step(), b.next_step()
        assert sa.packing.ranks == sb.packing.ranks
        assert len(sa.microbatches) == len(sb.microbatches) == M


@pytest.mark.parametrize("pp,arm", [(1, ["--sb-batching", "sorted"]), (2, ["--sb-batching", "sorted"]),
                                    (2, SB)], ids=["pp1-sorted", "pp2-sorted", "pp2-sparse-balance"])
def test_driver_trains_across_the_epoch_end(small_corpus, pp, arm, world):
    args = ["--cpu", *MODEL, "--global-batch-size", str(M),
            "--lr", "1e-3", "--log-interval", "1", "--no-progress-bar", "--seed", str(SEED),
            "--data-path", small_corpus, "--split", "1,0,0", *arm,
            "--train-iters", "7", "--pipeline-model-parallel-size", str(pp)]
    s = summary_of(world.launch(PRETRAIN, args, nproc=pp, timeout=300))
    assert s["iterations"] == 7  # epochs end at steps 3 and 6 (see the loader test)
    assert all(np.isfinite(s["losses"])) and all(np.isfinite(s["grad_norms"]))
    total = int(_lengths().sum())
    assert 2 * total < s["tokens"] <= 2 * total + M * SEQ  # two whole epochs + step 7
