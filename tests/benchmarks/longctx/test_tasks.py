"""Task generators: deterministic, answers recoverable by string search, lengths on target."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from benchmarks.harness.longctx import text as T
from benchmarks.harness.longctx.tasks import (
    ALL_TASKS,
    ANSWER_END,
    LENGTH_TOLERANCE,
    MIN_LENGTH,
    TASKS,
    Sample,
    TaskConfig,
    generate,
    generate_set,
)

LENGTHS = (1024, 2048, 4096, 16384)


def _question(s: Sample) -> tuple[str, str]:
    """(context, question): the question is the prompt's last line."""
    context, _, question = s.prompt.rpartition("\n")
    assert context and (question.endswith("Answer: ") or question.endswith(" are: ")
                        or re.search(r"The special magic number for \S+ is: $", question)), question
    return context, question


def _only(pattern: str, text: str) -> list[str]:
    return re.findall(pattern, text)


def solve(s: Sample) -> str:
    """Answer each task by plain string search in the context (no generator internals)."""
    context, question = _question(s)
    if s.task in ("niah_single", "niah_multikey"):
        key = re.search(r"magic number for (\S+) mentioned", question).group(1)
        hits = _only(re.escape(f"The special magic number for {key} is: ") + r"(\d+)\.", context)
        assert len(hits) == 1, hits
        return hits[0]
    if s.task == "niah_multivalue":
        key = re.search(r"magic numbers for (\S+) mentioned", question).group(1)
        hits = _only(re.escape(f"special magic numbers for {key} is: ") + r"(\d+)\.", context)
        assert len(hits) >= 2
        return ", ".join(hits)
    if s.task == "variable_tracking":
        value = re.search(r"assigned the value (\d+) ", question).group(1)
        names = _only(r"VAR ([A-Z]{5}) = " + value + r"\.", context)
        assert len(names) == 1
        while True:
            nxt = _only(r"VAR ([A-Z]{5}) = VAR " + names[-1] + r"\.", context)
            assert len(nxt) <= 1
            if not nxt:
                return " ".join(names)
            names.append(nxt[0])
    if s.task == "freq_words":
        k = int(re.search(r"What are the (\d+) most frequent", question).group(1))
        body = context.split("\n", 1)[1]
        ranked = Counter(body.split(" ")).most_common()
        # The answer must be unique: strictly separated counts down to rank k + 1.
        counts = [c for _, c in ranked[:k + 1]]
        assert all(a > b for a, b in zip(counts, counts[1:])), counts
        return " ".join(w for w, _ in ranked[:k])
    if s.task == "repeat":
        return context.split("\n")[-1]  # filler, then the code
    if s.task == "recall":  # the one run of digits and capitals in lowercase prose
        hits = _only(r"(?<![0-9A-Za-z])[0-9A-Z]{8,}(?![0-9A-Za-z])", context)
        assert len(hits) == 1, hits
        return hits[0]
    if s.task == "recite":  # the keys are asked in the prompt and the answer; values from the context
        keys = [re.search(r"magic number for (\S+) is: $", question).group(1)]
        keys += re.findall(r"magic number for (\S+) is: ", s.answer)
        values = []
        for key in keys:
            hits = _only(re.escape(f"The special magic number for {key} is: ") + r"(\d+)\.", context)
            assert len(hits) == 1, hits
            values.append(hits[0])
        return " ".join([values[0] + "."] + [f"The special magic number for {k} is: {v}."
                                             for k, v in zip(keys[1:], values[1:])])
    if s.task == "copy":
        hits = _only(r"The secret code is: ([0-9a-z]+)\.", context)
        assert len(hits) == 1, hits
        return hits[0]
    raise AssertionError(s.task)


@pytest.mark.parametrize("task", ALL_TASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_answer_recoverable_by_string_search(task, length):
    for i in range(3):
        s = generate(task, length, seed=7, index=i)
        assert s.task == task and s.length == length
        assert solve(s) == s.answer


@pytest.mark.parametrize("task", ALL_TASKS)
@pytest.mark.parametrize("length", LENGTHS)
def test_length_within_tolerance(task, length):
    for i in range(3):
        n = len(generate(task, length, seed=3, index=i).text.encode("utf-8"))  # byte tokens
        assert length - LENGTH_TOLERANCE <= n <= length


@pytest.mark.parametrize("task", ALL_TASKS)
def test_deterministic_and_seed_sensitive(task):
    a = generate(task, 2048, seed=11, index=5)
    assert a == generate(task, 2048, seed=11, index=5)
    others = [generate(task, 2048, seed=12, index=5), generate(task, 2048, seed=11, index=6),
              generate(task, 2048, seed=11, index=5, split="train")]
    assert all(o.prompt != a.prompt and o.answer != a.answer for o in others)


def test_generate_set_order_and_answers_vary():
    samples = generate_set(TASKS, (1024, 2048), 4, seed=0)
    assert [(s.task, s.length) for s in samples] == [
        (t, n) for t in TASKS for n in (1024, 2048) for _ in range(4)]
    for t in TASKS:  # not a constant answer per task (guards the shuffle tests too)
        assert len({s.answer for s in samples if s.task == t}) == 8


@pytest.mark.parametrize("task", ALL_TASKS)
def test_distractors_are_distinct_wrong_answers(task):
    cfg = TaskConfig(num_distractors=3)
    for i in range(10):
        s = generate(task, 1024, seed=1, index=i, config=cfg)
        assert len(s.distractors) == 3
        assert len(set(s.distractors) | {s.answer}) == 4


def test_ascii_only_and_terminator_only_at_the_end():
    for s in generate_set(ALL_TASKS, (1024,), 2, seed=5):
        assert s.text.isascii()
        assert ANSWER_END not in s.answer and s.text.endswith(s.answer + ANSWER_END)


def test_recall_code_sits_at_varying_depths():
    # Unlike repeat (code right before the request), the code's position varies, so
    # copying cannot be anchored to the request.
    gaps = set()
    for i in range(20):
        s = generate("recall", 1024, seed=3, index=i)
        assert 16 <= len(s.answer) <= 32
        gaps.add(len(s.prompt) - s.prompt.index(s.answer))
    assert max(gaps) - min(gaps) > 300, sorted(gaps)


@pytest.mark.parametrize("task", ("niah_single", "niah_multikey"))
def test_needle_prompt_ends_with_the_queried_needles_words(task):
    # The answer prefix restates the needle of the asked key, so the value follows the
    # same characters in the context and at the end of the prompt (RULER-style prefix).
    for i in range(5):
        s = generate(task, 1024, seed=2, index=i)
        key = re.search(r"magic number for (\S+) mentioned", s.prompt).group(1)
        prefix = f"The special magic number for {key} is: "
        assert s.prompt.endswith(prefix)
        assert prefix + s.answer + "." in s.prompt[:-len(prefix)]


def test_vocabularies_cannot_collide():
    filler = set(T.FILLER_WORDS)
    assert not filler & set(T.KEY_ADJECTIVES) and not filler & set(T.KEY_NOUNS)
    assert not any(c.isdigit() or c == "-" for w in filler for c in w)


def test_config_changes_structure():
    s = generate("niah_multikey", 2048, seed=0, config=TaskConfig(num_keys=6))
    context, _ = _question(s)
    assert context.count("The special magic number for") == 6
    s = generate("variable_tracking", 2048, seed=0, config=TaskConfig(vt_chains=3, vt_hops=5))
    assert len(re.findall(r"VAR [A-Z]{5} = ", s.prompt)) == 15 and len(s.answer.split()) == 5


@pytest.mark.parametrize("kwargs, name", [
    (dict(task="nope", length=1024), "task"),
    (dict(task="niah_single", length=MIN_LENGTH - 1), "length"),
    (dict(task="niah_single", length=1024.0), "length"),
])
def test_bad_arguments_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        generate(seed=0, **kwargs)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="fw_vocab"):
        TaskConfig(fw_vocab=3, fw_top=3)
    with pytest.raises(ValueError, match="num_keys"):
        TaskConfig(num_keys=0)


def test_too_small_for_task_raises():
    with pytest.raises(ValueError, match="too small"):
        generate("niah_multikey", MIN_LENGTH, seed=0, config=TaskConfig(num_keys=20))


def test_sample_dict_roundtrip_and_validation():
    s = generate("freq_words", 1024, seed=2)
    assert Sample.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown task"):
        Sample.from_dict({**s.to_dict(), "task": "x"})
    with pytest.raises(ValueError, match="missing"):
        Sample.from_dict({"task": "freq_words"})


def test_recite_asks_back_every_needle_in_a_shuffled_order():
    firsts = set()
    for length in (256, 1024, 4096):
        for i in range(5):
            s = generate("recite", length, seed=4, index=i)
            in_context = re.findall(r"magic number for (\S+) is: \d+\.", _question(s)[0])
            asked = [re.search(r"for (\S+) is: $", s.prompt).group(1)]
            asked += re.findall(r"for (\S+) is: ", s.answer)
            assert len(in_context) == max(1, length // 200) == len(set(in_context))
            assert sorted(asked) == sorted(in_context)
            firsts.add(in_context.index(asked[0]))
    assert len(firsts) > 3, firsts  # the first key asked is not always the same needle


def test_copy_is_training_only_and_its_code_is_random():
    train_only = {"copy", "repeat", "recall", "recite"}
    assert train_only.isdisjoint(TASKS) and train_only <= set(ALL_TASKS)
    codes = [generate("copy", 1024, seed=2, index=i, split="train").answer for i in range(20)]
    assert len(set(codes)) == 20 and all(len(c) == TaskConfig().copy_chars for c in codes)
    assert len(generate("copy", 1024, seed=2, config=TaskConfig(copy_chars=8)).answer) == 8
