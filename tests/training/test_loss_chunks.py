"""The output layer + loss in chunks (``--cross-entropy-loss-fusion --cross-entropy-fusion-impl
linear``, megatron/training/loss_chunks.py: fused at TP = 1, megatron/training/linear_ce.py;
checkpointed chunks under TP) against megatron-core's unchunked path.

World jobs (``_loss_chunks_worker.py``) build the driver's tiny GPT (fp32, PP=1, one packed
THD micro-batch of three documents, a loss mask with zeros) unchunked and chunked with the
same weights: the per-token loss, the masked mean and EVERY parameter's gradient agree
(1e-6 relative), tied and untied output weights, chunk sizes that divide the 96 tokens and
that do not (and one above them); under TP=2 without and with sequence parallelism each
rank's vocabulary shard and gradients agree too. Memory: the bytes autograd saves for
backward include the fp32 logits ``[tokens, vocab]`` unchunked; chunked they stay below
half of one logits tensor. Bad command lines are in ``tests/integration/test_bad_input.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.training._loss_chunks_worker import DOCS, TOKENS, VOCAB, batch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_loss_chunks_worker.py")
CHUNKS = (32, 25, 7, 200)
"""Divides the 96 tokens, leaves a ragged last chunk, many small chunks, one above the tokens."""
TP_CHUNKS = (25,)
_RUNS: dict = {}


def _run(world, tmp_path_factory, tp: int, sp: bool):
    key = (tp, sp)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"loss_chunks_tp{tp}_sp{int(sp)}")
        chunks = CHUNKS if tp == 1 else TP_CHUNKS
        flags = ["--tensor-model-parallel-size", str(tp), *(["--sequence-parallel"] if sp else [])]
        proc = world.launch(WORKER, [str(out), ",".join(map(str, chunks)), *flags], nproc=tp, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _RUNS[key] = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(tp)]
    return _RUNS[key]


def _assert_same(got: dict, ref: dict) -> None:
    torch.testing.assert_close(got["per_token"], ref["per_token"], rtol=1e-6, atol=0)
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=0)
    assert got["grads"].keys() == ref["grads"].keys() and len(ref["grads"]) == ref["params"]
    for name, g in ref["grads"].items():
        assert g.abs().max() > 0, name  # an all-zero gradient would compare vacuously
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-6, atol=1e-6 * float(g.abs().max()), msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", CHUNKS, ids=["divides", "ragged", "small", "above-tokens"])
def test_chunked_loss_and_gradients_equal_unchunked(world, tmp_path_factory, chunk, tied):
    (rank0,) = _run(world, tmp_path_factory, 1, False)
    ref, got = rank0[(tied, 0)], rank0[(tied, chunk)]
    assert ref["class"] == "GPTModel" and got["class"] == "ChunkedLossGPTModel"
    assert ref["path"] is None and got["path"] == "fused"  # TP = 1: megatron/training/linear_ce.py
    assert ("output_layer.weight" in ref["grads"]) != tied  # tied: the embedding gets the output's gradient
    _assert_same(got, ref)
    mask = batch()[3]
    assert ref["per_token"].shape == (1, TOKENS) and len(DOCS) > 2  # several documents, one micro-batch
    assert (ref["per_token"] * (1 - mask)).abs().sum() > 0  # the mask removes real losses


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_chunked_loss_under_tensor_parallelism(world, tmp_path_factory, sp):
    ranks = _run(world, tmp_path_factory, 2, sp)
    for rank in ranks:
        for tied in (False, True):
            assert rank[(tied, 0)]["grads"]["embedding.word_embeddings.weight"].shape[0] == VOCAB // 2
            _assert_same(rank[(tied, TP_CHUNKS[0])], rank[(tied, 0)])
            assert rank[(tied, TP_CHUNKS[0])]["path"] == "checkpointed"  # the vocabulary split over ranks
    torch.testing.assert_close(ranks[0][(False, 0)]["per_token"], ranks[1][(False, 0)]["per_token"])


def test_chunked_loss_keeps_no_logits_for_backward(world, tmp_path_factory):
    """Unchunked, the saved bytes exceed one fp32 logits tensor (TOKENS x VOCAB x 4 B);
    chunked by 7 they stay below half of it (hidden states, layers' activations, losses)."""
    (rank0,) = _run(world, tmp_path_factory, 1, False)
    logits_bytes = TOKENS * VOCAB * 4
    assert rank0[(False, 0)]["saved_peak"] > logits_bytes
    assert rank0[(False, 7)]["saved_peak"] < logits_bytes / 2, (rank0[(False, 7)]["saved_peak"], logits_bytes)
