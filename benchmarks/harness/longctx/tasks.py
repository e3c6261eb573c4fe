"""RULER-style synthetic long-context tasks over the byte-level tokenizer.

Five tasks (names as in :data:`TASKS`), each a prompt whose answer sits somewhere
in a long context and is asked for at the end:

* ``niah_single``: one key-value needle hidden in filler prose.
* ``niah_multikey``: several needles with different keys; one key is asked for.
* ``niah_multivalue``: one key with several values; all are asked for, in the
  order they appear.
* ``variable_tracking``: chains of assignments ``VAR A = 12345.``,
  ``VAR B = VAR A.`` ... mixed with distractor chains; the answer is every
  variable holding the queried value, in chain order.
* ``freq_words``: a stream of coded words with Zipf-like counts; the answer is
  the three most frequent ones, most frequent first (counts are strictly
  separated by construction, so the answer is unique).

A :class:`Sample` is fully determined by ``(task, length, seed, split, index)``:
its random stream is seeded by that string (Python's ``random.Random`` hashes a
string seed with SHA-512, so this does not depend on ``PYTHONHASHSEED``).

Lengths are in tokens of the byte tokenizer; all text is ASCII, so tokens =
characters. ``length`` bounds the whole training document ``prompt + answer +
ANSWER_END``; generated samples land in ``[length - LENGTH_TOLERANCE, length]``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterable

from benchmarks.harness.longctx import text as T

TASKS: tuple[str, ...] = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "variable_tracking",
    "freq_words",
)
"""Task names, in report order."""

TRAIN_ONLY_TASKS: tuple[str, ...] = ("copy", "repeat", "recall", "recite")
"""Tasks for training mixes only (not part of the evaluation suite):

* ``copy``: a random alphanumeric code hidden in filler, to be repeated at the
  end. Every answer token is a copy of the context, so it supervises locating a
  span and copying it ~5x more densely per document than a needle
  value; a warm-up aid for small models trained from scratch.
* ``repeat``: filler, then a random code of random length (digits and capitals), a
  one-line request, and the code again: the source right before the copy, at a
  distance that varies from sample to sample. Meant as the easiest content-based
  copying (a warm-up for the copying heads retrieval needs); measured: a small model
  learns it anchored to the request instead, which does not carry over to needles.
* ``recall``: the ``repeat`` code hidden at a random depth of the filler instead of
  right before the request, so the copy cannot be anchored to the request's
  position: the code has to be found by what it is (the only run of digits and
  capitals), as a needle's value has to be.
* ``recite``: needles of distinct keys (one per ~200 tokens) in filler, then every
  needle asked back in random order, each in the needle's own words (the prompt ends
  in the first one's answer prefix; the answer goes on with the rest). A needle task
  with one retrieval per needle instead of one per document: the answer is dense
  supervision for key-matching retrieval, as RULER's multi-query needles and the
  multi-query associative recall of the Zoology study (Arora et al., 2023).
"""

ALL_TASKS: tuple[str, ...] = TASKS + TRAIN_ONLY_TASKS
"""Every task :func:`generate` knows."""

ANSWER_END = "\n"
"""Terminator after the answer in training text; decoding stops at it."""

LENGTH_TOLERANCE = 32
"""Max shortfall (tokens) of a sample's length below the requested length."""

MIN_LENGTH = 256
"""Smallest context length accepted (tokens). Most tasks need about 1K: a task whose
text does not fit the length raises ValueError (short lengths are for the copy
warm-up of the long-context recipe)."""


@dataclass(frozen=True)
class Sample:
    """One task instance."""

    task: str
    """Task name (one of :data:`ALL_TASKS`)."""
    length: int
    """Requested context length in tokens (bounds ``len(text)``)."""
    prompt: str
    """Context and question; ends right where the answer starts."""
    answer: str
    """Gold answer span (no terminator)."""
    distractors: tuple[str, ...] = field(default=())
    """Wrong answers of the gold's format, for answer-span likelihood scoring."""

    @property
    def text(self) -> str:
        """The training document: ``prompt + answer + ANSWER_END``."""
        return self.prompt + self.answer + ANSWER_END

    def to_dict(self) -> dict:
        """JSON-serialisable form (inverse: :meth:`from_dict`)."""
        return {
            "task": self.task,
            "length": self.length,
            "prompt": self.prompt,
            "answer": self.answer,
            "distractors": list(self.distractors),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        """Build a sample from :meth:`to_dict` output; raises ValueError on bad fields."""
        try:
            s = cls(
                task=str(d["task"]),
                length=int(d["length"]),
                prompt=str(d["prompt"]),
                answer=str(d["answer"]),
                distractors=tuple(str(x) for x in d.get("distractors", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"sample: missing or bad field ({e})") from None
        if s.task not in ALL_TASKS:
            raise ValueError(f"sample: unknown task {s.task!r}")
        return s


@dataclass(frozen=True)
class TaskConfig:
    """Knobs of the task generators (defaults follow RULER's basic settings)."""

    num_keys: int = 4
    """niah_multikey: needles with distinct keys in one context."""
    num_values: int = 4
    """niah_multivalue: values of the one key."""
    value_digits: int = 7
    """Digits of a needle value."""
    vt_chains: int = 2
    """variable_tracking: chains in one context (1 queried, the rest distractors)."""
    vt_hops: int = 4
    """variable_tracking: variables per chain."""
    vt_value_digits: int = 5
    """variable_tracking: digits of a chain's value."""
    fw_top: int = 3
    """freq_words: number of most frequent words asked for."""
    fw_vocab: int = 60
    """freq_words: distinct coded words in one context."""
    fw_alpha: float = 1.0
    """freq_words: Zipf exponent of the word counts."""
    copy_chars: int = 32
    """copy: characters of the code (digits and lowercase letters)."""
    num_distractors: int = 3
    """Wrong candidates per sample for likelihood scoring (chance = 1/(n+1))."""

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "value_digits", "vt_chains", "vt_hops",
                     "vt_value_digits", "fw_top", "copy_chars", "num_distractors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.fw_vocab <= self.fw_top:
            raise ValueError(f"fw_vocab must exceed fw_top, got {self.fw_vocab} <= {self.fw_top}")
        if self.fw_alpha <= 0:
            raise ValueError(f"fw_alpha must be > 0, got {self.fw_alpha}")


_NEEDLE_HEADER = (
    "Some special magic numbers are hidden within the following text. "
    "Memorize them; you will be asked about them afterwards.\n"
)


def _distinct(rng: random.Random, n: int, make: Callable[[], str], exclude: Iterable[str] = ()) -> list[str]:
    """``n`` distinct strings from ``make()`` that are not in ``exclude``."""
    seen = set(exclude)
    out: list[str] = []
    for _ in range(1000 * n + 100):
        if len(out) == n:
            return out
        x = make()
        if x not in seen:
            seen.add(x)
            out.append(x)
    raise ValueError(f"could not draw {n} distinct values")


def _distractors(
    rng: random.Random, gold: str, proposals: Iterable[str], n: int, make: Callable[[], str]
) -> tuple[str, ...]:
    """``n`` distinct wrong answers: ``proposals`` first, then ``make()``."""
    out: list[str] = []
    for p in proposals:
        if p != gold and p not in out and len(out) < n:
            out.append(p)
    if n > len(out):
        out += _distinct(rng, n - len(out), make, [gold, *out])
    return tuple(out)


def _haystack(rng: random.Random, budget: int, inserts: list[str], task: str, length: int) -> str:
    """Filler prose of at most ``budget`` characters with ``inserts`` at random depths."""
    fill = budget - sum(len(s) + 1 for s in inserts)
    if fill < 0:
        raise ValueError(f"length {length} is too small for task {task}")
    return " ".join(T.insert_at_boundaries(rng, T.filler_sentences(rng, fill), inserts))


def _build(task: str, length: int, header: str, body: Callable[[int], str], question: str,
           answer: str, distractors: tuple[str, ...]) -> Sample:
    """Assemble ``header + body + question`` so the document fits ``length``."""
    budget = length - len(header) - len(question) - len(answer) - len(ANSWER_END)
    return Sample(task, length, header + body(budget) + question, answer, distractors)


def _needle_question(key: str) -> str:
    """The question about ``key``'s value, ending in an answer prefix that restates the query.

    As in RULER, whose prompts end with an answer prefix naming the queried key; ours
    repeats the needle's own words (``The special magic number for KEY is: ``), so the
    value follows the same characters in the needle and in the answer.
    """
    return (f"\nWhat is the special magic number for {key} mentioned in the text above? "
            f"The special magic number for {key} is: ")


def _niah_single(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    key, value = T.needle_key(rng), T.number(rng, cfg.value_digits)
    needle = f"The special magic number for {key} is: {value}."
    question = _needle_question(key)
    dis = _distractors(rng, value, (), cfg.num_distractors, lambda: T.number(rng, cfg.value_digits))
    return _build("niah_single", length, _NEEDLE_HEADER,
                  lambda b: _haystack(rng, b, [needle], "niah_single", length), question, value, dis)


def _niah_multikey(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    keys = _distinct(rng, cfg.num_keys, lambda: T.needle_key(rng))
    values = _distinct(rng, cfg.num_keys, lambda: T.number(rng, cfg.value_digits))
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    q = rng.randrange(cfg.num_keys)
    question = _needle_question(keys[q])
    # The other keys' values are the hardest wrong answers: they are in the context.
    others = [v for i, v in enumerate(values) if i != q]
    rng.shuffle(others)
    dis = _distractors(rng, values[q], others, cfg.num_distractors,
                       lambda: T.number(rng, cfg.value_digits))
    return _build("niah_multikey", length, _NEEDLE_HEADER,
                  lambda b: _haystack(rng, b, needles, "niah_multikey", length),
                  question, values[q], dis)


def _niah_multivalue(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    key = T.needle_key(rng)
    values = _distinct(rng, cfg.num_values, lambda: T.number(rng, cfg.value_digits))
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in values]
    question = (f"\nWhat are all the special magic numbers for {key} mentioned in the text "
                f"above, in order? The special magic numbers for {key} are: ")
    gold = ", ".join(values)

    def replace_one() -> str:
        vs = list(values)
        vs[rng.randrange(len(vs))] = T.number(rng, cfg.value_digits)
        return ", ".join(vs)

    proposals = [", ".join(values[1:] + values[:1]), ", ".join(reversed(values))]
    dis = _distractors(rng, gold, proposals, cfg.num_distractors, replace_one)
    return _build("niah_multivalue", length, _NEEDLE_HEADER,
                  lambda b: _haystack(rng, b, needles, "niah_multivalue", length), question, gold, dis)


def _variable_tracking(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    n_names = cfg.vt_chains * cfg.vt_hops
    names = _distinct(rng, n_names, lambda: T.variable_name(rng))
    chains = [names[c * cfg.vt_hops:(c + 1) * cfg.vt_hops] for c in range(cfg.vt_chains)]
    values = _distinct(rng, cfg.vt_chains, lambda: T.number(rng, cfg.vt_value_digits))
    stmts = [[f"VAR {ch[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(ch, ch[1:])]
             for ch, v in zip(chains, values)]
    # Random interleaving that keeps each chain's statements in order.
    order = [c for c in range(cfg.vt_chains) for _ in range(cfg.vt_hops)]
    rng.shuffle(order)
    nxt = [0] * cfg.vt_chains
    inserts = []
    for c in order:
        inserts.append(stmts[c][nxt[c]])
        nxt[c] += 1
    header = "Memorize and track the chains of variable assignments hidden in the following text.\n"
    question = (f"\nFind all variables that are assigned the value {values[0]} in the text above, "
                f"in order. Answer: ")
    gold = " ".join(chains[0])
    # Hard wrong answers of the gold's length (a shorter candidate, e.g. the chain
    # minus its last variable, would win on likelihood by length alone): the other
    # chains, and the queried chain ending in another chain's last variable.
    proposals = [" ".join(ch) for ch in chains[1:]]
    if cfg.vt_chains > 1:
        proposals.append(" ".join(chains[0][:-1] + chains[1][-1:]))
    dis = _distractors(rng, gold, proposals, cfg.num_distractors,
                       lambda: " ".join(T.variable_name(rng) for _ in range(cfg.vt_hops)))
    return _build("variable_tracking", length, header,
                  lambda b: _haystack(rng, b, inserts, "variable_tracking", length), question, gold, dis)


def _word_counts(words: list[str], budget: int, cfg: TaskConfig, length: int) -> list[int]:
    """Zipf-like counts (rank order of ``words``) filling ``budget`` characters.

    Counts of the top ``fw_top`` ranks are strictly decreasing and strictly above
    every other count, so the answer is unique.
    """
    top, sizes = cfg.fw_top, [len(w) + 1 for w in words]  # +1: the separating space
    weights = [1.0 / (r + 1) ** cfg.fw_alpha for r in range(len(words))]
    cap = budget + 1  # n words need sum(sizes) - 1 characters

    def counts_for(scale: float) -> list[int]:
        return [int(scale * w) for w in weights]

    lo, hi = 0.0, float(cap)
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(c * s for c, s in zip(counts_for(mid), sizes)) <= cap:
            lo = mid
        else:
            hi = mid
    counts = counts_for(lo)
    # Enforce strict separation of the top ranks, then trim / top up the tail.
    for r in range(top, len(counts)):
        counts[r] = min(counts[r], counts[top - 1] - 1)
    for r in range(top - 2, -1, -1):
        counts[r] = max(counts[r], counts[r + 1] + 1)
    if counts[top - 1] < 2:
        raise ValueError(f"length {length} is too small for task freq_words")
    used = sum(c * s for c, s in zip(counts, sizes))
    r = top
    while used > cap and r < len(counts):
        take = min(counts[r], -(-(used - cap) // sizes[r]))
        counts[r] -= take
        used -= take * sizes[r]
        r += 1
    if used > cap:
        raise ValueError(f"length {length} is too small for task freq_words")
    for r in range(top, len(counts)):  # top up the tail, still below rank top-1
        add = min(counts[top - 1] - 1 - counts[r], (cap - used) // sizes[r])
        if add > 0:
            counts[r] += add
            used += add * sizes[r]
    return counts


def _freq_words(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    words = _distinct(rng, cfg.fw_vocab, lambda: T.coded_word(rng))
    header = ("Read the following coded text and track the frequency of each coded word. "
              f"Find the {cfg.fw_top} most frequent coded words.\n")
    question = (f"\nWhat are the {cfg.fw_top} most frequent coded words in the text above, "
                f"most frequent first? Answer: ")
    gold = " ".join(words[:cfg.fw_top])

    def body(budget: int) -> str:
        counts = _word_counts(words, budget, cfg, length)
        stream = [w for w, c in zip(words, counts) for _ in range(c)]
        rng.shuffle(stream)
        return " ".join(stream)

    k = cfg.fw_top
    proposals = [" ".join(words[1:k + 1]), " ".join(reversed(words[:k])),
                 " ".join(words[k:2 * k])]
    dis = _distractors(rng, gold, proposals, cfg.num_distractors,
                       lambda: " ".join(rng.sample(words, k)))
    return _build("freq_words", length, header, body, question, gold, dis)


_CODE_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def _code(rng: random.Random, n: int, alphabet: str = _CODE_ALPHABET) -> str:
    """A random code of ``n`` characters (digits and lowercase letters by default)."""
    return "".join(rng.choice(alphabet) for _ in range(n))


def _copy(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    make = lambda: _code(rng, cfg.copy_chars)
    code = make()
    header = ("A secret code is hidden within the following text. "
              "Memorize it; you will be asked to repeat it afterwards.\n")
    needle = f"The secret code is: {code}."
    question = "\nWhat is the secret code mentioned in the text above? Answer: "
    dis = _distractors(rng, code, (), cfg.num_distractors, make)
    return _build("copy", length, header, lambda b: _haystack(rng, b, [needle], "copy", length),
                  question, code, dis)


_REPEAT_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""Digits and capitals: the filler before a repeat code is lowercase words, so a copying
head that matches on the previous token finds (almost) only code positions."""


_REPEAT_CUE = "\nRepeat the code above. Answer: "


def _repeat_code(rng: random.Random, length: int, cfg: TaskConfig):
    """A code of ``copy_chars // 2 .. copy_chars`` characters that fits twice in ``length``
    with the cue, the terminator and one separator before it; and its maker."""
    longest = (length - len(_REPEAT_CUE) - len(ANSWER_END) - 1) // 2
    n = rng.randint(min(cfg.copy_chars // 2, longest), min(cfg.copy_chars, longest))
    make = lambda: _code(rng, n, _REPEAT_ALPHABET)
    return make(), make


def _repeat(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    # The code's length is drawn per sample and filler pads the document in front of it,
    # so the distance from each answer token back to its source varies: copying must
    # match on content, not on a fixed offset. (With a fixed-length
    # code filling the document a model learned to repeat within ~100 steps but only at
    # the trained offset: at chance on 1,024-token documents after training at 256.
    # This version, too, was learned as a copy anchored to the request: see recall.)
    code, make = _repeat_code(rng, length, cfg)
    pad = T.filler_text(rng, length - 2 * len(code) - len(_REPEAT_CUE) - len(ANSWER_END) - 1)
    return Sample("repeat", length, pad + "\n" + code + _REPEAT_CUE, code,
                  _distractors(rng, code, (), cfg.num_distractors, make))


def _recall(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    code, make = _repeat_code(rng, length, cfg)
    return _build("recall", length, "", lambda b: _haystack(rng, b, [code], "recall", length),
                  _REPEAT_CUE, code, _distractors(rng, code, (), cfg.num_distractors, make))


_RECITE_QUESTION = "\nWhat are the special magic numbers mentioned in the text above? "

_RECITE_TOKENS_PER_NEEDLE = 200
"""recite: one needle per this many tokens of length (each costs ~110: needle + recital)."""


def _recite(rng: random.Random, length: int, cfg: TaskConfig) -> Sample:
    n = max(1, length // _RECITE_TOKENS_PER_NEEDLE)
    keys = _distinct(rng, n, lambda: T.needle_key(rng))
    values = _distinct(rng, n, lambda: T.number(rng, cfg.value_digits))
    needles = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
    order = list(range(n))
    rng.shuffle(order)  # asked back in an order unrelated to the context's
    first, rest = order[0], order[1:]
    question = _RECITE_QUESTION + f"The special magic number for {keys[first]} is: "

    def gold(vals: list[str]) -> str:
        return " ".join([vals[first] + "."] + [f"The special magic number for {keys[i]} is: {vals[i]}."
                                               for i in rest])

    def wrong() -> str:  # the context's values, assigned to the wrong keys
        vals = list(values)
        while n > 1 and vals == values:
            rng.shuffle(vals)
        if n <= 3:  # too few wrong assignments to draw from: one value made up, too
            vals[rng.randrange(n)] = T.number(rng, cfg.value_digits)
        return gold(vals)

    dis = _distractors(rng, gold(values), (), cfg.num_distractors, wrong)
    return _build("recite", length, "", lambda b: _haystack(rng, b, needles, "recite", length),
                  question, gold(values), dis)


_GENERATORS: dict[str, Callable[[random.Random, int, TaskConfig], Sample]] = {
    "niah_single": _niah_single,
    "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue,
    "variable_tracking": _variable_tracking,
    "freq_words": _freq_words,
    "copy": _copy,
    "repeat": _repeat,
    "recall": _recall,
    "recite": _recite,
}


def generate(task: str, length: int, seed: int, index: int = 0, *, split: str = "eval",
             config: TaskConfig | None = None) -> Sample:
    """One sample of ``task`` whose document fits ``length`` tokens.

    ``(task, length, seed, split, index)`` determine the sample; different
    ``split`` strings give independent streams (training vs held-out).
    """
    if task not in _GENERATORS:
        raise ValueError(f"task must be one of {', '.join(ALL_TASKS)}; got {task!r}")
    if not isinstance(length, int) or length < MIN_LENGTH:
        raise ValueError(f"length must be an int >= {MIN_LENGTH}, got {length!r}")
    rng = random.Random(f"{seed}:{split}:{task}:{length}:{index}")
    return _GENERATORS[task](rng, length, config or TaskConfig())


def generate_set(tasks: Iterable[str], lengths: Iterable[int], num_samples: int, seed: int, *,
                 split: str = "eval", config: TaskConfig | None = None) -> list[Sample]:
    """``num_samples`` samples per (task, length), ordered by task, length, index."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return [generate(t, int(n), seed, i, split=split, config=config)
            for t in tasks for n in lengths for i in range(num_samples)]
