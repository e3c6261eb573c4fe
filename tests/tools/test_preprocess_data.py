"""tools/preprocess_data.py with Megatron-LM's flags, and tools/dataset_lengths.py.

The files must not depend on --workers / --partitions --keep-sequential-samples, and must
equal what megatron-core's IndexedDatasetBuilder writes when fed the same tokens the way
Megatron-LM's tool feeds it (one sequence per document, an empty document for a text
without tokens, the tokenizer's eos after each non-empty document with --append-eod).
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from tools import _preprocess_encode, dataset_lengths, preprocess_data

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A word-level Hugging Face tokenizer built offline, with </s> as its eos_token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tok")
    vocab = {w: i for i, w in enumerate(["[UNK]", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(d)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 documents with two keys; some texts are empty (no tokens)."""
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(rng.choice(WORDS, size=int(rng.integers(0, 40)))),
             "title": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 4))))} for _ in range(300)]
    path = tmp_path_factory.mktemp("in") / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sum(not r["text"] for r in rows) >= 3 and len(rows) > 100  # empty documents are exercised
    return str(path), rows


def _run(corpus, tokenizer_dir, prefix, *extra):
    argv = ["--input", corpus[0], "--output-prefix", str(prefix), "--json-keys", "text", "title",
            "--append-eod", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
            *extra]
    assert preprocess_data.main(argv) == 0


def _files(prefix, key):
    return [open(f"{prefix}_{key}_document{ext}", "rb").read() for ext in (".bin", ".idx", "_compression.npy")]


def test_workers_and_partitions_write_megatron_cores_files(corpus, tokenizer_dir, tmp_path):
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import Tokenizer

    _run(corpus, tokenizer_dir, tmp_path / "one")
    _run(corpus, tokenizer_dir, tmp_path / "two", "--workers", "2")
    _run(corpus, tokenizer_dir, tmp_path / "parts", "--workers", "2", "--partitions", "2",
         "--keep-sequential-samples")
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eod = tok.token_to_id("</s>")
    for key in ("text", "title"):
        ref = str(tmp_path / f"ref_{key}")
        builder = IndexedDatasetBuilder(ref + ".bin", dtype=DType.optimal_dtype(tok.get_vocab_size()))
        for row in corpus[1]:
            ids = tok.encode(row[key]).ids
            ids = ids + [eod] if ids else ids
            builder.add_document(np.asarray(ids), [len(ids)] if ids else [])
        builder.finalize(ref + ".idx")
        want = [open(ref + ext, "rb").read() for ext in (".bin", ".idx")]
        one = _files(tmp_path / "one", key)
        assert one[:2] == want, key
        assert _files(tmp_path / "two", key) == one
        assert _files(tmp_path / "parts", key) == one
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]  # no temporary left behind


def test_round_robin_partitions_deal_lines_as_megatron_lm(corpus, tokenizer_dir, tmp_path):
    """Without --keep-sequential-samples, line i goes to part i % P and parts are merged in
    order (Megatron-LM's meaning): part 0 holds lines 0, 2, 4, ..."""
    _run(corpus, tokenizer_dir, tmp_path / "rr", "--workers", "2", "--partitions", "2")
    got = dataset_lengths.dataset_lengths([str(tmp_path / "rr_title_document")])
    want = [len(r["title"].split()) + 1 for r in corpus[1]]
    assert got == want[0::2] + want[1::2] and got != want


def test_dataset_lengths_feed_the_simulator(corpus, tokenizer_dir, tmp_path):
    """One length per non-empty document, in order; the batching CLI reads the file."""
    from sparsebalance.batching.cli import read_lengths

    _run(corpus, tokenizer_dir, tmp_path / "d")
    out = tmp_path / "lengths.json"
    assert dataset_lengths.main(["--data-path", str(tmp_path / "d_text_document"), "--output", str(out)]) == 0
    want = [len(r["text"].split()) + 1 for r in corpus[1] if r["text"]]
    assert json.loads(out.read_text()) == want
    assert read_lengths(str(out)).tolist() == want


def test_sentence_level_dataset_groups_sentences_by_document(corpus, tokenizer_dir, tmp_path, monkeypatch):
    """--split-sentences: one sequence per sentence, the eod on a document's last one, the
    index's document boundaries around each document's sentences (splitter stubbed: nltk's
    punkt is not what is tested)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    class EveryThreeWords:
        def tokenize(self, text):
            w = text.split()
            return [" ".join(w[i:i + 3]) for i in range(0, len(w), 3)]

    monkeypatch.setattr(_preprocess_encode, "load_splitter", lambda lang, keep: EveryThreeWords())
    _run(corpus, tokenizer_dir, tmp_path / "s", "--split-sentences")
    ds = IndexedDataset(str(tmp_path / "s_text_sentence"))
    n_words = [len(r["text"].split()) for r in corpus[1]]
    want = [[3] * (n // 3) + ([n % 3] if n % 3 else []) for n in n_words]
    want = [w[:-1] + [w[-1] + 1] if w else w for w in want]  # eod on the last sentence
    assert ds.sequence_lengths.tolist() == [x for w in want for x in w]
    assert np.diff(ds.document_indices).tolist() == [len(w) for w in want]
    assert not os.path.exists(tmp_path / "s_text_sentence_compression.npy")  # per document, not per sentence


@pytest.mark.skipif(importlib.util.find_spec("nltk") is not None, reason="nltk is installed here")
def test_split_sentences_without_nltk_is_one_line(corpus, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        preprocess_data.main(["--input", corpus[0], "--output-prefix", str(tmp_path / "x"), "--split-sentences"])
    assert e.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "nltk" in lines[0]
    assert not list(tmp_path.iterdir())


def test_null_tokenizer_text_is_ids_and_eod_is_vocab_size(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    (tmp_path / "ids.jsonl").write_text('{"text": "5 0 9"}\n{"text": "7"}\n')
    assert preprocess_data.main(["--input", str(tmp_path / "ids.jsonl"), "--output-prefix", str(tmp_path / "n"),
                                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "10", "--append-eod"]) == 0
    ds = IndexedDataset(str(tmp_path / "n_text_document"))  # Megatron-LM's name without --json-keys
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 0, 9, 10], [7, 10]]
