"""Running a language model on the evaluation samples.

The model is seen through one function, ``logits_fn(seqs) -> logits``: it takes
a list of token sequences (int64 ``[T_i]``) and returns their next-token logits
(``[T_i, V]``, position ``t`` predicting token ``t + 1``), each sequence
attending only within itself (the tool packs them as THD documents). That keeps
this module free of Megatron and testable with toy models.

Modes (see :mod:`benchmarks.harness.longctx.scoring` for what counts as correct):

* ``greedy``: exact match of greedy decoding, computed with ONE forward pass of
  ``prompt + answer + ANSWER_END`` (teacher forcing): greedy decoding
  reproduces the gold span exactly iff at every answer position the argmax
  equals the gold token (given the gold prefix, which is what greedy decoding
  would have produced so far), and the terminator follows. Equal to ``generate``
  up to floating-point differences between a long and a short forward pass.
* ``generate``: real autoregressive greedy decoding (one forward per new token,
  no KV cache): slow, for checking ``greedy`` and for reading the outputs.
* ``loglik``: answer-span log-likelihood of gold vs distractors, one packed
  forward of all candidates per sample.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import torch

from benchmarks.harness.longctx.scoring import MODES, Result, choice_correct, exact_match
from benchmarks.harness.longctx.tasks import ANSWER_END, Sample
from benchmarks.harness.longctx.tokenizer import Tokenizer, eod_id

LogitsFn = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""``[T_i]`` int64 token sequences -> ``[T_i, V]`` next-token logits each."""


def _ids(tok: Tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tok.encode(text), dtype=torch.long)


def score_greedy(sample: Sample, logits_fn: LogitsFn, tok: Tokenizer) -> Result:
    """Exact match of greedy decoding via one teacher-forced forward pass."""
    prompt, target = _ids(tok, sample.prompt), _ids(tok, sample.answer + ANSWER_END)
    seq = torch.cat([prompt, target[:-1]])
    logits = logits_fn([seq])[0]
    pred = logits[len(prompt) - 1:].argmax(dim=-1)
    hit = pred == target
    eod = eod_id(tok)
    if eod is not None:  # end-of-document also ends the answer
        hit[-1] |= bool(pred[-1] == eod)
    ok = bool(hit.all())
    # Greedy decoding's output up to (and including) its first deviation.
    n = len(target) if ok else int((~hit).nonzero()[0]) + 1
    shown = torch.cat([target[:n - 1], pred[n - 1:n]]) if not ok else target
    digits = torch.tensor([tok.decode([t]).strip().isdigit() for t in target.tolist()])
    return Result(sample.task, sample.length, ok, tok.decode(shown.tolist()),
                  token_accuracy=float(hit.float().mean()),
                  digit_accuracy=float(hit[digits].float().mean()) if digits.any() else None,
                  answer_hits=tuple(bool(h) for h in hit))


def score_generate(sample: Sample, logits_fn: LogitsFn, tok: Tokenizer,
                   max_new_tokens: Optional[int] = None) -> Result:
    """Exact match of real greedy decoding (stops at ANSWER_END or eod)."""
    end = tok.encode(ANSWER_END)
    if len(end) != 1:
        raise ValueError("ANSWER_END must be a single token")
    stops = {end[0]} | ({eod_id(tok)} - {None})
    budget = max_new_tokens if max_new_tokens is not None else len(tok.encode(sample.answer)) + 8
    seq = _ids(tok, sample.prompt)
    out: list[int] = []
    for _ in range(budget):
        nxt = int(logits_fn([seq])[0][-1].argmax())
        if nxt in stops:
            break
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([nxt])])
    text = tok.decode(out)
    return Result(sample.task, sample.length, exact_match(text, sample.answer), text)


def candidate_logliks(sample: Sample, candidates: Sequence[str], logits_fn: LogitsFn,
                      tok: Tokenizer) -> list[float]:
    """Sum of log-probabilities of ``candidate + ANSWER_END`` after the prompt, per candidate."""
    prompt = _ids(tok, sample.prompt)
    targets = [_ids(tok, c + ANSWER_END) for c in candidates]
    logits = logits_fn([torch.cat([prompt, t[:-1]]) for t in targets])
    out = []
    for lg, t in zip(logits, targets):
        lp = torch.log_softmax(lg[len(prompt) - 1:].double(), dim=-1)
        out.append(float(lp.gather(1, t.view(-1, 1)).sum()))
    return out


def score_loglik(sample: Sample, logits_fn: LogitsFn, tok: Tokenizer) -> Result:
    """Gold vs distractors by answer-span log-likelihood (ties count as wrong)."""
    if not sample.distractors:
        raise ValueError(f"sample of task {sample.task} has no distractors for loglik scoring")
    cands = [sample.answer, *sample.distractors]
    scores = candidate_logliks(sample, cands, logits_fn, tok)
    best = max(range(len(cands)), key=lambda i: scores[i])
    return Result(sample.task, sample.length, choice_correct(scores[0], scores[1:]), cands[best])


def evaluate(samples: Iterable[Sample], logits_fn: LogitsFn, tok: Tokenizer, mode: str = "greedy",
             *, max_new_tokens: Optional[int] = None,
             progress: Optional[Callable[[int, Result], None]] = None) -> list[Result]:
    """Score every sample in ``mode``; ``progress(i, result)`` is called after each."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    out = []
    with torch.no_grad():
        for i, s in enumerate(samples):
            if mode == "greedy":
                r = score_greedy(s, logits_fn, tok)
            elif mode == "generate":
                r = score_generate(s, logits_fn, tok, max_new_tokens)
            else:
                r = score_loglik(s, logits_fn, tok)
            out.append(r)
            if progress is not None:
                progress(i, r)
    return out
