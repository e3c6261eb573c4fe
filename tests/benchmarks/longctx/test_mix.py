"""Training mix: filler share, document lengths, determinism; eval-set files."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks.harness.longctx.mix import (
    MixConfig,
    filler_lengths,
    load_lengths,
    read_eval_set,
    training_documents,
    write_eval_set,
    write_training_mix,
)
from benchmarks.harness.longctx.tasks import TASKS, generate, generate_set

PROLONG = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "lengths", "prolong.json")


@pytest.fixture
def lengths_file(tmp_path):
    """A small private length distribution (so the test does not depend on the sample files)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(rng.lognormal(7.5, 1.0, size=5000).astype(int).clip(1).tolist()))
    return str(path)


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_filler_share_and_document_bounds(lengths_file, share):
    cfg = MixConfig(num_docs=60, lengths=(1024, 2048), max_tokens=2048, filler_share=share,
                    lengths_file=lengths_file, seed=3)
    docs = list(training_documents(cfg))
    kinds = [k for k, _, _ in docs]
    assert len(docs) == 60 and kinds.count("filler") == round(share * 60)
    assert all(len(t.encode()) <= 2048 for _, t, _ in docs)
    if share < 1:
        assert len({k for k in kinds if k != "filler"}) >= 3  # several tasks really present
    if 0 < share < 1:  # filler is interleaved, not one block at the start or end
        pos = [i for i, k in enumerate(kinds) if k == "filler"]
        assert pos[0] < 30 < pos[-1]


def test_mix_is_deterministic_and_seeded(lengths_file):
    cfg = MixConfig(num_docs=30, lengths=(1024,), max_tokens=1024, lengths_file=lengths_file, seed=1)
    a = list(training_documents(cfg))
    assert a == list(training_documents(cfg))
    b = list(training_documents(MixConfig(**{**cfg.__dict__, "seed": 2})))
    assert a != b


def test_filler_lengths_follow_the_scaled_distribution(lengths_file):
    cfg = MixConfig(num_docs=1, max_tokens=4096, lengths_file=lengths_file, filler_quantile=0.99)
    base = load_lengths(lengths_file)
    drawn = filler_lengths(cfg, 20000, np.random.default_rng(0))
    scale = 4096 / np.quantile(base, 0.99)
    assert drawn.max() <= 4096 and drawn.min() >= cfg.min_filler_tokens
    for q in (0.25, 0.5, 0.9):  # resampling keeps the shape below the mapped quantile
        assert np.quantile(drawn, q) == pytest.approx(np.quantile(base, q) * scale, rel=0.05)
    assert np.mean(drawn == 4096) == pytest.approx(0.01, abs=0.005)  # the clipped top 1%


def test_filler_documents_follow_the_drawn_lengths(lengths_file):
    """The text of filler documents is as long as drawn (each falls short by < one word)."""
    cfg = MixConfig(num_docs=400, max_tokens=4096, filler_share=1.0, lengths_file=lengths_file, seed=5)
    got = np.array([len(t) for _, t, _ in training_documents(cfg)])
    want = filler_lengths(cfg, 20000, np.random.default_rng(1))
    for q in (0.25, 0.5, 0.75):
        assert np.quantile(got, q) == pytest.approx(np.quantile(want, q), rel=0.15)


def test_sample_length_files_load():
    arr = load_lengths(PROLONG)
    assert arr.size > 1000 and arr.min() > 0


def test_bad_configs_raise(lengths_file):
    with pytest.raises(ValueError, match="filler_share"):
        MixConfig(num_docs=1, filler_share=1.5)
    with pytest.raises(ValueError, match="lengths"):
        MixConfig(num_docs=1, lengths=(8192,), max_tokens=4096)
    with pytest.raises(ValueError, match="tasks"):
        MixConfig(num_docs=1, tasks=("nope",))
    with pytest.raises(ValueError, match="lengths_file"):
        load_lengths(lengths_file + ".missing")


def test_loss_start_is_where_the_answer_begins(lengths_file):
    """Task documents start their targets at the answer; filler is all target."""
    cfg = MixConfig(num_docs=40, lengths=(1024,), max_tokens=1024, filler_share=0.25,
                    lengths_file=lengths_file, seed=4)
    seen = set()
    for i, (kind, text, start) in enumerate(training_documents(cfg)):
        seen.add(kind)
        if kind == "filler":
            assert start == 0
            continue
        sample = generate(kind, 1024, cfg.seed, i, split="train")
        assert text == sample.text and start == len(sample.prompt)
        assert text[start:] == sample.answer + "\n"
    assert "filler" in seen and len(seen) >= 3


def test_write_and_read_back(tmp_path, lengths_file):
    cfg = MixConfig(num_docs=20, lengths=(1024,), max_tokens=1024, lengths_file=lengths_file)
    counts = write_training_mix(str(tmp_path / "train.jsonl"), cfg)
    lines = (tmp_path / "train.jsonl").read_text().splitlines()
    assert len(lines) == 20 == sum(counts.values())
    assert all(set(json.loads(x)) == {"text", "loss_start"} for x in lines)
    samples = generate_set(TASKS, (1024,), 2, seed=9)
    write_eval_set(str(tmp_path / "eval.jsonl"), samples)
    assert read_eval_set(str(tmp_path / "eval.jsonl")) == samples
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]  # no temp files left


def test_read_eval_set_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": "niah_single", "length": 1024, "prompt": "x", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2"):
        read_eval_set(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no samples"):
        read_eval_set(str(empty))
    with pytest.raises(ValueError, match="cannot open"):
        read_eval_set(str(tmp_path / "missing.jsonl"))
