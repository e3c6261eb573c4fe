"""SAB's per-document features (source and compression sidecars) and the per-segment pairs
the driver all-reduces from the attention records."""

import json
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.training.doc_features import (
    _read_sidecars,
    compression_ratio,
    segment_pairs,
    write_compression,
)
from sparsebalance.attention.packed import AttentionRecord


def test_compression_ratio_tells_repetition_from_prose():
    assert compression_ratio("abc" * 2000) < 0.05 < compression_ratio("The quick brown fox jumps over it.")
    assert compression_ratio("") == 1.0


def test_sidecars_read_back_and_are_checked(tmp_path):
    prefix = str(tmp_path / "d")
    src, comp = _read_sidecars(prefix, 3, blended=True)  # none written: the prefix names the source
    assert list(src) == ["d"] * 3 and np.isnan(comp).all()
    write_compression(prefix, [0.5, 0.25, 0.125])
    with open(prefix + "_sources.json", "w") as fh:
        json.dump({"doc_source": ["a", "b", "a"], "lengths": [1, 2, 3]}, fh)
    src, comp = _read_sidecars(prefix, 3, blended=False)
    assert list(src) == ["a", "b", "a"], src
    assert comp.tolist() == [0.5, 0.25, 0.125], comp
    with pytest.raises(ValueError, match="needs a 'doc_source' list of 4"):
        _read_sidecars(prefix, 4, blended=False)  # the sidecars describe another dataset


def _packing():
    # dp 2, M 2: rank 1 holds micro-batches [(doc 5, 100), (doc 6, 50)] and [(doc 7, 200)]
    ranks = [[[(0, 0, 10)], [(1, 0, 20)]], [[(5, 0, 100), (6, 0, 50)], [(7, 0, 200)]]]
    return SimpleNamespace(ranks=ranks, step=3)


def test_segment_pairs_places_this_ranks_records():
    heads = 2
    c = lambda L: L * (L + 1) // 2 * heads  # noqa: E731
    recs = [
        AttentionRecord(1, 0, 8, kept_pairs=300, causal_pairs=c(100) + c(50), doc_lengths=(100, 50),
                        doc_kept_pairs=(200, 100)),
        AttentionRecord(2, 0, 8, kept_pairs=100, causal_pairs=c(100) + c(50), doc_lengths=(100, 50),
                        doc_kept_pairs=(60, 40)),
        AttentionRecord(1, 1, 8, kept_pairs=999, causal_pairs=c(200) + c(56), doc_lengths=(200, 56)),  # + padding
        AttentionRecord(3, 1, None, kept_pairs=c(200), causal_pairs=c(200), doc_lengths=(200,)),  # dense layer
    ]
    kept, causal = segment_pairs(_packing(), 1, recs)
    assert kept[:2].tolist() == [0, 0] and causal[:2].tolist() == [0, 0]  # rank 0's segments
    assert kept[2:4].tolist() == [260, 140]
    assert causal[2:4].tolist() == [2 * c(100), 2 * c(50)]
    # no per-document counts (context parallelism): the record's pairs, shared by causal pairs
    # over all its documents, the padding segment's share dropped
    assert causal[4] == c(200) and kept[4] == pytest.approx(999 * c(200) / (c(200) + c(56)))
    with pytest.raises(ValueError, match="micro-batch 0"):
        segment_pairs(_packing(), 1, [AttentionRecord(1, 0, 8, 1, 10, doc_lengths=(99, 50))])
