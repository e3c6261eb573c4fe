"""Packed THD micro-batches: layout invariants and no attention across documents."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import ROOT


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, world):
    """Three known documents written through tools/preprocess_data.py (byte tokenizer)."""
    d = tmp_path_factory.mktemp("pre")
    texts = ["hello world", "a", "the quick brown fox jumps", "x" * 40]
    (d / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "\n")
    proc = world.launch(os.path.join(ROOT, "tools", "preprocess_data.py"),
                        ["--input", str(d / "in.jsonl"), "--output-prefix", str(d / "docs"), "--json-key", "text"],
                        timeout=120)
    assert proc.returncode == 0, proc.stderr
    from megatron.training.indexed_io import open_dataset

    return open_dataset(str(d / "docs")), texts


def test_preprocess_roundtrip(dataset):
    ds, texts = dataset
    assert len(ds) == len(texts)
    for i, t in enumerate(texts):
        assert bytes(ds.get(i).tolist()) == t.encode()


def test_microbatch_layout(dataset):
    from megatron.training.data import build_microbatch

    ds, texts = dataset
    # doc 0 whole, doc 2 whole, first 16 tokens of doc 3 (a chunk of a longer doc)
    segs = [(0, 0, len(texts[0])), (2, 0, len(texts[2])), (3, 8, 16)]
    mb = build_microbatch(ds, np.arange(len(ds)), segs)
    T = sum(s[2] for s in segs)
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        assert mb[k].shape == (1, T), k
    assert mb["cu_seqlens"].dtype == torch.int32
    assert mb["cu_seqlens"].tolist() == [0, 11, 36, 52]
    pos = mb["position_ids"][0].tolist()
    assert pos[:11] == list(range(11)) and pos[11:36] == list(range(25)) and pos[36:] == list(range(16))
    tok, lab, mask = (mb[k][0] for k in ("tokens", "labels", "loss_mask"))
    # labels are the next token of the same document, never of the next one
    assert bytes(tok[:11].tolist()) == b"hello world" and bytes(lab[:10].tolist()) == b"ello world"
    assert mask[10] == 0 and mask[35] == 0 and mask[:10].all() and mask[11:35].all()
    # a chunk of a longer document is still trained on the token after it
    assert mask[51] == 1 and lab[51] == ord("x")
    assert float(mask.sum()) == T - 2


def test_pad_id_targets_carry_no_loss(dataset):
    """--null-tokenizer-pad-id (Megatron-LM main): a target equal to the pad id is masked, as
    Megatron-LM's GPT dataset masks its pad token; other targets and the inputs are kept."""
    from megatron.training.data import build_microbatch

    ds, texts = dataset
    segs = [(0, 0, len(texts[0]))]  # "hello world": 'l' is the target of 'e', 'l' and 'r'
    plain = build_microbatch(ds, np.arange(len(ds)), segs)
    masked = build_microbatch(ds, np.arange(len(ds)), segs, pad_id=ord("l"))
    lab = plain["labels"][0]
    hit = lab == ord("l")
    assert int(hit.sum()) == 3 and torch.equal(masked["tokens"], plain["tokens"])
    assert torch.all(masked["loss_mask"][0][hit] == 0)
    assert torch.equal(masked["loss_mask"][0][~hit], plain["loss_mask"][0][~hit])


def test_padding_segment_is_masked(dataset):
    from megatron.training.data import build_microbatch

    ds, texts = dataset
    mb = build_microbatch(ds, np.arange(len(ds)), [(0, 0, 11)], pad_to=32)
    assert mb["tokens"].shape == (1, 32)
    assert mb["cu_seqlens"].tolist() == [0, 11, 32]
    assert float(mb["loss_mask"][0, 11:].sum()) == 0
    empty = build_microbatch(ds, np.arange(len(ds)), [])
    assert empty["tokens"].shape == (1, 1) and float(empty["loss_mask"].sum()) == 0


def test_the_lengths_the_library_plans_are_the_segments_trained(dataset):
    """StepPacking.lengths (what the balancer plans and predicts) equals the cu_seqlens of
    the micro-batches the driver builds, padded, unpadded and empty."""
    from megatron.training.data import build_microbatch
    from sparsebalance.batching.packing import StepPacking

    ds, texts = dataset
    mbs = [[(0, 0, 11), (2, 0, 3)], [], [(2, 4, 2)]]
    packing = StepPacking(step=0, epoch=0, ranks=[mbs])
    for pad_to in (None, 32):
        built = [np.diff(build_microbatch(ds, np.arange(len(ds)), mb, pad_to=pad_to)["cu_seqlens"].numpy())
                 for mb in mbs]
        assert packing.lengths(pad_to) == [[b.tolist() for b in built]]
    assert packing.lengths(None) == [[[11, 3], [1], [2]]]


LEAKAGE = [  # (more driver flags, head dims RoPE rotates)
    ((), 16),                                         # head dim 64 / 4 = 16, all rotated
    (("--rotary-percent", "0.5", "--rotary-base", "500000"), 8),  # GPT-NeoX style partial rotary
    (("--position-embedding-type", "none"), 0),      # NoPE: the causal mask is the only order signal
]


@pytest.fixture(scope="module")
def leakage(corpus, tmp_path_factory, world):
    """_leakage.py's npz of every LEAKAGE variant (one process, one model per variant)."""
    out = tmp_path_factory.mktemp("leak")
    proc = world.launch(os.path.join(ROOT, "tests", "training", "_leakage.py"),
                        [corpus, str(out), *(" ".join(flags) for flags, _ in LEAKAGE)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {flags: str(out / f"variant{i}.npz") for i, (flags, _) in enumerate(LEAKAGE)}


@pytest.mark.parametrize("flags,rotary_dim", LEAKAGE)
def test_no_cross_document_leakage(leakage, flags, rotary_dim):
    z = np.load(leakage[flags])
    assert int(z["rotary_dim"]) == rotary_dim
    cu, changed = z["cu"], int(z["changed"])
    before, after = z["before"].reshape(-1, z["before"].shape[-1]), z["after"].reshape(-1, z["after"].shape[-1])
    assert len(cu) - 1 >= 3, "fixture must pack several documents"
    for d in range(len(cu) - 1):
        s, e = cu[d], cu[d + 1]
        diff = np.abs(after[s:e] - before[s:e]).max()
        if d == changed:
            assert diff > 1e-3, "changing a document must change its own logits (vacuous test otherwise)"
        else:
            assert diff <= 1e-10, f"document {d} changed by {diff} when document {changed} was edited"
