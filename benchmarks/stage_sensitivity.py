#!/usr/bin/env python
"""Per-stage sparsity sensitivity of a converted model: the loss a pipeline stage's layers pay
per (query, key) pair their budget drops, the profile ``--sb-stage-sensitivity`` reads.

For each ``--pp`` P, the model's layers are split over P stages as evenly as they go (the
first stages take the extra layer; ``benchmarks/harness/compare/real_arms.stage_of``). On each
calibration document, every layer runs block top-K (``--topk``, DST's k0) except one
stage's, which runs at the smallest budget (``--topk-min``, default K/2) and then at the
largest (``--topk-max``, default 2K): two forwards per stage. A stage's sensitivity is the
secant over DST's whole budget range, summed over the documents::

    nats_per_pair[s] = sum_docs (loss_min - loss_max) / sum_docs (pairs_max - pairs_min)

``loss``: summed next-token cross entropy over each document's second half (nats, as
``benchmarks/real_accuracy.py`` scores); ``pairs``: kept (query, key) pairs of one head summed
over the stage's layers (the planner's unit). Calibration documents come from
``--data-path`` in order, one per source in turn (the ``_sources.json`` sidecar; in corpus
order without one), at least ``--min-length`` tokens, cut to ``--max-length``; a document
sharing a 64-token run with any document of ``--exclude-data-path`` (the scored corpus) is
skipped, so a profile is never fitted on the data it is judged on.

Output (``--out``, written atomically; ``sparsebalance.tuning.stage_sensitivity`` reads it)::

    {"format": "sb-stage-sensitivity", "version": 1, "num_layers": N, "block_size": B,
     "topk": K, "topk_min": KMIN, "topk_max": KMAX,
     "profiles": [{"stages": P, "layer_ranges": [[first, last], ...] (1-based),
                   "nats_per_pair": [...], "loss_delta": [...], "pairs_delta": [...]}, ...],
     "documents": [{"index", "source", "tokens", "loss_delta": {P: [...]}}, ...], ...}

Tiny CPU run (``make real-model`` first; ~1 minute)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stage_sensitivity.py --load runs/models/smollm2-135m \\
        --data-path runs/real/corpus --num-documents 1 --min-length 1024 --max-length 1024 --pp 2 --out /tmp/stage.json

The profile of ``results/stage_sensitivity.json`` (16 minutes on one core)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/stage_sensitivity.py --load runs/models/smollm2-135m \\
        --data-path runs/real/corpus --exclude-data-path runs/real-accuracy/corpus --pp 4,8 \\
        --threads 1 --out results/stage_sensitivity.json

GPU: the same command with ``--max-length 16384`` and the fine-tuned checkpoint's ``--load``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402

PROG = "stage_sensitivity.py"
SHINGLE = 64
"""Tokens of the shortest run two documents may share before a calibration document is skipped."""


def fail(message: str, code: int = 2) -> NoReturn:
    usage_error(message, prog=PROG, code=code)


def log(message: str) -> None:
    print(f"[stage_sensitivity] {message}", file=sys.stderr, flush=True)


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="converted checkpoint (model_flags.txt, hf/)")
    p.add_argument("--data-path", required=True, help="calibration corpus prefix (.bin/.idx)")
    p.add_argument("--exclude-data-path", default=None,
                   help="corpus prefix whose documents must not calibrate (the scored one)")
    p.add_argument("--pp", default="4,8", help="stage counts to profile (comma-separated)")
    p.add_argument("--num-documents", type=int, default=6, help="calibration documents")
    p.add_argument("--min-length", type=int, default=1536, help="shortest calibration document (tokens)")
    p.add_argument("--max-length", type=int, default=2048, help="documents are cut to this many tokens")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--topk", type=int, default=8, help="budget of the other stages (DST's k0)")
    p.add_argument("--topk-min", type=int, default=None, help="the cut budget (default K/2)")
    p.add_argument("--topk-max", type=int, default=None, help="the raised budget (default 2K)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="profile JSON (written atomically)")
    return p


def check_args(a) -> None:
    if not os.path.isfile(os.path.join(a.load, "model_flags.txt")):
        fail(f"--load: {a.load} has no model_flags.txt (make real-model writes runs/models/smollm2-135m)")
    for flag, prefix in (("--data-path", a.data_path), ("--exclude-data-path", a.exclude_data_path)):
        if prefix is not None and not os.path.isfile(prefix + ".idx"):
            fail(f"{flag}: {prefix}.idx does not exist")
    a.topk_min = a.topk // 2 if a.topk_min is None else a.topk_min
    a.topk_max = 2 * a.topk if a.topk_max is None else a.topk_max
    for name in ("num_documents", "min_length", "max_length", "block_size", "topk"):
        if getattr(a, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= a.topk_min < a.topk_max:
        fail(f"need 0 <= --topk-min < --topk-max, got {a.topk_min} and {a.topk_max}")
    if a.min_length > a.max_length:
        fail("--min-length must be <= --max-length")
    try:
        a.pp = [int(x) for x in a.pp.split(",") if x.strip()]
    except ValueError:
        fail(f"--pp: expected comma-separated integers, got {a.pp!r}")
    if not a.pp or min(a.pp) < 1:
        fail("--pp: stage counts must be >= 1")


def _shingles(tokens) -> set:
    t = [int(x) for x in tokens]
    return {hash(tuple(t[i:i + SHINGLE])) for i in range(0, max(len(t) - SHINGLE + 1, 0))}


def calibration_documents(a) -> list:
    """[(index, source, tokens)] of the calibration documents (module docstring)."""
    import numpy as np

    from megatron.training import quiet_optional_extras

    quiet_optional_extras()  # megatron-core's notices about optional extras are not actionable here
    from megatron.training.indexed_io import open_dataset

    try:
        ds = open_dataset(a.data_path)
        excluded = None if a.exclude_data_path is None else open_dataset(a.exclude_data_path)
    except ValueError as e:
        fail(str(e))
    seen = set()
    if excluded is not None:
        for i in range(len(excluded)):
            seen |= _shingles(excluded[i])
    side = a.data_path + "_sources.json"
    src = [None] * len(ds)
    if os.path.isfile(side):
        with open(side) as f:
            got = json.load(f).get("doc_source")
        if not isinstance(got, list) or len(got) != len(ds):
            fail(f"--data-path: {side} does not list one source per document")
        src = got
    lengths = np.asarray(ds.sequence_lengths)
    order = list(dict.fromkeys(src))  # sources in order of first appearance
    queues = {s: [i for i in range(len(ds)) if src[i] == s and lengths[i] >= a.min_length] for s in order}
    picked, skipped = [], 0
    while len(picked) < a.num_documents and any(queues.values()):
        for s in order:
            while queues[s] and len(picked) < a.num_documents:
                i = queues[s].pop(0)
                tokens = np.asarray(ds[i][:a.max_length], dtype=np.int64)
                t = [int(x) for x in tokens]
                if any(hash(tuple(t[j:j + SHINGLE])) in seen for j in range(0, len(t) - SHINGLE + 1, SHINGLE)):
                    skipped += 1
                    continue
                picked.append((i, s, tokens))
                break
    if len(picked) < a.num_documents:
        where = " not in --exclude-data-path" if excluded is not None else ""
        fail(f"--data-path: only {len(picked)} documents of >= {a.min_length} tokens{where} "
             f"(need --num-documents {a.num_documents})")
    a.skipped_overlapping = skipped
    return picked


def probe(a, model, docs) -> dict:
    """Two forwards per (stage count, stage, document); the profile of the module docstring."""
    import numpy as np
    import torch

    from benchmarks.harness.compare.real_arms import Arm, stage_of, topk_pairs
    from benchmarks.real_accuracy import attention_modules, forward, scored_loss, set_arm

    cores = attention_modules(model)
    L = len(cores)
    profiles, per_doc = [], [{"index": int(i), "source": s, "tokens": int(len(t)), "loss_delta": {}}
                             for i, s, t in docs]
    if max(a.pp) > L:
        fail(f"--pp {max(a.pp)}: the model has only {L} layers")
    t0 = time.time()
    for P in a.pp:
        layers_of = [[x for x in range(1, L + 1) if stage_of(x, L, P) == s] for s in range(P)]
        dloss, dpairs = np.zeros((len(docs), P)), np.zeros((len(docs), P))
        with torch.no_grad():
            for j, (_, _, tokens) in enumerate(docs):
                cu = torch.tensor([0, len(tokens)], dtype=torch.int32)
                tok = torch.as_tensor(tokens)
                for s in range(P):
                    loss = {}
                    for k in (a.topk_min, a.topk_max):
                        budgets = np.full((1, P), a.topk)
                        budgets[0, s] = k
                        set_arm(cores, Arm(f"stage{s}-k{k}", stage_budgets=budgets), 0)
                        loss[k] = scored_loss(forward(model, tok, cu), tok, cu, "second-half")[0]
                    dloss[j, s] = loss[a.topk_min] - loss[a.topk_max]
                    dpairs[j, s] = len(layers_of[s]) * (topk_pairs([len(tokens)], a.topk_max, a.block_size)
                                                        - topk_pairs([len(tokens)], a.topk_min, a.block_size))
                per_doc[j]["loss_delta"][str(P)] = dloss[j].tolist()
                log(f"PP={P} document {j + 1}/{len(docs)} ({docs[j][1]}, {len(tokens)} tokens) "
                    f"{time.time() - t0:.0f} s: loss(kmin) - loss(kmax) per stage "
                    + " ".join(f"{x:+.3f}" for x in dloss[j]))
        pairs = dpairs.sum(axis=0)
        profiles.append({"stages": P, "layer_ranges": [[r[0], r[-1]] for r in layers_of],
                         "nats_per_pair": np.divide(dloss.sum(axis=0), pairs, out=np.zeros(P),
                                                    where=pairs > 0).tolist(),
                         "loss_delta": dloss.sum(axis=0).tolist(), "pairs_delta": pairs.tolist()})
    return {"num_layers": L, "profiles": profiles, "documents": per_doc, "seconds": time.time() - t0}


def main(argv=None) -> int:
    from benchmarks.real_accuracy import open_model

    a = build_parser().parse_args(argv)
    check_args(a)
    docs = calibration_documents(a)
    a.seq_length, a.lengths = a.max_length, []
    model = open_model(a)
    try:
        got = probe(a, model, docs)
    finally:
        model.close()
    out = {"format": "sb-stage-sensitivity", "version": 1, "block_size": a.block_size,
           "topk": a.topk, "topk_min": a.topk_min, "topk_max": a.topk_max, **got,
           "calibration": {"data_path": a.data_path, "exclude_data_path": a.exclude_data_path,
                           "skipped_overlapping": a.skipped_overlapping, "min_length": a.min_length,
                           "max_length": a.max_length, "loss_tokens": "second-half"},
           "command": "benchmarks/stage_sensitivity.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    from sparsebalance.io import atomic_write_text

    atomic_write_text(a.out, json.dumps(out, indent=1) + "\n")
    print(json.dumps({p["stages"]: p["nats_per_pair"] for p in out["profiles"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
