"""Density under threshold routing, per document: its spread at equal length, by source,
the micro-batch cost spread it causes, how well it is predicted, and its drift over training.

On a ``pretrain_gpt.py`` checkpoint (``benchmarks/make_hetero_corpus.py --train-checkpoint``)
and a corpus with a source sidecar (``PREFIX_sources.json``), the model runs its dense
forward over ``--num-docs`` documents (packed, ``--microbatch-tokens`` tokens at most per
forward). A forward pre-hook on every layer's core attention takes q ``[T, H, D]`` and
k ``[T, Hkv, D]`` (as ``benchmarks/attention_recall.py`` does) and routes each document alone
with the kernels' shared plan under threshold routing
(``RoutingRule(threshold=--tau, topk_min=--topk-min)``, cap ``--topk``, block
``--block-size``). A document's density is its kept / causal (query, key) pairs summed
over heads and layers (= the mean over layers: every layer has the same causal pairs).
q and k come from the dense forward, so a layer's routing does not change the next
layer's input (as in ``benchmarks/attention_recall.py``).

Reported (one JSON object with ``--json``):

* ``cv_equal_length``: coefficient of variation (std / mean) of density among documents
  in the same log2 length bucket, averaged over buckets with >= 2 documents weighted by
  their documents; ``cv_equal_length_fine`` the same with 4 buckets per octave (lengths
  within 19%), ``cv_equal_length_by_source`` within each source;
* ``by_source``: mean density per source (``sources`` has documents, length, CV);
* ``microbatch_cost``: the measured documents packed in order into micro-batches of at
  most ``--microbatch-tokens`` tokens; per micro-batch the attention cost proxy
  ``sum density x L (L + 1) / 2`` (pairs per head: a proxy for attention time, not a
  measured latency) and its CV across micro-batches, against the same with each
  document's density replaced by its length bucket's mean (what a length-only balancer
  sees) and by the overall mean (``fixed``); ``cv_measured_over_length_only`` is the
  CV of the ratio, the spread a length-only balancer cannot see;
* ``estimator_mape``: :class:`sparsebalance.batching.sparsity_estimator.SparsityEstimator`
  fitted on the first half of the documents (the earlier ones) predicts the second
  half's densities from (source, length bucket); its mean absolute percentage error on
  the held-out micro-batches' attention cost (with ``estimator_mape_length_only`` and
  ``estimator_mape_constant`` as baselines);
* ``oracle``: the same spread if threshold routing saw the dense softmax mass instead of
  the block-mean gate (:func:`oracle_pairs`: the plan's rule with no cap or floor; also
  with a count per head, and with ``--tau`` of all the mass, sink and diagonal included):
  whether the model's attention is heterogeneous where the gate may not see it;
* ``drift``: mean density (overall and by source) on the first ``--drift-docs``
  documents at every iteration saved under ``--load``; null when there is one.

Tiny CPU run::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sparsity_study.py --load runs/hetero/ckpt \\
        --data-path data/hetero --num-docs 60 --json

The study (``docs/sparsity_study.md``)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sparsity_study.py --load runs/hetero/ckpt \\
        --data-path runs/hetero/corpus --tau 0.9 --topk 16 --topk-min 1 --block-size 32 \\
        --num-docs 300 --json --output results/sparsity_study.json

On a pretrained model converted by ``tools/checkpoint/convert.py`` (``--real``; what it
measures: :mod:`sparsity_real`, ``docs/real_study.md``): equal-length windows of a
``benchmarks/make_real_corpus.py`` corpus, a TAU sweep, per-head against per-block counts, the gate's
recall of the dense mass, and the loss a document gives up under top-k and threshold routing::

    # tiny CPU run (a few minutes): one document per source at 2K, no sensitivity
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sparsity_study.py --real --load runs/models/smollm2-135m \
        --data-path runs/real/corpus --lengths 2048 --docs-per-source 1 --sens-lengths none --json
    # the study (make real-study; <= 45 minutes on a quiet 2-core machine)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sparsity_study.py --real --load runs/models/smollm2-135m \
        --data-path runs/real/corpus --threads 2 --json --output results/real_study.json
    # one layer's q/k/v of real documents packed to 16K tokens, for bench_attention.py --qk
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sparsity_study.py --real --load runs/models/smollm2-135m \
        --data-path runs/real/corpus --dump-qk runs/qk/smollm2_layer15.pt --dump-tokens 16384

GPU cluster run (one GPU, PP=1 model): the same flags on the cluster's checkpoint and corpus
(``--real --lengths 8192,16384,32768`` for a model with that context).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import NoReturn

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from benchmarks.harness import sparsity_real  # noqa: E402
from benchmarks.harness.oracle import (  # noqa: E402,F401
    ORACLES,
    block_mass,
    oracle_from_mass,
    oracle_pairs,
    read_sidecar,  # noqa: E402
)
from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402
from sparsebalance.batching.sparsity_estimator import (  # noqa: E402
    LengthOnlyEstimator,
    SparsityEstimator,
    attention_cost,
    cv,
    cv_within_buckets,
    length_bucket,
    mape,
    pack_in_order,
)
from sparsebalance.io import atomic_write_text  # noqa: E402

quiet_optional_extras()

PROG = "sparsity_study.py"


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``sparsity_study.py: error:`` line on stderr, then exit ``code``."""
    usage_error(message, prog=PROG, code=code)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py --save")
    p.add_argument("--data-path", required=True, help="corpus prefix (.bin/.idx and _sources.json)")
    p.add_argument("--sources-file", default=None, help="default: DATA_PATH_sources.json")
    p.add_argument("--train-args", default=None,
                   help="pretrain_gpt.py flags, for checkpoints without them (default: the flags "
                        "benchmarks/make_hetero_corpus.py trained it with, from LOAD/hetero_corpus_train.json)")
    p.add_argument("--tau", type=float, default=0.9, help="threshold routing's TAU (gate softmax mass)")
    p.add_argument("--topk", type=int, default=None,
                   help="cap: most key blocks a query block keeps (default 16; --real: none)")
    p.add_argument("--topk-min", type=int, default=1, help="least key blocks a query block keeps")
    p.add_argument("--block-size", type=int, default=None, help="routing block (tokens; default 32, --real 64)")
    p.add_argument("--num-docs", type=int, default=300, help="documents measured (the first of --docs)")
    p.add_argument("--docs", choices=("valid", "all"), default="valid",
                   help="valid: the checkpoint's held-out split (--split), all: every document")
    p.add_argument("--microbatch-tokens", type=int, default=None, help="default: the checkpoint's seq length")
    p.add_argument("--drift-docs", type=int, default=100, help="documents measured at every saved iteration")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a summary")
    p.add_argument("--output", default=None, help="also write the JSON report here (atomically)")
    sparsity_real.add_args(p)
    return p


def check_args(args) -> None:
    """Input checks that need no model (exit 2)."""
    if not os.path.isdir(args.load):
        fail(f"--load: {args.load} is not a directory")
    for ext in (".bin", ".idx"):
        if not os.path.isfile(args.data_path + ext):
            fail(f"--data-path: {args.data_path + ext} does not exist")
    if not 0.0 < args.tau <= 1.0:
        fail(f"--tau must be in (0, 1], got {args.tau:g}")
    if args.real:
        sparsity_real.check_args(args, fail)
    elif args.dump_qk is not None:
        fail("--dump-qk needs --real (a converted pretrained model)")
    else:
        args.topk = 16 if args.topk is None else args.topk
        args.block_size = 32 if args.block_size is None else args.block_size
    if args.topk_min < 0 or (args.topk is not None and (args.topk < 1 or args.topk_min > args.topk)):
        fail(f"need 0 <= --topk-min <= --topk and --topk >= 1, got {args.topk_min} and {args.topk}")
    if args.num_docs < 4:
        fail("--num-docs must be >= 4 (half fit the estimator, half are held out)")
    for name in ("block_size", "microbatch_tokens", "drift_docs", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.output is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        fail(f"--output: directory of {args.output} does not exist")


def stamped_train_args(load: str):
    """The flags ``benchmarks/make_hetero_corpus.py`` trained ``load`` with (a string), or None."""
    import shlex

    from make_hetero_corpus import STAMP

    try:
        with open(os.path.join(load, STAMP)) as fh:
            flags = json.load(fh).get("flags")
    except (OSError, ValueError, AttributeError):
        return None
    return shlex.join(flags) if isinstance(flags, list) else None


def document_ids(args, model_args, n_docs: int) -> np.ndarray:
    from megatron.training import data as D
    from megatron.training.arguments import UsageError, _split

    if args.docs == "all":
        return np.arange(n_docs)
    try:
        ids = D.split_documents(n_docs, _split(model_args.split))[1]
    except UsageError as e:
        fail(str(e))
    if len(ids) < 4:
        fail(f"--docs valid: the checkpoint's valid split holds {len(ids)} of {n_docs} documents; "
             "use --docs all")
    return ids


def routed_pairs(q, k, cu, scale: float, block: int, cap: int, rule) -> tuple:
    """(kept, causal) pairs of each document, summed over heads: int64 ``[n_docs]`` arrays,
    of the packed documents of ``cu`` (q ``[T, H, D]``, k ``[T, Hkv, D]``) routed by the
    kernels' shared plan under ``rule`` with cap ``cap`` (routing never crosses documents,
    so each document's pairs are what it keeps alone)."""
    import torch

    from sparsebalance.ops.plan import build_plan, routing_rule

    cu = torch.as_tensor(cu, dtype=torch.int32)
    with routing_rule(rule):
        plan = build_plan(q, k, cu, cap, block, scale)
    lens = np.diff(cu.numpy()).astype(np.int64)
    return plan.doc_kept, lens * (lens + 1) // 2 * q.shape[1]


def measure(model, dataset, ids, args, tokens: int, oracle: bool = False):
    """Density of each document in ``ids`` under the threshold rule (kept / causal over
    layers); with ``oracle``, also ``{variant: density}`` of :func:`oracle_pairs`."""
    import torch

    from sparsebalance.attention.dense import CausalVarlenAttention
    from sparsebalance.ops.plan import RoutingRule, default_scale

    rule = RoutingRule(threshold=args.tau, topk_min=args.topk_min)
    kept = np.zeros(len(ids))
    causal = np.zeros(len(ids))
    okept = {name: np.zeros(len(ids)) for name in ORACLES}
    state = {"first": 0}

    def hook(module, hargs, kwargs):
        q, k = hargs[0].detach(), hargs[1].detach()
        cu = kwargs["packed_seq_params"].cu_seqlens_q.to("cpu", torch.int64).tolist()
        scale = default_scale(q.shape[-1], module.softmax_scale)
        first, n = state["first"], len(cu) - 1
        doc_kept, doc_causal = routed_pairs(q, k, cu, scale, args.block_size, args.topk, rule)
        kept[first:first + n] += doc_kept
        causal[first:first + n] += doc_causal
        for j in range(n if oracle else 0):
            o = oracle_pairs(q[cu[j]:cu[j + 1]], k[cu[j]:cu[j + 1]], scale, args.block_size, args.tau)
            for name in ORACLES:
                okept[name][first + j] += o[name]

    cores = [m for m in model.gpt.modules() if isinstance(m, CausalVarlenAttention)]
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in cores]
    try:
        with torch.no_grad():
            for group in pack_in_order([int(dataset.sequence_lengths[i]) for i in ids], tokens):
                state["first"] = group[0]
                model.logits([torch.from_numpy(dataset[int(ids[g])].astype(np.int64)) for g in group])
    finally:
        for h in handles:
            h.remove()
    dens = kept / np.maximum(causal, 1)
    return (dens, {name: v / np.maximum(causal, 1) for name, v in okept.items()}) if oracle else dens


def microbatch_spread(lengths, dens, tokens: int) -> dict:
    """CV of the per-micro-batch attention cost proxy: measured, length-bucket mean, fixed."""
    by_bucket: dict = {}
    for L, d in zip(lengths, dens):
        by_bucket.setdefault(length_bucket(L), []).append(d)
    bucket_mean = {b: float(np.mean(v)) for b, v in by_bucket.items()}
    overall = float(np.mean(dens))
    groups = pack_in_order(lengths, tokens)
    meas, lonly, fixed = [], [], []
    for g in groups:
        Ls = [lengths[i] for i in g]
        meas.append(attention_cost([dens[i] for i in g], Ls))
        lonly.append(attention_cost([bucket_mean[length_bucket(L)] for L in Ls], Ls))
        fixed.append(attention_cost([overall] * len(Ls), Ls))
    ratio = np.asarray(meas) / np.asarray(lonly)
    return {"microbatches": len(groups), "tokens_per_microbatch_max": tokens,
            "cost": "sum over documents of density x L(L+1)/2 (query-key pairs per head): a proxy, not a timing",
            "cv_measured": cv(meas), "cv_length_only": cv(lonly), "cv_fixed_density": cv(fixed),
            "cv_measured_over_length_only": cv(ratio),
            "max_over_mean_measured": float(max(meas) / np.mean(meas)) if meas else None}


def estimator_errors(lengths, dens, sources, tokens: int) -> dict:
    """MAPE of the per-micro-batch cost predicted by estimators fitted on the first half."""
    half = len(lengths) // 2
    fitted = {"source_and_length": SparsityEstimator(), "length_only": LengthOnlyEstimator()}
    for est in fitted.values():
        for s, L, d in zip(sources[:half], lengths[:half], dens[:half]):
            est.update(s, L, float(d))
    constant = float(np.mean(dens[:half]))
    held = list(range(half, len(lengths)))
    groups = [[held[i] for i in g] for g in pack_in_order([lengths[i] for i in held], tokens)]
    actual = [attention_cost([dens[i] for i in g], [lengths[i] for i in g]) for g in groups]
    out = {}
    for name, est in fitted.items():
        pred = [est.predict_cost([sources[i] for i in g], [lengths[i] for i in g]) for g in groups]
        out[name] = mape(pred, actual)
    out["constant"] = mape([attention_cost([constant] * len(g), [lengths[i] for i in g]) for g in groups], actual)
    doc_pred = [fitted["source_and_length"].predict(sources[i], lengths[i]) for i in held]
    out["per_document"] = mape(doc_pred, [max(dens[i], 1e-12) for i in held])
    return {"fit_documents": half, "heldout_documents": len(held), "heldout_microbatches": len(groups), **out}


def source_table(lengths, dens, sources) -> dict:
    out = {}
    for s in sorted(set(sources)):
        idx = [i for i, x in enumerate(sources) if x == s]
        Ls, ds = [lengths[i] for i in idx], [dens[i] for i in idx]
        out[s] = {"documents": len(idx), "mean_density": float(np.mean(ds)), "mean_length": float(np.mean(Ls)),
                  "cv_equal_length": cv_within_buckets(Ls, ds)["cv"]}
    return out


def spread(lengths, dens, sources) -> dict:
    """CV at equal length (log2 and quarter-octave buckets), mean by source, mean."""
    return {"cv_equal_length": cv_within_buckets(lengths, dens)["cv"],
            "cv_equal_length_fine": cv_within_buckets(lengths, dens, buckets_per_octave=4)["cv"],
            "by_source": {s: float(np.mean([x for x, y in zip(dens, sources) if y == s]))
                          for s in sorted(set(sources))},
            "mean_density": float(np.mean(dens))}


def checkpoint_view(root: str, iteration: int, tmp: str) -> str:
    """A directory whose latest checkpoint is ``root``'s ``iteration`` (symlinked, not copied)."""
    from megatron.training.checkpointing import TRACKER, iter_dir

    view = os.path.join(tmp, f"view_{iteration}")
    os.makedirs(view)
    os.symlink(os.path.abspath(iter_dir(root, iteration)), iter_dir(view, iteration))
    with open(os.path.join(view, TRACKER), "w") as fh:
        fh.write(f"{iteration}\n")
    return view


def drift(args, dataset, ids, sources, tokens: int, iterations: list, latest: int, latest_dens) -> dict:
    """Mean density on the first ``--drift-docs`` documents at every saved iteration."""
    from benchmarks.harness.longctx.model import open_eval_model

    n = min(args.drift_docs, len(ids))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for it in iterations:
            if it == latest:
                d = latest_dens[:n]
            else:
                model, _ = open_eval_model(checkpoint_view(args.load, it, tmp), args.train_args, args.threads,
                                           fail, sparse=False, sb_topk=None, sb_block_size=None, backend=None)
                try:
                    d = measure(model, dataset, ids[:n], args, tokens)
                finally:
                    model.close()
            srcs = sources[:n]
            out[str(it)] = {"mean_density": float(np.mean(d)),
                            "by_source": {s: float(np.mean([x for x, y in zip(d, srcs) if y == s]))
                                          for s in sorted(set(srcs))}}
    first, last = out[str(iterations[0])], out[str(iterations[-1])]
    return {"documents": n, "iterations": out,
            "mean_density_change": last["mean_density"] - first["mean_density"]}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    if args.real and args.dump_qk is not None:
        print(json.dumps(sparsity_real.dump_qk(args, fail)))
        return 0
    if args.real:
        return report_real(args)
    from megatron.training.checkpointing import list_iterations
    from megatron.training.indexed_io import open_dataset

    try:
        dataset = open_dataset(args.data_path)
    except ValueError as e:
        fail(f"--data-path: {e}")
    all_lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    doc_source = read_sidecar(args.sources_file or args.data_path + "_sources.json", all_lengths, fail)
    if args.train_args is None:
        args.train_args = stamped_train_args(args.load)
    from benchmarks.harness.longctx.model import open_eval_model

    model, args.threads = open_eval_model(args.load, args.train_args, args.threads, fail, sparse=False,
                                          sb_topk=None, sb_block_size=None, backend=None)
    try:
        ids = document_ids(args, model.args, len(all_lengths))[: args.num_docs]
        if len(ids) < 4:
            fail(f"--num-docs: only {len(ids)} documents to measure (need >= 4)")
        tokens = args.microbatch_tokens or int(model.args.seq_length)
        dens, oracles = measure(model, dataset, ids, args, tokens, oracle=True)
        iteration, margs = model.iteration, model.args
    finally:
        model.close()
    lengths = [int(all_lengths[i]) for i in ids]
    sources = [doc_source[i] for i in ids]
    iterations = [i for i in list_iterations(args.load) if i <= iteration]
    table = source_table(lengths, dens, sources)
    report = {
        "cv_equal_length": cv_within_buckets(lengths, dens)["cv"],
        "cv_equal_length_fine": cv_within_buckets(lengths, dens, buckets_per_octave=4)["cv"],
        "cv_equal_length_by_source": {s: v["cv_equal_length"] for s, v in table.items()},
        "by_source": {s: v["mean_density"] for s, v in table.items()},
        "estimator_mape": None,
        "density": {"mean": float(np.mean(dens)), "min": float(np.min(dens)), "max": float(np.max(dens)),
                    "cv": cv(dens)},
        "sources": table,
        "length_buckets": cv_within_buckets(lengths, dens)["buckets"],
        "microbatch_cost": microbatch_spread(lengths, dens, tokens),
        "estimator": estimator_errors(lengths, dens, sources, tokens),
        "oracle": {**spread(lengths, oracles["oracle"], sources),
                   "per_head": spread(lengths, oracles["per_head"], sources),
                   "total_mass": spread(lengths, oracles["total_mass"], sources),
                   "what": "threshold routing on the dense softmax mass instead of the block-mean gate (sink, "
                           "diagonal, fewest candidates holding TAU of the candidates' mass; one count for all "
                           "heads; no cap or floor); per_head: each head its own count; total_mass: TAU of all "
                           "the mass, sink and diagonal included"},
        "drift": (drift(args, dataset, ids, sources, tokens, iterations, iteration, dens)
                  if len(iterations) > 1 else None),
        "per_document": [{"doc": int(i), "source": s, "length": L, "density": float(dens[n]),
                          **{f"oracle_{name}": float(v[n]) for name, v in oracles.items()}}
                         for n, (i, s, L) in enumerate(zip(ids, sources, lengths))],
        "config": {"load": args.load, "iteration": iteration, "data_path": args.data_path, "tau": args.tau,
                   "topk": args.topk, "topk_min": args.topk_min, "block_size": args.block_size,
                   "documents": len(ids), "docs": args.docs, "microbatch_tokens": tokens,
                   "num_layers": int(margs.num_layers), "hidden_size": int(margs.hidden_size),
                   "q_k_from": "dense forward; each document routed alone by the shared plan",
                   "density": "kept / causal (query, key) pairs, summed over heads and layers"},
    }
    report["estimator_mape"] = report["estimator"]["source_and_length"]
    if not emit(report, args):
        mc = report["microbatch_cost"]
        print(f"documents {len(ids)}  mean density {report['density']['mean']:.3f}  cv_equal_length "
              f"{report['cv_equal_length']}  estimator_mape {report['estimator_mape']:.3f}")
        print("by source: " + "  ".join(f"{s} {d:.3f}" for s, d in report["by_source"].items()))
        print(f"micro-batch cost CV: measured {mc['cv_measured']}, length-only {mc['cv_length_only']}, "
              f"fixed {mc['cv_fixed_density']}")
    return 0


def emit(report: dict, args) -> bool:
    """Write ``report`` to ``--output`` (atomically) and print it with ``--json``; False when
    the caller prints its text summary instead."""
    text = json.dumps(report)
    if args.output:
        atomic_write_text(args.output, text + "\n")
    if args.json:
        print(text)
    return bool(args.json)


def report_real(args) -> int:
    """``--real``: the study on a converted pretrained model (:mod:`sparsity_real`)."""
    report = sparsity_real.run(args, fail)
    if not emit(report, args):
        s = report["sensitivity"]
        print(f"documents {report['measured']['documents']}  density {report['density_mean']:.3f}  cv_equal_length "
              f"{report['cv_equal_length']:.3f}  per_head_over_per_block {report['per_head_over_per_block']:.3f}  "
              f"estimator_mape {report['estimator_mape']:.3f} (length only {report['estimator_mape_length_only']:.3f})")
        print("by source: " + "  ".join(f"{k} {v:.3f}" for k, v in report["by_source"].items()))
        if s["documents"]:
            print(f"sensitivity (top-{args.sens_topk}): mean +{s['mean']:.3f} nats, cv_equal_length "
                  f"{s['cv_equal_length']:.2f}; " + "  ".join(f"{k} {v:+.3f}" for k, v in s["by_source"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
