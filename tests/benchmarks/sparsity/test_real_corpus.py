"""benchmarks/make_real_corpus.py on a tiny byte-level BPE tokenizer: exact token lengths, sidecar,
determinism, skipped sources, RULER-style documents kept whole (in-process)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

import make_real_corpus as mrc  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A directory holding a 400-token byte-level BPE tokenizer.json (as a converted model's hf/)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lib = mrc._stdlib_files()
    tok.train_from_iterator([mrc.Csv().text(np.random.default_rng(0), 4000), lib.text(np.random.default_rng(1), 20000)],
                            trainer)
    d = tmp_path_factory.mktemp("hf")
    tok.save(str(d / "tokenizer.json"))
    return str(d)


def test_lengths_map_quantiles_to_the_ends_and_keep_order():
    src = np.exp(np.random.default_rng(0).normal(7.5, 1.0, 5000)).astype(np.int64) + 1
    out = mrc.scaled_lengths(src, 4000, 1024, 8192, (0.05, 0.95), np.random.default_rng(1))
    assert out.min() == 1024 and out.max() == 8192
    assert 0.02 < np.mean(out == 1024) < 0.09 and 0.02 < np.mean(out == 8192) < 0.09
    assert 1024 * 2.2 < np.median(out) < 1024 * 3.6  # the log-midpoint of 1K..8K is ~2.9K


def test_cut_to_tokens_is_exact(tokenizer_dir):
    count, offsets, _ = mrc.tokenizer_fns(tokenizer_dir)
    text = mrc.Json().text(np.random.default_rng(2), 5000)
    for n in (1, 17, 300):
        assert count(mrc.cut_to_tokens(text, n, count, offsets)) == n
    assert mrc.cut_to_tokens("short", 1000, count, offsets) is None


def _make(prefix, tokenizer_dir, *extra):
    return mrc.main(["--tokenizer-model", tokenizer_dir, "--output-prefix", prefix, "--num-docs", "10",
                     "--min-length", "800", "--max-length", "1600", "--seed", "3", *extra])


def test_corpus_is_exact_deterministic_and_tagged(tmp_path, tokenizer_dir, capsys):
    from megatron.training.indexed_io import open_dataset

    sources = "code,niah,multikey,repeat,csv,json,pydoc"
    assert _make(str(tmp_path / "a"), tokenizer_dir, "--sources", sources) == 0
    summary = json.loads(capsys.readouterr().out)
    side = json.loads((tmp_path / "a_sources.json").read_text())
    ds = open_dataset(str(tmp_path / "a"))
    lengths = [int(x) for x in ds.sequence_lengths]
    assert side["lengths"] == lengths and len(lengths) == summary["documents"] == 10
    for src, n, target in zip(side["doc_source"], lengths, side["target_lengths"]):
        # exact, or (a RULER-style document whose search found no exact length) just below
        assert n == target or (src in mrc.RULER_TASKS and 0.98 * target <= n < target)
    assert summary["at_target_length"] >= 8 and all(800 * 0.98 <= n <= 1600 for n in lengths)
    assert len(set(side["doc_source"])) >= 4 and set(side["doc_source"]) <= set(sources.split(","))
    rows = [json.loads(x) for x in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rows] == side["doc_source"]
    ratios = np.load(tmp_path / "a_compression.npy")  # preprocess_data.py's feature sidecar
    assert ratios.shape == (10,) and all(0 < c < 1.2 for c in ratios)
    for r in rows:  # a RULER-style document keeps its question and the asked needle's value
        if r["source"] in mrc.RULER_TASKS:
            key = r["text"].rsplit("special magic number for ", 1)[1].split(" ")[0]
            value = r["text"].rstrip("\n").rsplit(" ", 1)[1]
            assert value.isdigit() and key in r["text"][:r["text"].index("What")] and value in r["text"][:-20]
    from megatron.training.doc_features import compression_ratio

    rep = mrc.Repeat(mrc._stdlib_files()).text(np.random.default_rng(4), 20000)
    assert compression_ratio(rep) < 0.5 * compression_ratio(mrc.Csv().text(np.random.default_rng(4), 20000))
    assert _make(str(tmp_path / "b"), tokenizer_dir, "--sources", sources) == 0
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


def test_a_source_the_machine_lacks_is_skipped_with_a_note(tmp_path, tokenizer_dir, capsys, monkeypatch):
    monkeypatch.setattr(mrc.glob, "glob", lambda *a, **k: [])  # no licences, NEWS or man pages here
    assert _make(str(tmp_path / "c"), tokenizer_dir, "--sources", "licence,man,csv", "--num-docs", "3") == 0
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["skipped"]) == {"licence", "man"} and summary["docs_per_source"] == {"csv": 3}
    with pytest.raises(SystemExit) as e:
        _make(str(tmp_path / "d"), tokenizer_dir, "--sources", "licence,man")
    assert e.value.code == 1 and "none of --sources" in capsys.readouterr().err


def test_preprocess_takes_a_tokenizer_directory(tmp_path, tokenizer_dir):
    import preprocess_data

    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x\n"}) + "\n")
    assert preprocess_data.main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "d"),
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]) == 0
    with pytest.raises(SystemExit) as e:
        preprocess_data.main(["--input", str(tmp_path / "d.jsonl"), "--output-prefix", str(tmp_path / "e"),
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)])
    assert e.value.code == 2
