"""Scoring of answers and aggregation into accuracy tables.

Two scoring modes (the model-facing code is in :mod:`benchmarks.harness.longctx.runner`):

* **exact match** of the decoded answer span: the model's greedy continuation
  of the prompt, cut at the first :data:`~benchmarks.harness.longctx.tasks.ANSWER_END`
  (or end of generation), must equal the gold answer exactly (no
  normalisation beyond that cut: the generators fix the format). Chance level
  is essentially 0 (a 7-digit number, a list of names, ...).
* **answer-span likelihood**: the gold answer and the sample's distractors
  (same format, wrong) are scored by the model's log-likelihood of
  ``answer + ANSWER_END`` after the prompt; the sample counts as correct only
  if the gold scores strictly higher than every distractor (ties are wrong, so
  a model that ignores its input cannot score by tie-breaking). Chance level
  is ``1 / (1 + num_distractors)`` (0.25 with the default 3 distractors) for a
  model whose scores carry no information about which candidate is right
  (the generators give every distractor the gold's format and, except for
  ``freq_words``' coded words, its length, so a model that only knows the
  format cannot beat it by preferring shorter answers); report it next to the
  accuracy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

from benchmarks.harness.longctx.tasks import ANSWER_END, TASKS

MODES = ("greedy", "generate", "loglik")
"""Scoring modes: exact match of greedy decoding (teacher-forced or generated), likelihood."""


def answer_span(generated: str) -> str:
    """The answer span of a continuation: everything before the first ANSWER_END."""
    return generated.split(ANSWER_END, 1)[0]


def exact_match(generated: str, gold: str) -> bool:
    """True iff the answer span of ``generated`` equals ``gold``."""
    return answer_span(generated) == gold


def choice_correct(gold_score: float, distractor_scores: Sequence[float]) -> bool:
    """Likelihood mode: gold strictly above every distractor (ties are wrong)."""
    if not distractor_scores:
        raise ValueError("distractor_scores must not be empty")
    return all(gold_score > s for s in distractor_scores)


def chance_level(mode: str, num_candidates: int = 4) -> float:
    """Accuracy of an uninformed model: 0 for exact match, 1/candidates for likelihood."""
    if mode == "loglik":
        if num_candidates < 2:
            raise ValueError(f"num_candidates must be >= 2, got {num_candidates}")
        return 1.0 / num_candidates
    if mode in MODES:
        return 0.0
    raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")


@dataclass(frozen=True)
class Result:
    """Outcome of one sample."""

    task: str
    """Task name."""
    length: int
    """Requested context length of the sample (tokens)."""
    correct: bool
    """Whether the sample was answered correctly."""
    prediction: str = ""
    """What the model answered (decoded span; the best candidate in loglik mode)."""
    token_accuracy: float | None = None
    """Greedy mode: fraction of the answer's tokens (and its terminator) that are the
    argmax given the gold prefix (teacher forcing). Graded where exact match is all or
    nothing, so it shows retrieval being learned before whole answers come out right
    (chance: about 1/10 per digit, 1/26 per letter). None in the other modes."""
    digit_accuracy: float | None = None
    """Greedy mode: the same over the answer tokens that are digits only, i.e. the
    retrieved values themselves (chance 0.1), without the easy separators and
    terminator. None in the other modes and for answers without digits."""
    answer_hits: tuple[bool, ...] | None = None
    """Greedy mode: per answer token (the terminator last), whether its argmax given the
    gold prefix is right. Where a model goes wrong inside an answer: e.g. a needle's
    first digit right and the next ones not says the needle was found and its value
    copied by position rather than by content. None in the other modes."""


def accuracy_table(results: Iterable[Result]) -> dict[str, dict[int, dict[str, float]]]:
    """``{task: {length: {"accuracy", "correct", "n"}}}`` over the results, plus
    ``"token_accuracy"`` and ``"digit_accuracy"`` (means) in cells whose results all
    carry one, and ``"position_accuracy"`` (per answer position, the mean of
    ``answer_hits``) in cells whose results all carry hits of one length."""
    cells: dict[str, dict[int, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        cells[r.task][r.length].append(r)

    def cell(rs: list[Result]) -> dict[str, float]:
        c = sum(r.correct for r in rs)
        out = {"accuracy": c / len(rs), "correct": c, "n": len(rs)}
        for key in ("token_accuracy", "digit_accuracy"):
            vals = [getattr(r, key) for r in rs]
            if None not in vals:
                out[key] = sum(vals) / len(vals)
        hits = [r.answer_hits for r in rs]
        if None not in hits and len({len(h) for h in hits}) == 1:
            out["position_accuracy"] = [sum(col) / len(col) for col in zip(*hits)]
        return out

    order = {t: i for i, t in enumerate(TASKS)}
    return {t: {n: cell(rs) for n, rs in sorted(cells[t].items())}
            for t in sorted(cells, key=lambda t: order.get(t, len(order)))}


def mean_token_accuracy(table: dict, key: str = "token_accuracy") -> float | None:
    """Unweighted mean of the cells' ``token_accuracy`` (or ``key``, e.g.
    ``"digit_accuracy"``); None unless every cell has one."""
    vals = [c.get(key) for row in table.values() for c in row.values()]
    if not vals or any(v is None for v in vals):
        return None
    return sum(vals) / len(vals)


def mean_accuracy(table: dict, lengths: Iterable[int] | None = None,
                  tasks: Iterable[str] | None = None) -> float:
    """Unweighted mean over (task, length) cells, optionally restricted.

    Raises ValueError when the restriction selects no cell (rather than
    returning a number that measured nothing).
    """
    keep_l = set(lengths) if lengths is not None else None
    keep_t = set(tasks) if tasks is not None else None
    cells = [c["accuracy"] for t, row in table.items() if keep_t is None or t in keep_t
             for n, c in row.items() if keep_l is None or n in keep_l]
    if not cells:
        raise ValueError("no (task, length) cell matches the selection")
    return sum(cells) / len(cells)


def format_table(table: dict, key: str = "accuracy") -> str:
    """Plain-text table of one cell metric (``accuracy``, or e.g. ``digit_accuracy``):
    one row per task that has it, one column per length, plus the row's mean."""
    lengths = sorted({n for row in table.values() for n in row})
    head = ["task"] + [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths] + ["mean"]
    rows = [head]
    for t, row in table.items():
        vals = {n: c[key] for n, c in row.items() if key in c}
        if not vals:
            continue
        cells = [f"{vals[n]:.3f}" if n in vals else "-" for n in lengths]
        rows.append([t] + cells + [f"{sum(vals.values()) / len(vals):.3f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)
