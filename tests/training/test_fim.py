"""``--fim-data`` (Megatron-LM's fill-in-the-middle transform, ``megatron/training/fim.py``):
segments between EOD tokens rearranged as PSM / SPM with sentinels, EODs and document
lengths kept, the same document reading the same way in any chunking; and a run with it."""

import numpy as np
import pytest
from conftest import PRETRAIN, TINY, summary_of

from megatron.training.fim import FIMConfig, FIMDocuments, fim_document, sentinel_id
from megatron.training.tokenizer import ByteTokenizer

PRE, MID, SUF, PAD, EOD = 1, 2, 3, 4, 0
TEXT = b"the quick brown fox jumps over the lazy dog"


def _config(rate=1.0, spm=0.5) -> FIMConfig:
    return FIMConfig(rate, spm, PRE, MID, SUF, PAD, EOD)


def _unscramble(seg: np.ndarray, spm: bool) -> bytes:
    """The segment's text put back in order (PSM: P p S s M m; SPM: P S s M p m)."""
    s = seg.tolist()
    i_s, i_m = s.index(SUF), s.index(MID)
    assert s[0] == PRE and (not spm or i_s == 1)
    if spm:
        return bytes(s[i_m + 1:]) + bytes(s[2:i_m])  # prefix + middle, then the suffix
    return bytes(s[1:i_s]) + bytes(s[i_m + 1:]) + bytes(s[i_s + 1:i_m])


@pytest.mark.parametrize("spm", [0.0, 1.0])
def test_every_segment_rearranged_and_recoverable(spm):
    doc = np.array([*TEXT, EOD, *TEXT[:20], EOD, *TEXT[5:]], dtype=np.int64)
    for seed in range(20):
        out = fim_document(doc, ByteTokenizer(), _config(spm=spm), np.random.RandomState(seed))
        assert len(out) == len(doc) and out.dtype == np.int64
        # 3 sentinels more per segment: the last segment's end is cut, the first two come back whole
        eods = np.flatnonzero(out == EOD)
        assert len(eods) >= 2
        first, second = out[:eods[0]], out[eods[0] + 1:eods[1]]
        assert _unscramble(first, bool(spm)) == TEXT and _unscramble(second, bool(spm)) == TEXT[:20]


def test_rate_zero_is_identity_and_short_results_are_padded():
    doc = np.array([*TEXT, EOD, *TEXT], dtype=np.int64)
    np.testing.assert_array_equal(fim_document(doc, ByteTokenizer(), _config(rate=0.0),
                                               np.random.RandomState(0)), doc)

    class Shrinking(ByteTokenizer):  # re-encoding can come out shorter (merges): pad to length
        def encode(self, text):
            return list(text.replace("o", "").encode())

    out = fim_document(doc, Shrinking(), _config(), np.random.RandomState(0))
    assert len(out) == len(doc) and out[-1] == PAD


def test_documents_read_the_same_in_any_chunking():
    class Docs:
        sequence_lengths = np.array([len(TEXT)] * 3)

        def __len__(self):
            return 3

        def get(self, idx, offset=0, length=None):
            d = np.array(list(TEXT), dtype=np.int64)
            return d[offset:] if length is None else d[offset:offset + length]

    fim = FIMDocuments(Docs(), ByteTokenizer(), _config())
    whole = fim.get(1)
    assert not np.array_equal(whole, Docs().get(1))
    np.testing.assert_array_equal(np.concatenate([fim.get(1, 0, 10), fim.get(1, 10, 7), fim.get(1, 17)]), whole)
    np.testing.assert_array_equal(FIMDocuments(Docs(), ByteTokenizer(), _config()).get(1), whole)
    assert fim.sequence_lengths is Docs.sequence_lengths  # lengths (and plans) unchanged


def test_run_with_fim_data_trains(world, corpus):
    sentinels = ["--fim-prefix-token", "\x01", "--fim-middle-token", "\x02", "--fim-suffix-token", "\x03",
                 "--fim-pad-token", "\x04", "--fim-eod-token", "\x00"]
    base = [*TINY, "--data-path", corpus, "--train-iters", "2"]
    plain = summary_of(world.launch(PRETRAIN, base, nproc=1))
    fim = summary_of(world.launch(PRETRAIN, [*base, "--fim-data", "--fim-rate", "0.9", "--fim-spm-rate", "0.5",
                                             *sentinels], nproc=1))
    assert np.all(np.isfinite(fim["losses"])) and fim["losses"] != plain["losses"]  # other tokens, same packing


def test_a_sentinel_must_be_one_token():
    with pytest.raises(ValueError, match="^--fim-prefix-token <fim_prefix>: not one token of the tokenizer"):
        sentinel_id(ByteTokenizer(), "--fim-prefix-token", "<fim_prefix>")
    assert sentinel_id(ByteTokenizer(), "--fim-pad-token", "\x04") == 4


def test_gpt2_maps_a_missing_sentinel_to_endoftext_as_megatron_lm(tmp_path):
    import json

    from megatron.training.tokenizer import GPT2BPETokenizer

    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2, "<fim_pad>": 3}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    tok, warned = GPT2BPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")), []
    assert sentinel_id(tok, "--fim-pad-token", "<fim_pad>", warned.append) == 3 and not warned
    assert sentinel_id(tok, "--fim-prefix-token", "<fim_prefix>", warned.append) == 2
    assert warned == ["--fim-prefix-token <fim_prefix> is not in the vocabulary: it is <|endoftext|> (id 2), "
                      "as Megatron-LM's GPT-2 tokenizer maps an unknown token"]
