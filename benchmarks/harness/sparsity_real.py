"""``benchmarks/sparsity_study.py --real``: the density and sensitivity study on a pretrained model.

On a checkpoint converted by ``tools/checkpoint/convert.py`` (``LOAD/model_flags.txt``, the
tokenizer in ``LOAD/hf``) and a corpus from ``benchmarks/make_real_corpus.py``, built with the
driver's :class:`~sparsebalance.attention.sparse.SparseAttention` in every layer's
``core_attention`` slot:

* documents at equal length: for each of ``--lengths`` (tokens), ``--docs-per-source`` documents
  of every source, the shortest of at least that length, each cut to its last ``L`` tokens (a
  window ending at the document's end, so a RULER-style document keeps its question and
  answer); a document is used at one length only;
* density: one dense forward per document; a pre-hook on every layer's core attention routes the
  document's q and k (after RoPE) by the kernels' shared plan under
  ``RoutingRule(threshold=TAU, topk_min=--topk-min, per_head=...)`` for every TAU of ``--taus``,
  with a count per (query block, head) and with one count per query block shared by the heads
  (``per_head_over_per_block``: the ratio of their kept pairs); no cap unless ``--topk``;
  density = kept / causal pairs over heads and layers, also per layer;
* oracle and recall (documents of at most ``--oracle-max-length`` tokens): each head's dense
  softmax mass per (query block, key block); the oracle density (the plan's rule on the true mass,
  a count per head) and the gate's recall: the share of the true mass inside the blocks the gate
  kept (sink and diagonal included);
* sensitivity (documents of ``--sens-lengths``): mean next-token loss on each document's second
  half under static top-k (``--sens-topk``), threshold routing at ``--tau`` per head and per
  block, minus the dense loss; the model runs sparse in every layer (each layer's routing
  sees the sparse layers before it), with the ``--backend`` kernel;
* the estimator: :func:`~sparsebalance.batching.sparsity_estimator.heldout_microbatch_mape` on
  ``documents`` (listed fit half first: every other document of each source, by length).

The whole report is one JSON object (``docs/real_study.md`` reads it).
"""

from __future__ import annotations

import os
import shlex
import sys
import time

import numpy as np

from sparsebalance.batching.sparsity_estimator import (
    LengthOnlyEstimator,
    SparsityEstimator,
    cv,
    cv_within_buckets,
    heldout_microbatch_mape,
)

DEFAULTS = {"block_size": 64, "lengths": "2048,4096,8192", "docs_per_source": "2,2,1", "taus": "0.8,0.9,0.95",
            "sens_lengths": "4096", "oracle_max_length": 2048, "max_seconds": 2400.0}
"""The documented defaults of ``make real-study`` (sized for <= 45 minutes on 2 shared cores)."""


def add_args(p) -> None:
    """The ``--real`` flags (defaults in :data:`DEFAULTS`)."""
    g = p.add_argument_group("pretrained model (--real)")
    g.add_argument("--real", action="store_true",
                   help="the study on a converted pretrained checkpoint (LOAD/model_flags.txt, LOAD/hf)")
    g.add_argument("--lengths", default=None, help=f"equal lengths measured (default {DEFAULTS['lengths']})")
    g.add_argument("--docs-per-source", default=None,
                   help=f"documents per source at each length (default {DEFAULTS['docs_per_source']})")
    g.add_argument("--taus", default=None, help=f"TAU sweep (default {DEFAULTS['taus']}); --tau is the headline")
    g.add_argument("--sens-lengths", default=None,
                   help=f"lengths whose documents get the sensitivity forwards (default {DEFAULTS['sens_lengths']}; "
                        "'none': skip)")
    g.add_argument("--sens-topk", type=int, default=8, help="static top-k of the sensitivity forwards")
    g.add_argument("--oracle-max-length", type=int, default=None,
                   help=f"longest document whose dense mass is measured (default {DEFAULTS['oracle_max_length']})")
    g.add_argument("--backend", default="cpu", help="sparse kernel of the sensitivity forwards")
    g.add_argument("--tokenizer-model", default=None, help="default: LOAD/hf (text of a window, for its "
                                                            "compression ratio)")
    g.add_argument("--dump-qk", default=None, metavar="FILE",
                   help="instead of the study: one layer's q, k, v (after RoPE) of whole corpus documents packed "
                        "to --dump-tokens, with their cu_seqlens, saved as a torch .pt for bench_attention.py --qk")
    g.add_argument("--dump-layer", type=int, default=None, help="--dump-qk's layer (0-based; default the middle one)")
    g.add_argument("--dump-tokens", type=int, default=16384, help="--dump-qk's packed tokens")
    g.add_argument("--max-seconds", type=float, default=None,
                   help=f"start no document after this many seconds (default {DEFAULTS['max_seconds']:g}); "
                        "the report says how many were measured")


def _ints(text: str, flag: str, fail) -> list:
    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        fail(f"{flag}: expected a comma list of positive integers, got {text!r}")
    return out


def check_args(args, fail) -> None:
    """``--real`` input checks that need no model (exit 2); fills the defaults."""
    if args.dump_qk is not None:  # the study's selection is not used: any --lengths passes
        args.docs_per_source = args.docs_per_source or "1"
        args.sens_lengths = args.sens_lengths or "none"
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.lengths = _ints(args.lengths, "--lengths", fail)
    args.docs_per_source = _ints(args.docs_per_source, "--docs-per-source", fail)
    if len(args.docs_per_source) == 1:
        args.docs_per_source *= len(args.lengths)
    if len(args.docs_per_source) != len(args.lengths):
        fail("--docs-per-source: one count, or one per --lengths entry")
    try:
        args.taus = sorted({float(x) for x in args.taus.split(",") if x} | {float(args.tau)})
    except ValueError:
        fail(f"--taus: expected a comma list of numbers, got {args.taus!r}")
    if not all(0.0 < t <= 1.0 for t in args.taus):
        fail("--taus must be in (0, 1]")
    args.sens_lengths = [] if args.sens_lengths == "none" else _ints(args.sens_lengths, "--sens-lengths", fail)
    if not set(args.sens_lengths) <= set(args.lengths):
        fail("--sens-lengths must be among --lengths")
    if args.sens_topk < 1 or args.topk_min < 0 or (args.topk is not None and args.topk < args.topk_min):
        fail("need --sens-topk >= 1 and 0 <= --topk-min <= --topk")
    if args.train_args is None and not os.path.isfile(os.path.join(args.load, "model_flags.txt")):
        fail(f"--load: {args.load} has no model_flags.txt (convert with tools/checkpoint/convert.py, or pass "
             "--train-args)")
    if args.dump_qk is not None and (args.dump_tokens < 1 or (args.dump_layer is not None and args.dump_layer < 0)):
        fail("--dump-tokens must be >= 1 and --dump-layer >= 0")
    if args.tokenizer_model is None:
        args.tokenizer_model = os.path.join(args.load, "hf")
    if not os.path.exists(args.tokenizer_model):
        fail(f"--tokenizer-model: {args.tokenizer_model} does not exist")


def select_documents(lengths, sources, want: list) -> list:
    """``[(doc index, L, source)]``: for each ``(L, n)`` of ``want`` (longest first) and each
    source, the ``n`` shortest unused documents of at least ``L`` tokens (ties: lower index)."""
    used, picked = set(), []
    for L, n in sorted(want, reverse=True):
        for s in sorted(set(sources)):
            cand = sorted((int(lengths[i]), i) for i in range(len(lengths))
                          if sources[i] == s and lengths[i] >= L and i not in used)
            for _, i in cand[:n]:
                used.add(i)
                picked.append((i, L, s))
    return picked


def interleave(picked: list) -> list:
    """``picked`` in measuring order: every prefix spreads over sources and lengths (rank by
    rank within the (length, source) groups; within a rank, source ``j + l`` at length ``l``),
    so a run stopped by ``--max-seconds`` still holds a mix."""
    lengths = sorted({L for _, L, _ in picked})
    srcs = sorted({s for _, _, s in picked})
    rank: dict = {}
    keyed = []
    for item in picked:
        r = rank[item[1:]] = rank.get(item[1:], -1) + 1
        li = lengths.index(item[1])
        keyed.append(((r, (srcs.index(item[2]) - li) % len(srcs), li), item))
    return [item for _, item in sorted(keyed)]


def fit_first(docs: list) -> list:
    """``docs`` (dicts with ``length`` and ``source``) reordered so that the first ``len // 2``
    are the estimator's fit half: every other document of each source, by length then
    measuring order (so each source has documents on both sides)."""
    order = sorted(range(len(docs)), key=lambda j: (docs[j]["source"], docs[j]["length"], j))
    fit = [j for n, j in enumerate(order) if n % 2 == 1]
    held = [j for n, j in enumerate(order) if n % 2 == 0]
    return [docs[j] for j in fit + held]


class Model:
    """The converted checkpoint with :class:`SparseAttention` in every layer, dense by default;
    one document per forward."""

    def __init__(self, args, fail) -> None:
        from benchmarks.harness.longctx.model import open_eval_model
        from sparsebalance.attention.sparse import SparseAttention

        flags = args.train_args
        if flags is None:
            with open(os.path.join(args.load, "model_flags.txt")) as fh:
                flags = fh.read().strip()
        if "--seq-length" not in shlex.split(flags):
            flags += f" --seq-length {max(args.lengths)}"
        self.model, args.threads = open_eval_model(args.load, flags, args.threads, fail, sparse=True, sb_topk=None,
                                                   sb_block_size=args.block_size, backend=args.backend)
        self.cores = [m for m in self.model.gpt.modules() if isinstance(m, SparseAttention)]
        for m in self.cores:
            m.topk = None  # dense unless a forward's packed params carry a budget

    def loss(self, ids, half: int, budget=None, rule=None) -> tuple:
        """(mean next-token loss over tokens ``half..`` of ``ids``, the attention records)
        with every layer dense (``budget`` None) or sparse (top-k ``budget``, or the cap of
        threshold ``rule``)."""
        import torch

        from sparsebalance.attention.packed import BudgetedPackedSeqParams

        n = len(ids)
        cu = torch.tensor([0, n], dtype=torch.int32)
        records: list = []
        packed = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                                         max_seqlen_kv=n, budget=budget, records=records, cu_seqlens_host=cu)
        for m in self.cores:
            m.rule = rule
        try:
            with torch.no_grad():
                tok = torch.as_tensor(ids, dtype=torch.int64).view(1, n)
                labels = torch.roll(tok, -1, 1)
                per_token = self.model.gpt(tok, torch.arange(n).view(1, n), None, labels=labels,
                                           packed_seq_params=packed)
        finally:
            for m in self.cores:
                m.rule = None
        return float(per_token[0, half - 1:n - 1].double().mean()), records

    def close(self) -> None:
        self.model.close()


class Probe:
    """The dense forward's per-layer routing of one document (a pre-hook on each core attention)."""

    def __init__(self, args, cores, with_mass: bool) -> None:
        from sparsebalance.ops.plan import RoutingRule

        self.args, self.with_mass = args, with_mass
        self.rules = {(t, ph): RoutingRule(threshold=t, topk_min=args.topk_min, per_head=ph)
                      for t in args.taus for ph in (True, False)}
        nl = len(cores)
        self.kept = {key: np.zeros(nl) for key in self.rules}
        self.recall = {key: np.zeros(nl) for key in self.rules}
        self.oracle = {t: np.zeros(nl) for t in args.taus}
        self.causal = 0.0
        self.layer = {id(m): i for i, m in enumerate(cores)}

    def __call__(self, module, hargs, kwargs) -> None:
        import torch

        from benchmarks.harness.oracle import block_mass, oracle_from_mass
        from sparsebalance.ops.plan import build_plan, default_scale, routing_rule

        q, k = hargs[0].detach(), hargs[1].detach()
        L, H = q.shape[0], q.shape[1]
        li, B = self.layer[id(module)], self.args.block_size
        scale = default_scale(q.shape[-1], module.softmax_scale)
        cu = torch.tensor([0, L], dtype=torch.int32)
        nb = -(-L // B)
        cap = nb if self.args.topk is None else self.args.topk
        self.causal = H * L * (L + 1) / 2
        mass = block_mass(q, k, scale, B) if self.with_mass else None
        for key, rule in self.rules.items():
            with routing_rule(rule):
                plan = build_plan(q, k, cu, cap, B, scale)
            self.kept[key][li] = plan.kept_pairs
            if mass is not None:
                kept = torch.zeros(H, nb, nb + 1, dtype=torch.float64)
                idx = plan.kv_idx.long().clone()
                idx[idx < 0] = nb
                kept.scatter_(2, idx, 1.0)
                self.recall[key][li] = float((mass * kept[..., :nb]).sum() / mass.sum())
        if mass is not None:
            for t in self.args.taus:
                self.oracle[t][li] = oracle_from_mass(mass, L, B, t)["per_head"]


def measure_document(model, args, ids, sens: bool, with_mass: bool) -> dict:
    """Everything the study measures on one document window ``ids``."""
    t0, c0 = time.time(), time.process_time()
    probe = Probe(args, model.cores, with_mass)
    handles = [m.register_forward_pre_hook(probe, with_kwargs=True) for m in model.cores]
    L, half = len(ids), len(ids) // 2
    try:
        dense_loss, _ = model.loss(ids, half)
    finally:
        for h in handles:
            h.remove()
    tau, causal = args.tau, probe.causal
    out = {"density": float(probe.kept[(tau, True)].mean() / causal),
           "density_per_block": float(probe.kept[(tau, False)].mean() / causal),
           "densities": {f"{t:g}": {"per_head": float(probe.kept[(t, True)].mean() / causal),
                                    "per_block": float(probe.kept[(t, False)].mean() / causal)} for t in args.taus},
           "by_layer": {"per_head": (probe.kept[(tau, True)] / causal).tolist(),
                        "per_block": (probe.kept[(tau, False)] / causal).tolist()},
           "loss_dense": dense_loss}
    if with_mass:
        out["oracle"] = {f"{t:g}": float(probe.oracle[t].mean() / causal) for t in args.taus}
        out["gate_recall"] = {f"{t:g}": {"per_head": float(probe.recall[(t, True)].mean()),
                                         "per_block": float(probe.recall[(t, False)].mean())} for t in args.taus}
    if sens:
        from sparsebalance.ops.plan import RoutingRule

        cap = -(-L // args.block_size) if args.topk is None else args.topk
        loss, rec = model.loss(ids, half, budget=args.sens_topk)
        out["loss_delta"] = loss - dense_loss
        out["density_topk"] = sum(r.kept_pairs for r in rec) / sum(r.causal_pairs for r in rec)
        for name, ph in (("threshold", True), ("threshold_per_block", False)):
            rule = RoutingRule(threshold=tau, topk_min=args.topk_min, per_head=ph)
            loss, rec = model.loss(ids, half, budget=cap, rule=rule)
            out[f"loss_delta_{name}"] = loss - dense_loss
            out[f"density_in_loop_{name}"] = sum(r.kept_pairs for r in rec) / sum(r.causal_pairs for r in rec)
    # process CPU time: what a quiet machine's wall time is about (x 1 / threads); the wall
    # time of a shared machine is not
    out["seconds"], out["cpu_seconds"] = round(time.time() - t0, 1), round(time.process_time() - c0, 1)
    return out


def _by_source(docs: list, key: str) -> dict:
    return {s: float(np.mean([d[key] for d in docs if d["source"] == s]))
            for s in sorted({d["source"] for d in docs})}


def _corr(x, y) -> dict:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return {"pearson": None, "spearman": None, "documents": len(x)}
    rank = lambda v: np.argsort(np.argsort(v)).astype(np.float64)
    return {"pearson": float(np.corrcoef(x, y)[0, 1]), "spearman": float(np.corrcoef(rank(x), rank(y))[0, 1]),
            "documents": len(x)}


def _paired(diff) -> dict:
    """Mean of paired differences with a 95% t-interval."""
    from scipy import stats

    d = np.asarray(diff, dtype=np.float64)
    if len(d) < 2:
        return {"mean": float(d.mean()) if len(d) else None, "ci95": None, "documents": len(d)}
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    return {"mean": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)],
            "within_noise": bool(abs(d.mean()) <= half), "documents": len(d)}


def sensitivity(docs: list) -> dict:
    """Loss increase (second half, nats per token) over the documents that have one."""
    sd = [d for d in docs if "loss_delta" in d]
    if not sd:
        return {"cv_equal_length": None, "by_source": {}, "documents": 0}
    L = [d["length"] for d in sd]
    out = {"cv_equal_length": cv_within_buckets(L, [d["loss_delta"] for d in sd])["cv"],
           "by_source": _by_source(sd, "loss_delta"), "mean": float(np.mean([d["loss_delta"] for d in sd])),
           "documents": len(sd), "lengths": sorted(set(L)),
           "equal_density": "under static top-k every document of one length keeps the same pairs, so the "
                            "spread at equal length is the spread at equal length and density",
           "density_topk": float(np.mean([d["density_topk"] for d in sd])),
           "corr_with_density": _corr([d["density"] for d in sd], [d["loss_delta"] for d in sd])}
    for name in ("threshold", "threshold_per_block"):
        v = [d[f"loss_delta_{name}"] for d in sd]
        out[name] = {"mean": float(np.mean(v)), "cv_equal_length": cv_within_buckets(L, v)["cv"],
                     "by_source": _by_source(sd, f"loss_delta_{name}"),
                     "density_in_loop": float(np.mean([d[f"density_in_loop_{name}"] for d in sd])),
                     "corr_with_density": _corr([d["density"] for d in sd], v)}
    out["per_head_minus_per_block"] = _paired([d["loss_delta_threshold"] - d["loss_delta_threshold_per_block"]
                                               for d in sd])
    out["per_head_over_per_block_in_loop"] = float(
        sum(d["density_in_loop_threshold"] * d["length"] ** 2 for d in sd)
        / sum(d["density_in_loop_threshold_per_block"] * d["length"] ** 2 for d in sd))
    return out


def _by_length(docs: list, values: list) -> dict:
    """Per equal length: documents, mean and CV of ``values``, mean by source."""
    out = {}
    for n in sorted({d["length"] for d in docs}):
        at = [(d["source"], v) for d, v in zip(docs, values) if d["length"] == n]
        vals = [v for _, v in at]
        out[str(n)] = {"documents": len(at), "mean": float(np.mean(vals)), "cv": cv(vals),
                       "by_source": {s: float(np.mean([v for x, v in at if x == s]))
                                     for s in sorted({x for x, _ in at})}}
    return out


def _tau_table(docs: list, tau: str) -> dict:
    """Density at one TAU (key ``tau``): per-head counts, per-block counts and their pair ratio."""
    L = [d["length"] for d in docs]
    w = [n * (n + 1) / 2 for n in L]  # causal pairs per head
    ph = [d["densities"][tau]["per_head"] for d in docs]
    pb = [d["densities"][tau]["per_block"] for d in docs]
    return {"cv_equal_length": cv_within_buckets(L, ph)["cv"], "density_mean": float(np.mean(ph)),
            "per_block": {"cv_equal_length": cv_within_buckets(L, pb)["cv"], "density_mean": float(np.mean(pb))},
            "per_head_over_per_block": float(np.dot(ph, w) / np.dot(pb, w)), "by_length": _by_length(docs, ph)}


def _oracle_table(docs: list, tau: str) -> dict:
    """The oracle's density and the gate's recall at one TAU, over the documents that have them."""
    od = [d for d in docs if "oracle" in d]
    recall = lambda mode: float(np.mean([d["gate_recall"][tau][mode] for d in od]))
    return {"documents": len(od), "oracle_density_mean": float(np.mean([d["oracle"][tau] for d in od])),
            "oracle_cv_equal_length": cv_within_buckets([d["length"] for d in od],
                                                        [d["oracle"][tau] for d in od])["cv"],
            "gate_recall_per_head": recall("per_head"), "gate_recall_per_block": recall("per_block")}


def summarize(docs: list, args) -> dict:
    """The report's aggregates from the measured documents (see the module docstring)."""
    grid = {f"{t:g}": _tau_table(docs, f"{t:g}") for t in args.taus}
    oracle = {f"{t:g}": _oracle_table(docs, f"{t:g}") for t in args.taus} if any("oracle" in d for d in docs) else None
    layers = {k: np.mean([d["by_layer"][k] for d in docs], axis=0).round(5).tolist() for k in ("per_head", "per_block")}
    est = heldout_microbatch_mape(docs, args.microbatch_tokens,
                                  {"source_and_length": SparsityEstimator(), "length_only": LengthOnlyEstimator()})
    head = grid[f"{args.tau:g}"]
    return {"cv_equal_length": head["cv_equal_length"], "by_source": _by_source(docs, "density"),
            "density_mean": head["density_mean"], "per_head_over_per_block": head["per_head_over_per_block"],
            "sensitivity": sensitivity(docs), "estimator_mape": est["source_and_length"],
            "estimator_mape_length_only": est["length_only"], "estimator": est, "tau": args.tau, "taus": grid,
            "by_layer": layers, "oracle": oracle}


def run(args, fail) -> dict:
    """The ``--real`` study: the report (without ``config``'s timing, added by the caller)."""
    from benchmarks.harness.oracle import read_sidecar
    from megatron.training.doc_features import compression_ratio
    from megatron.training.indexed_io import open_dataset
    from megatron.training.tokenizer import HFJsonTokenizer

    t0 = time.time()
    try:
        dataset = open_dataset(args.data_path)
        tok = HFJsonTokenizer(args.tokenizer_model)
    except ValueError as e:
        fail(str(e))
    all_lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    doc_source = read_sidecar(args.sources_file or args.data_path + "_sources.json", all_lengths, fail)
    picked = interleave(select_documents(all_lengths, doc_source, list(zip(args.lengths, args.docs_per_source))))
    if len(picked) < 4:
        fail(f"--data-path: {len(picked)} documents of --lengths {args.lengths} in the corpus (need >= 4)")
    args.microbatch_tokens = args.microbatch_tokens or max(args.lengths)
    model = Model(args, fail)
    docs = []
    try:
        for n, (i, L, s) in enumerate(picked):
            if time.time() - t0 > args.max_seconds:
                break
            ids = np.asarray(dataset[int(i)], dtype=np.int64)[-L:]
            m = measure_document(model, args, ids, L in args.sens_lengths, L <= args.oracle_max_length)
            docs.append({"doc": int(i), "source": s, "length": L,
                         "compression_ratio": round(compression_ratio(tok.decode(ids.tolist())), 6), **m})
            sys.stderr.write(f"[{n + 1}/{len(picked)}] {s} {L}: density {m['density']:.3f} (per block "
                             f"{m['density_per_block']:.3f})" + (f", loss +{m['loss_delta']:.3f} top-k / "
                                                                  f"+{m['loss_delta_threshold']:.3f} threshold"
                                                                  if "loss_delta" in m else "")
                             + f", {m['seconds']:.0f} s\n")
    finally:
        model.close()
    if len(docs) < 4:
        fail(f"--max-seconds: only {len(docs)} documents measured in {args.max_seconds:g} s (need >= 4)", 1)
    docs = fit_first(docs)
    report = summarize(docs, args)
    report["documents"] = docs
    report["measured"] = {"documents": len(docs), "planned": len(picked), "stopped_early": len(docs) < len(picked),
                          "seconds": round(time.time() - t0, 1), "cpu_seconds": round(time.process_time(), 1)}
    report["config"] = {
        "load": args.load, "data_path": args.data_path, "tau": args.tau, "taus": args.taus,
        "lengths": args.lengths, "docs_per_source": args.docs_per_source, "block_size": args.block_size,
        "cap": args.topk, "topk_min": args.topk_min, "sens_lengths": args.sens_lengths, "sens_topk": args.sens_topk,
        "oracle_max_length": args.oracle_max_length, "backend": args.backend, "threads": args.threads,
        "microbatch_tokens": args.microbatch_tokens,
        "documents_order": "estimator fit half first (every other document of each source, by length)",
        "window": "the last L tokens of a document of at least L tokens (the shortest such of its source)",
        "density": "kept / causal (query, key) pairs over heads and layers, q and k of the dense forward",
        "loss": "mean next-token loss (nats) on the window's second half; loss_delta: static top-k minus dense"}
    return report


def dump_qk(args, fail) -> dict:
    """``--dump-qk``: whole documents of the corpus, sources interleaved (one of each source in
    turn, each cut to its last ``max(--lengths)`` tokens, the model's reach), through dense
    forwards; a pre-hook on layer ``--dump-layer``'s core attention keeps q, k, v; documents are
    packed until ``--dump-tokens`` (the last one cut to fit). Saved atomically as
    ``{q [T, H, D], k, v [T, Hkv, D], cu_seqlens, layer, docs}`` (docs: index, source, tokens; bf16 q/k/v would
    change the gates: kept in fp32)."""
    import io

    import torch

    from benchmarks.harness.oracle import read_sidecar
    from megatron.training.indexed_io import open_dataset
    from sparsebalance.io import atomic_write_bytes

    try:
        dataset = open_dataset(args.data_path)
    except ValueError as e:
        fail(str(e))
    lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    sources = read_sidecar(args.sources_file or args.data_path + "_sources.json", lengths, fail)
    by_source: dict = {}
    for i, s in enumerate(sources):
        by_source.setdefault(s, []).append(i)
    order, queues = [], [list(v) for _, v in sorted(by_source.items())]
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    model = Model(args, fail)
    layer = len(model.cores) // 2 if args.dump_layer is None else args.dump_layer
    if layer >= len(model.cores):
        model.close()
        fail(f"--dump-layer {layer}: the model has {len(model.cores)} layers")
    got: list = []
    hook = model.cores[layer].register_forward_pre_hook(
        lambda m, a, kw: got.append(tuple(t.detach().float().clone() for t in a[:3])), with_kwargs=True)
    parts, cu, docs, left = [], [0], [], args.dump_tokens
    try:
        for i in order:
            if left <= 0:
                break
            ids = np.asarray(dataset[int(i)], dtype=np.int64)[-max(args.lengths):]
            if len(ids) < 2:
                continue
            got.clear()
            model.loss(ids, len(ids) // 2)
            q, k, v = (t[:left] for t in got[0])
            parts.append((q, k, v))
            cu.append(cu[-1] + q.shape[0])
            docs.append({"doc": int(i), "source": sources[i], "tokens": int(q.shape[0])})
            left -= q.shape[0]
    finally:
        hook.remove()
        model.close()
    if left > 0:
        fail(f"--dump-tokens {args.dump_tokens}: the corpus has only {cu[-1]} tokens", 1)
    out = {name: torch.cat([p[j] for p in parts]).contiguous() for j, name in enumerate("qkv")}
    out.update(cu_seqlens=torch.tensor(cu, dtype=torch.int32), layer=layer, docs=docs)
    buf = io.BytesIO()
    torch.save(out, buf)
    atomic_write_bytes(args.dump_qk, buf.getvalue())
    return {"dump_qk": args.dump_qk, "layer": layer, "tokens": cu[-1], "documents": len(docs),
            "q": list(out["q"].shape), "k": list(out["k"].shape), "sources": sorted({d["source"] for d in docs})}
