"""Scoring: gold answers score 100%, shuffled answers 0%, in every mode.

The model-facing modes are driven by a toy "memorising" language model: it
predicts the next character of the one text it memorised for a prompt (and
noise elsewhere), so whatever answer it memorised is what greedy decoding
produces and what the likelihood mode prefers.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from benchmarks.harness.longctx.runner import evaluate
from benchmarks.harness.longctx.scoring import (
    Result,
    accuracy_table,
    answer_span,
    chance_level,
    choice_correct,
    exact_match,
    format_table,
    mean_accuracy,
    mean_token_accuracy,
)
from benchmarks.harness.longctx.tasks import ANSWER_END, TASKS, generate_set
from benchmarks.harness.longctx.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def samples():
    return generate_set(TASKS, (1024, 2048), 2, seed=42)


def deranged_answers(samples) -> list[str]:
    """Each sample gets another sample's answer of the same task (a rotation)."""
    by_task = defaultdict(list)
    for i, s in enumerate(samples):
        by_task[s.task].append(i)
    out = [""] * len(samples)
    for idx in by_task.values():
        assert len(idx) >= 2
        for a, b in zip(idx, idx[1:] + idx[:1]):
            out[a] = samples[b].answer
    # Guard against a vacuous pass: every answer really changed.
    assert all(w != s.answer for w, s in zip(out, samples))
    return out


class MemorisingLM:
    """Toy LM: follows the memorised continuation of the prompt, noise elsewhere."""

    KEY = 400  # prompt prefix (characters) that identifies a sample

    def __init__(self, texts: list[str], vocab: int = 256):
        self.texts = {t[:self.KEY].encode(): np.frombuffer(t.encode(), dtype=np.uint8) for t in texts}
        assert len(self.texts) == len(texts), "prompts must differ within the key prefix"
        self.bigram = torch.rand(vocab, vocab, generator=torch.Generator().manual_seed(0))  # < 1

    def __call__(self, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self._one(s) for s in seqs]

    def _one(self, seq: torch.Tensor) -> torch.Tensor:
        logits = self.bigram[seq]  # [T, V] (a copy)
        ids = seq.numpy().astype(np.uint8)
        text = self.texts.get(ids[:self.KEY].tobytes())
        if text is None:
            return logits
        n = min(len(text), len(ids))
        diff = np.flatnonzero(text[:n] != ids[:n])
        lcp = int(diff[0]) if len(diff) else n
        # Position t predicts token t+1; it follows the text while seq[:t+1] matches it.
        t = torch.arange(min(lcp, len(text) - 1))
        logits[t, torch.from_numpy(text[1:].astype(np.int64))[t]] = 10.0
        return logits


def test_exact_match_rules():
    assert exact_match("1234567", "1234567")
    assert exact_match("1234567" + ANSWER_END + "junk", "1234567")
    assert not exact_match("1234567 ", "1234567")
    assert not exact_match("123456", "1234567")
    assert answer_span("a b" + ANSWER_END + "c") == "a b"


def test_string_scoring_gold_is_perfect_and_shuffled_is_zero(samples):
    assert all(exact_match(s.answer + ANSWER_END, s.answer) for s in samples)
    wrong = deranged_answers(samples)
    assert not any(exact_match(w + ANSWER_END, s.answer) for w, s in zip(wrong, samples))


@pytest.mark.parametrize("mode", ["greedy", "generate"])
def test_decoding_modes_gold_100_shuffled_0(samples, mode):
    if mode == "generate":  # one forward per generated token: keep it to the 1K samples
        samples = [s for s in samples if s.length == 1024]
    gold = MemorisingLM([s.text for s in samples])
    res = evaluate(samples, gold, TOK, mode)
    assert all(r.correct for r in res)
    assert [r.prediction for r in res] == [s.answer + ANSWER_END if mode == "greedy" else s.answer
                                           for s in samples]
    wrong = deranged_answers(samples)
    lm = MemorisingLM([s.prompt + w + ANSWER_END for s, w in zip(samples, wrong)])
    assert not any(r.correct for r in evaluate(samples, lm, TOK, mode))


def test_loglik_gold_100_distractor_0(samples):
    res = evaluate(samples, MemorisingLM([s.text for s in samples]), TOK, "loglik")
    assert all(r.correct for r in res) and [r.prediction for r in res] == [s.answer for s in samples]
    believes = MemorisingLM([s.prompt + s.distractors[0] + ANSWER_END for s in samples])
    res = evaluate(samples, believes, TOK, "loglik")
    assert not any(r.correct for r in res)
    assert [r.prediction for r in res] == [s.distractors[0] for s in samples]


def test_greedy_equals_generate_on_a_mixed_model(samples):
    """Teacher-forced greedy scoring agrees with real decoding, right and wrong alike."""
    wrong = deranged_answers(samples)
    texts = [s.prompt + (s.answer if i % 2 else w) + ANSWER_END
             for i, (s, w) in enumerate(zip(samples, wrong))]
    lm = MemorisingLM(texts)
    a = [r.correct for r in evaluate(samples, lm, TOK, "greedy")]
    b = [r.correct for r in evaluate(samples, lm, TOK, "generate")]
    assert a == b and sum(a) == len(samples) // 2


def test_greedy_token_accuracy_counts_answer_tokens_right_given_the_gold_prefix(samples):
    s = next(x for x in samples if x.task == "niah_single")
    target = s.answer + ANSWER_END
    prompt_len, end = len(TOK.encode(s.prompt)), TOK.encode(ANSWER_END)[0]

    def knows_3_chars_and_the_end(seqs):
        """Right on the first 3 answer tokens and the terminator, token 0 in between."""
        out = []
        for seq in seqs:
            lg = torch.zeros(len(seq), 256)
            lg[torch.arange(len(seq) - 1), seq[1:]] = 1.0  # the gold next token ...
            lg[prompt_len - 1 + 3:len(seq) - 1] = 0.0
            lg[prompt_len - 1 + 3:len(seq) - 1, 0] = 1.0  # ... except answer tokens 4.. get byte 0
            lg[-1, end] = 1.0
            out.append(lg)
        return out

    res = evaluate([s], knows_3_chars_and_the_end, TOK, "greedy")[0]
    assert not res.correct and res.token_accuracy == pytest.approx((3 + 1) / len(target))
    n_digits = sum(c.isdigit() for c in s.answer)
    assert n_digits == 7 and s.answer[:3].isdigit()  # the value: 3 digits right, the terminator not counted
    assert res.digit_accuracy == pytest.approx(3 / n_digits)
    assert res.answer_hits == (True,) * 3 + (False,) * (len(target) - 4) + (True,)
    other = evaluate([s], MemorisingLM([s.text]), TOK, "greedy")[0]
    pos = accuracy_table([res, other])[s.task][s.length]["position_accuracy"]
    assert pos == [1.0] * 3 + [0.5] * (len(target) - 4) + [1.0]
    assert other.token_accuracy == 1.0
    assert evaluate([s], MemorisingLM([s.text]), TOK, "loglik")[0].token_accuracy is None
    table = accuracy_table([res, Result(s.task, s.length, True, token_accuracy=1.0)])
    cell = table[s.task][s.length]
    assert cell["accuracy"] == 0.5 and cell["token_accuracy"] == pytest.approx((4 / len(target) + 1) / 2)
    assert mean_token_accuracy(table) == pytest.approx(cell["token_accuracy"])
    assert mean_token_accuracy(accuracy_table([Result(s.task, s.length, True)])) is None
    assert "digit_accuracy" not in cell and "position_accuracy" not in cell  # the second result carries none


def test_digit_accuracy_is_none_for_answers_without_digits(samples):
    words = next(x for x in samples if x.task == "freq_words")
    assert not any(c.isdigit() for c in words.answer)
    res = evaluate([words], MemorisingLM([words.text]), TOK, "greedy")[0]
    assert res.correct and res.token_accuracy == 1.0 and res.digit_accuracy is None
    needle = next(x for x in samples if x.task == "niah_single")
    both = evaluate([needle], MemorisingLM([needle.text]), TOK, "greedy") + [res]
    table = accuracy_table(both)
    assert table["niah_single"][needle.length]["digit_accuracy"] == 1.0
    assert "digit_accuracy" not in table["freq_words"][words.length]
    assert mean_token_accuracy(table, "digit_accuracy") is None  # not every cell has one
    shown = format_table(table, "digit_accuracy").splitlines()
    assert len(shown) == 2 and shown[1].split()[0] == "niah_single" and shown[1].split()[-1] == "1.000"
    assert [r.split()[0] for r in format_table(table).splitlines()[1:]] == ["niah_single", "freq_words"]


def test_uninformed_model_is_not_rewarded_by_ties(samples):
    def flat(seqs):
        return [torch.zeros(len(s), 256) for s in seqs]

    assert not any(r.correct for r in evaluate(samples, flat, TOK, "loglik"))
    assert not any(r.correct for r in evaluate(samples, flat, TOK, "greedy"))


def test_choice_and_chance():
    assert choice_correct(-1.0, [-2.0, -3.0])
    assert not choice_correct(-1.0, [-1.0, -3.0])
    assert chance_level("loglik", 4) == 0.25 and chance_level("greedy") == 0.0
    with pytest.raises(ValueError, match="mode"):
        chance_level("beam")
    with pytest.raises(ValueError, match="distractor_scores"):
        choice_correct(0.0, [])


def test_accuracy_table_and_mean():
    res = [Result("niah_single", 1024, True), Result("niah_single", 1024, False),
           Result("niah_single", 4096, True), Result("freq_words", 4096, False)]
    table = accuracy_table(res)
    assert list(table) == ["niah_single", "freq_words"]
    assert table["niah_single"][1024] == {"accuracy": 0.5, "correct": 1, "n": 2}
    assert mean_accuracy(table) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert mean_accuracy(table, lengths=[4096]) == pytest.approx(0.5)
    assert mean_accuracy(table, tasks=["niah_single"], lengths=[4096]) == 1.0
    with pytest.raises(ValueError, match="no"):
        mean_accuracy(table, lengths=[8192])
    text = format_table(table)
    assert "1K" in text and "4K" in text and "niah_single" in text


def test_unknown_mode_raises(samples):
    with pytest.raises(ValueError, match="mode"):
        evaluate(samples[:1], MemorisingLM([samples[0].text]), TOK, "beam")
