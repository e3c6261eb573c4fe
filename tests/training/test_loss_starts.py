"""Answer-only loss: loss starts written by preprocess_data.py, read by the driver's loader."""

import json
import os
import subprocess

import numpy as np
import pytest
from conftest import ROOT, command, env

PREPROCESS = os.path.join(ROOT, "tools", "preprocess_data.py")
# (text, loss_start in characters; None: the field is absent)
DOCS = [("What is 2+2? Answer: 4\n", 21), ("plain filler text\n", 0), ("no field here\n", None),
        ("Q: name? A: bob\n", 12)]


def preprocess(tmp_path, docs, *extra, world=None):
    """preprocess_data.py on ``docs``: in ``world`` (the session's warm world) if given, else
    in a process (where the exit status and message are what a test checks)."""
    lines = [json.dumps({"text": t, **({} if s is None else {"loss_start": s})}) for t, s in docs]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    args = ["--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "docs"), "--json-key", "text",
            *extra]
    if world is not None:
        return world.launch(PREPROCESS, args, timeout=120)
    return subprocess.run(command(PREPROCESS, args), cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, world):
    d = tmp_path_factory.mktemp("starts")
    proc = preprocess(d, DOCS, "--loss-start-key", "loss_start", world=world)
    assert proc.returncode == 0, proc.stderr
    from megatron.training.indexed_io import open_dataset, open_loss_starts

    ds = open_dataset(str(d / "docs"))
    return ds, open_loss_starts(str(d / "docs"), ds.sequence_lengths), str(d / "docs")


def test_sidecar_holds_token_offsets(dataset):
    ds, starts, _ = dataset
    assert starts.tolist() == [21, 0, 0, 12]  # byte tokenizer: characters = tokens; absent = 0
    assert bytes(ds.get(0)[starts[0]:].tolist()) == b"4\n"


def test_compression_sidecar_has_one_ratio_per_document(dataset):
    """preprocess_data.py also writes each document's text compression ratio (SAB's density
    estimator reads it under threshold routing)."""
    from megatron.training.doc_features import compression_ratio

    _, _, prefix = dataset
    ratios = np.load(prefix + "_compression.npy")
    assert ratios.shape == (len(DOCS),)
    np.testing.assert_allclose(ratios, [compression_ratio(t) for t, _ in DOCS], rtol=1e-6)


def test_mask_covers_exactly_the_answer(dataset):
    from megatron.training.data import build_microbatch

    ds, starts, _ = dataset
    n0, n1 = (len(DOCS[i][0]) for i in (0, 1))
    mb = build_microbatch(ds, np.arange(len(ds)), [(0, 0, n0), (1, 0, n1)], loss_starts=starts)
    mask, labels = mb["loss_mask"][0], mb["labels"][0]
    # doc 0: the targets are the tokens from the start on ("4\n"), each predicted one position earlier
    kept = [bytes([int(labels[i])]) for i in range(n0) if mask[i] == 1]
    assert kept == [b"4", b"\n"]  # the answer and its terminator, nothing of the prompt
    # doc 1 (start 0): every position but the last is a target, as without starts
    assert mask[n0:n0 + n1].tolist() == [1.0] * (n1 - 1) + [0.0]
    plain = build_microbatch(ds, np.arange(len(ds)), [(0, 0, n0), (1, 0, n1)])
    assert plain["loss_mask"][0][:n0].sum() == n0 - 1


def test_mask_of_a_chunk_uses_document_positions(dataset):
    """A chunk of a longer document: its positions are offsets into that document."""
    from megatron.training.data import build_microbatch

    ds, starts, _ = dataset
    text, start = DOCS[3]
    for off, length in ((0, 8), (8, 5), (10, 3), (0, len(text))):
        mb = build_microbatch(ds, np.arange(len(ds)), [(3, off, length)], loss_starts=starts)
        mask = mb["loss_mask"][0].tolist()
        # position p predicts token p + 1: a target iff p + 1 >= start and a next token exists
        want = [1.0 if (off + i + 1 >= start and off + i + 1 < len(text)) else 0.0 for i in range(length)]
        assert mask == want, (off, length)


def test_bad_loss_start_is_one_line_and_writes_nothing(tmp_path):
    proc = preprocess(tmp_path, [("short\n", 3), ("also short\n", 99)], "--loss-start-key", "loss_start")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "in.jsonl:2" in lines[0] and "loss_start" in lines[0], proc.stderr
    assert not list(tmp_path.glob("docs*")), "half-written output left behind"


def test_rewriting_without_the_key_drops_a_stale_sidecar(tmp_path, world):
    assert preprocess(tmp_path, DOCS, "--loss-start-key", "loss_start", world=world).returncode == 0
    assert (tmp_path / "docs_loss_start.npy").exists()
    assert preprocess(tmp_path, DOCS[:2], world=world).returncode == 0
    assert not (tmp_path / "docs_loss_start.npy").exists()


def test_sidecar_that_does_not_match_the_dataset_is_refused(tmp_path, dataset):
    from megatron.training.indexed_io import open_loss_starts

    ds, _, _ = dataset
    prefix = str(tmp_path / "x")
    with pytest.raises(ValueError, match="needs .*x_loss_start.npy"):
        open_loss_starts(prefix, ds.sequence_lengths)
    np.save(prefix + "_loss_start.npy", np.zeros(len(ds) + 1, dtype=np.int64))
    with pytest.raises(ValueError, match=f"expected {len(ds)} integer loss starts"):
        open_loss_starts(prefix, ds.sequence_lengths)
    np.save(prefix + "_loss_start.npy", np.full(len(ds), 10_000, dtype=np.int64))
    with pytest.raises(ValueError, match="outside"):
        open_loss_starts(prefix, ds.sequence_lengths)
