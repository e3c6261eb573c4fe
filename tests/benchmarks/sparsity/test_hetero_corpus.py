"""benchmarks/make_hetero_corpus.py: sources, lengths, sidecar, determinism (in-process, no training)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

import make_hetero_corpus as mhc  # noqa: E402
from make_corpus import markov_chain  # noqa: E402


def _text(arr) -> bytes:
    return bytes(np.asarray(arr, dtype=np.uint8))


@pytest.mark.parametrize("length", [1, 37, 700])
def test_every_source_gives_exactly_the_length(length):
    rng = np.random.default_rng(0)
    lib = mhc.Stdlib()
    words, _ = markov_chain(rng)
    for doc in (mhc.code_doc(length, rng, lib), mhc.docs_doc(length, rng, lib),
                mhc.retrieval_doc(length, rng, words), mhc.copy_doc(length, rng)):
        assert doc.shape == (length,) and doc.min() >= 0 and doc.max() < 256


def test_retrieval_asks_for_a_needle_it_holds_and_copy_repeats():
    rng = np.random.default_rng(3)
    words, _ = markov_chain(rng)
    text = _text(mhc.retrieval_doc(2000, rng, words))
    q = text.rindex(b"What is the special magic number for ")
    key = text[q:].split(b"for ", 1)[1].split(b"?", 1)[0]
    value = text.rsplit(b" is: ", 1)[1].rstrip(b".")
    assert b"One of the special magic numbers for " + key + b" is: " + value + b". " in text[:q]
    assert text.count(b"special magic numbers for ") == 5  # 2000 // 400 needles
    copy = _text(mhc.copy_doc(1500, rng))
    period = next(p for p in range(32, 513) if copy[p:] == copy[:-p])
    assert copy[:period] * (1500 // period) == copy[: period * (1500 // period)]


def test_stdlib_sources_read_the_interpreters_files():
    lib = mhc.Stdlib()
    assert len(lib.files) > 100 and all(f.endswith(".py") and "site-packages" not in f for f in lib.files)
    code = _text(mhc.code_doc(3000, np.random.default_rng(1), lib))
    assert b"def " in code or b"class " in code or b"import " in code


def _make(prefix, *extra):
    return mhc.main(["--output-prefix", prefix, "--num-docs", "120", "--seq-length", "256", *extra])


def test_corpus_sidecar_matches_the_data_and_is_deterministic(tmp_path, capsys):
    from megatron.training.indexed_io import open_dataset

    a, b, c = (str(tmp_path / n) for n in "abc")
    assert _make(a) == 0
    summary = json.loads(capsys.readouterr().out)
    assert _make(b) == 0 and _make(c, "--seed", "1") == 0
    capsys.readouterr()
    side = json.load(open(a + "_sources.json"))
    ds = open_dataset(a)
    lengths = np.asarray(ds.sequence_lengths)
    assert side["lengths"] == lengths.tolist() and len(side["doc_source"]) == len(ds) == 120
    assert set(side["doc_source"]) == set(mhc.SOURCES)  # 120 uniform draws over 5: all present
    assert summary["docs_per_source"] == {s: side["doc_source"].count(s) for s in mhc.SOURCES}
    assert summary["tokens"] == int(lengths.sum()) and lengths.max() <= 256
    for ext in (".bin", ".idx", "_sources.json"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()
    assert open(a + ".bin", "rb").read() != open(c + ".bin", "rb").read()


def test_sources_flag_restricts_the_mix(tmp_path, capsys):
    assert _make(str(tmp_path / "x"), "--sources", "copy,retrieval") == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["docs_per_source"]) == {"copy", "retrieval"} and out["checkpoint"] is None
