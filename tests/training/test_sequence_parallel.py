"""Sequence parallelism (``--sequence-parallel``, TP > 1) on packed micro-batches.

* The data path pads a micro-batch after its last document so every rank's tokens split
  over the TP ranks: without CP to a multiple of TP, under CP before the split so each CP
  rank's share is one; ``cu_seqlens`` keeps the documents, ``cu_seqlens_padded`` the rows.
* A TP=2 forward+backward with SP saves less for backward on each rank than without it,
  by what megatron-core's SP shards (each layer's two norm inputs and the two column-
  parallel linears' inputs, plus the final norm's input and output: ``(4 L + 2) s h``
  floats, halved), with the same loss; and gloo runs the SP collectives
  (``all_gather_into_tensor``, ``reduce_scatter_tensor``, blocking and async) exactly.
  The training runs (TP=2 + SP against TP=1, with PP=2 and with CP=2, sparse attention
  with DST budgets) are in ``test_cp_training.py``, next to the CP ones.
"""

import json
import os

import numpy as np
import pytest
import torch
from conftest import ROOT

from megatron.training.data import context_parallel_split, sequence_parallel_pad_microbatch


def _microbatch(lens):
    T = sum(lens)
    return {"tokens": torch.arange(1, T + 1).unsqueeze(0), "labels": torch.arange(2, T + 2).unsqueeze(0),
            "loss_mask": torch.ones(1, T), "position_ids": torch.cat([torch.arange(n) for n in lens]).unsqueeze(0),
            "cu_seqlens": torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)}


@pytest.mark.parametrize("lens,sp", [([5, 1, 9], 2), ([5, 1, 9], 4), ([8, 8], 4), ([1], 8)])
def test_pad_after_the_last_document(lens, sp):
    mb = _microbatch(lens)
    out = sequence_parallel_pad_microbatch(mb, sp)
    T, rows = sum(lens), out["tokens"].shape[1]
    assert rows % sp == 0 and 0 <= rows - T < sp
    assert torch.equal(out["cu_seqlens"], mb["cu_seqlens"])
    assert out["cu_seqlens_padded"].tolist() == [*mb["cu_seqlens"][:-1].tolist(), rows]
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(out[key][:, :T], mb[key]) and (out[key][:, T:] == 0).all()


@pytest.mark.parametrize("cp,sp", [(2, 2), (2, 4), (2, 3), (4, 2)])
def test_cp_split_pads_each_share_to_a_multiple_of_tp(cp, sp):
    """Every CP rank's share splits over the TP ranks, only the last document grows (by
    a multiple of 2 x CP), and the CP ranks together hold every real token once, with its
    label and position (the extra padding is masked)."""
    lens = [13, 2, 7]
    mb = _microbatch(lens)
    ref = context_parallel_split(mb, cp, 0)
    got = [context_parallel_split(mb, cp, r, sp) for r in range(cp)]
    padded = got[0]["cu_seqlens_padded"]
    assert (torch.diff(padded) % (2 * cp) == 0).all() and torch.equal(got[0]["cu_seqlens"], mb["cu_seqlens"])
    assert torch.equal(padded[:-1], ref["cu_seqlens_padded"][:-1])
    assert len({d["tokens"].shape[1] for d in got}) == 1 and got[0]["tokens"].shape[1] % sp == 0
    real = sorted((int(t), int(y), int(p)) for d in got for t, y, p, m in
                  zip(d["tokens"][0], d["labels"][0], d["position_ids"][0], d["loss_mask"][0]) if m > 0)
    want = sorted(zip(mb["tokens"][0].tolist(), mb["labels"][0].tolist(), mb["position_ids"][0].tolist()))
    assert real == want


WORKER = os.path.join(ROOT, "tests", "training", "_sp_worker.py")
LAYERS, HIDDEN, TOKENS = 4, 64, 2049
MODEL = ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
         "--make-vocab-size-divisible-by", "1", "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
         "--ffn-hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "4096",
         "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--hidden-dropout", "0", "--attention-dropout", "0"]  # the comparisons are exact


@pytest.fixture(scope="module")
def tp2(corpus, tmp_path_factory, world):
    out = {}
    for name, extra in (("tp2", []), ("tp2_sp", ["--sequence-parallel"])):
        dump = str(tmp_path_factory.mktemp(name))
        proc = world.launch(WORKER, [*MODEL, *extra, "--data-path", corpus, "--tokens", str(TOKENS),
                                     "--docs", "3"], nproc=2, extra_env={"SB_TEST_DUMP": dump})
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[name] = [json.load(open(os.path.join(dump, f"rank{r}.json"))) for r in range(2)]
    return out


def test_sp_saves_less_for_backward_with_the_same_loss(tp2):
    for plain, sp in zip(tp2["tp2"], tp2["tp2_sp"]):
        assert plain["rows"] == TOKENS and sp["rows"] == TOKENS + 1  # odd: one padding row
        assert sp["loss"] == pytest.approx(plain["loss"], rel=1e-6)
        sharded = (4 * LAYERS + 2) * TOKENS * HIDDEN * 4 / 2  # bytes SP takes off each rank
        saved = plain["saved_peak_bytes"] - sp["saved_peak_bytes"]
        assert 0.9 * sharded < saved < 1.1 * sharded, (saved, sharded)
        assert sp["saved_peak_bytes"] < 0.85 * plain["saved_peak_bytes"]


def test_gloo_runs_the_sp_collectives(tp2):
    for rank in tp2["tp2_sp"]:
        assert rank["collectives"] and all(rank["collectives"].values()), rank["collectives"]


@pytest.mark.parametrize("tp,reason", [("2", "implemented"), ("1", "off with TP = 1, as in Megatron-LM")])
def test_launch_check_honours_sequence_parallel(tp, reason):
    """tools/check_launch_script.py (and the Megatron-LM config harness) count
    --sequence-parallel as honoured with any TP size."""
    from megatron.training.launch_check import classify

    rows = classify([("--tensor-model-parallel-size", [tp]), ("--sequence-parallel", [])])
    sp = next(r for r in rows if r["flag"] == "--sequence-parallel")
    assert (sp["status"], sp["reason"]) == ("honoured", reason)
