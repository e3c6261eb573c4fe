"""Attention recall of a pretrain_gpt.py checkpoint under each arm's top-k budgets.

Recall (:mod:`benchmarks.harness.longctx.recall`): per query, the fraction of its dense
causal softmax mass (inside its own document) on the key blocks block top-k
routing keeps; reported per layer and head as the mean over queries.

The model is built and loaded as ``benchmarks/eval_longctx.py`` does (PP=1, the
driver's ``load_weights``) with dense attention, and runs its forward on
held-out packed micro-batches: the valid part of ``--split`` (the checkpoint's
by default), packed like the driver's validation loader. A forward pre-hook on
every layer's ``core_attention`` module takes q ``[T, H, D]`` (after RoPE) and
k ``[T, Hkv, D]`` and scores every arm on the same q and k, so arms differ
only in their budgets:

* ``static``: ``--sb-topk`` (default: the checkpoint's) for every micro-batch;
* ``dense``: recall 1.0;
* ``--budgets NAME=FILES`` (repeatable): DST budget tables, JSON with key
  ``budget`` of shape ``[dp][microbatch][stage]`` (the driver's
  ``--sb-timeline`` ``*.predicted.json`` files). ``FILES`` is one path, a
  comma list, or a quoted glob (each part may be either), e.g. every training
  step of a run. With each table, held-out micro-batch ``i`` takes row
  ``i mod (dp * microbatches)`` of the flattened table; layer ``l`` (1-based)
  belongs to stage ``(l - 1) // (num_layers / stages)`` as in the driver. The
  arm's recall is the mean over its tables (pooled: each table scores the same
  queries). The budgets were planned for training micro-batches and are applied
  to held-out ones, so a budget is not matched to the documents it was planned for.

Layers the checkpoint kept dense (``--sb-dense-layers``) have recall 1.0 in
every arm, as in training. Output: one JSON object
``{"arms": {arm: {"mean", "per_layer", "per_layer_head", "density", "queries", "vs_static"}},
"config": {...}}`` with ``--json`` (a short table otherwise); ``--plot PNG`` draws recall
per layer per arm. ``vs_static`` (every arm but ``static``): the arm's recall minus
static's per layer and on the mean, each ``{"diff", "ci95"}`` with a paired 95% bootstrap
interval over the held-out micro-batches (all arms are scored on the same queries).

``--step-times REAL_JSON`` (``benchmarks/compare.py --mode real``'s ``real.json``)
adds ``"frontier"``: one ``{arm, compare_arm, step_ms, tokens_per_s,
ms_per_1k_tokens, recall_mean, recall_per_layer, dominated_by}`` per arm that has
a measured speed: a ``--budgets`` arm takes the compare arm of its own name (name it
``sparsebalance``, ``critical-path-eps0.05``, ...), ``static`` is the ``megatron`` arm,
and ``sab`` trains with the static budget, so it is ``static``'s recall at ``sab``'s
speed. Speed is time per
token (ms per 1,000 tokens = 1e6 / tokens/s): SAB carries documents over, so arms
train different token counts per step and step time alone would mislead. With
``--plot``, ``<stem>_frontier.png`` draws recall against it, one labelled point per arm.

Tiny CPU run::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/attention_recall.py --load runs/demo/ckpt \\
        --data-path data/tiny --train-args "--num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 512" --num-microbatches 2 --budgets dst=runs/demo/timeline/step_0000010.predicted.json --json

GPU cluster run (one GPU; the model is built with PP=1)::

    python benchmarks/attention_recall.py --load /lustre/ckpt/run1 --data-path /lustre/data/prolong \\
        --num-microbatches 16 --budgets sparsebalance=/lustre/run1/timeline/step_0001000.predicted.json \\
        --json --plot /lustre/ckpt/run1/recall.png > /lustre/ckpt/run1/recall.json

The comparison's model (``docs/results.md``, "Attention recall at equal step time")::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/attention_recall.py --load runs/recall/ckpt \
        --data-path runs/compare/corpus --num-microbatches 16 \
        --budgets 'sparsebalance=runs/compare/runs/sparsebalance-[0-9]/timeline/step_*.predicted.json' \
        --step-times results/compare/real.json --json --plot results/attention_recall.png
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402
from sparsebalance.io import atomic_path  # noqa: E402

PROG = "attention_recall.py"


def fail(message: str, code: int = 2) -> NoReturn:
    """One ``attention_recall.py: error:`` line on stderr, then exit ``code``."""
    usage_error(message, prog=PROG, code=code)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory written by pretrain_gpt.py --save")
    p.add_argument("--data-path", required=True, help="prefix of the .bin/.idx indexed dataset")
    p.add_argument("--train-args", default=None,
                   help="pretrain_gpt.py flags of the run, for checkpoints that do not store them")
    p.add_argument("--split", default=None, help="train,valid,test weights (default: the checkpoint's)")
    p.add_argument("--seq-length", type=int, default=None, help="micro-batch tokens (default: the checkpoint's)")
    p.add_argument("--num-microbatches", type=int, default=4, help="held-out micro-batches to score")
    p.add_argument("--sb-topk", type=int, default=None, help="static arm's top-k (default: the checkpoint's)")
    p.add_argument("--sb-block-size", type=int, default=None, help="routing block (default: the checkpoint's)")
    p.add_argument("--budgets", action="append", default=[], metavar="NAME=FILES",
                   help="an arm with per-micro-batch, per-stage budgets (JSON key 'budget' [dp][mb][stage]); "
                        "FILES: a path, comma list or quoted glob, averaged over")
    p.add_argument("--step-times", default=None, metavar="REAL_JSON",
                   help="benchmarks/compare.py real.json: add the recall vs step-time frontier")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw recall per layer per arm")
    return p


def budget_files(name: str, files: str) -> list:
    """Paths of ``FILES`` (comma list of paths or globs), in order; no match exits 2."""
    paths = []
    for part in files.split(","):
        if not part:
            fail(f"--budgets {name}: empty path in {files!r}")
        found = sorted(glob.glob(part)) if glob.has_magic(part) else [part]
        if not found:
            fail(f"--budgets {name}: {part} matches no file")
        paths += found
    return paths


def read_json(path: str, flag: str):
    """The JSON document at ``path`` given to ``flag``; unreadable or not JSON exits 2."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except OSError as e:
        fail(f"{flag}: cannot read {path} ({e.strerror})")
    except ValueError as e:
        fail(f"{flag}: {path} is not JSON ({e})")


def read_budget_table(name: str, path: str):
    """int64 ``[rows, stages]`` budget table of one ``*.predicted.json``; bad input exits 2."""
    import numpy as np

    doc = read_json(path, f"--budgets {name}")
    if not isinstance(doc, dict) or "budget" not in doc:
        fail(f"--budgets {name}: {path} has no 'budget' table")
    try:
        b = np.asarray(doc["budget"], dtype=np.float64)
    except (TypeError, ValueError):
        fail(f"--budgets {name}: 'budget' in {path} is not a numeric [dp][microbatch][stage] table")
    if b.ndim != 3 or b.size == 0:
        fail(f"--budgets {name}: 'budget' in {path} must be [dp][microbatch][stage], got shape {b.shape}")
    if (b < 0).any() or (b != np.round(b)).any():
        fail(f"--budgets {name}: budgets in {path} must be integers >= 0")
    return b.astype(np.int64).reshape(-1, b.shape[2])


def read_budget_arms(specs: list[str]) -> dict:
    """``NAME=FILES`` -> {name: [(path, int64 array [rows, stages]), ...]}; bad input exits 2."""
    arms = {}
    for spec in specs:
        name, sep, files = spec.partition("=")
        if not sep or not name or not files:
            fail(f"--budgets: expected NAME=FILE, got {spec!r}")
        if name in ("static", "dense") or name in arms:
            fail(f"--budgets: arm name {name!r} is taken")
        tables = [(path, read_budget_table(name, path)) for path in budget_files(name, files)]
        stages = {t.shape[1] for _, t in tables}
        if len(stages) > 1:
            fail(f"--budgets {name}: its files disagree on the number of stages ({sorted(stages)})")
        arms[name] = tables
    return arms


# recall arm -> benchmarks/compare.py arm whose measured step time it is plotted at; "sab"
# trains with the static budget, so its recall is static's.
# A --budgets arm named like a benchmarks/compare.py arm (e.g. "critical-path-eps0.05") is
# plotted at that arm's step time.
STEP_ARMS = {"static": "megatron", "dense": "dense"}
SAME_RECALL = {"sab": "static"}


def read_step_times(path: str, budget_arms=()) -> dict:
    """{compare arm: {"step_ms", "tokens_per_s", "ms_per_1k_tokens"}} from ``real.json``'s
    ``arms``: those the recall arms map to (``static``, ``dense``, ``sab`` and the
    ``--budgets`` names); bad input exits 2. The arms pack different token counts per
    step (SAB carries documents over), so speed is compared per token: ms per 1,000 tokens."""
    doc = read_json(path, "--step-times")
    arms = doc.get("arms") if isinstance(doc, dict) else None
    if not isinstance(arms, dict):
        fail(f"--step-times: {path} has no 'arms' object (expected benchmarks/compare.py --mode real's real.json)")
    wanted = set(STEP_ARMS.values()) | set(SAME_RECALL) | set(budget_arms)
    out = {}
    for name, a in arms.items():
        if name not in wanted:
            continue
        ms = a.get("step_ms") if isinstance(a, dict) else None
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not ms > 0:
            fail(f"--step-times: arm {name!r} in {path} has no positive 'step_ms'")
        tps = a.get("tokens_per_s")
        if isinstance(tps, bool) or not isinstance(tps, (int, float)) or not tps > 0:
            fail(f"--step-times: arm {name!r} in {path} has no positive 'tokens_per_s'")
        out[name] = {"step_ms": float(ms), "tokens_per_s": float(tps), "ms_per_1k_tokens": 1e6 / float(tps)}
    if not out:
        fail(f"--step-times: {path} has none of the arms {sorted(wanted)}")
    return out


def frontier(arms: dict, steps: dict) -> list:
    """Recall against measured time per token, one point per arm that has both.

    ``arms``: :func:`report`'s {arm: {"mean", "per_layer", ...}}; ``steps``:
    :func:`read_step_times`'s {compare arm: {"step_ms", "tokens_per_s", "ms_per_1k_tokens"}}.
    Returns ``[{arm, compare_arm, step_ms, tokens_per_s, ms_per_1k_tokens, recall_mean,
    recall_per_layer, dominated_by}]`` sorted by ms per 1,000 tokens; ``dominated_by``
    lists the arms at most as slow per token with at least the recall (one of the two
    strictly).
    """
    points = []
    pairs = [(arm, STEP_ARMS.get(arm, arm), arm) for arm in arms]
    pairs += [(arm, arm, src) for arm, src in SAME_RECALL.items() if src in arms]
    for arm, compare_arm, src in pairs:
        if compare_arm not in steps:
            continue
        points.append({"arm": arm, "compare_arm": compare_arm, **steps[compare_arm],
                       "recall_mean": arms[src]["mean"],
                       "recall_per_layer": list(arms[src]["per_layer"])})
    for p in points:
        p["dominated_by"] = [o["arm"] for o in points if o is not p
                             and o["ms_per_1k_tokens"] <= p["ms_per_1k_tokens"]
                             and o["recall_mean"] >= p["recall_mean"]
                             and (o["ms_per_1k_tokens"], o["recall_mean"])
                             != (p["ms_per_1k_tokens"], p["recall_mean"])]
    return sorted(points, key=lambda p: (p["ms_per_1k_tokens"], p["arm"]))


def check_args(args) -> None:
    """Input checks that need no model (exit 2)."""
    if not os.path.isdir(args.load):
        fail(f"--load: {args.load} is not a directory")
    for ext in (".bin", ".idx"):
        if not os.path.isfile(args.data_path + ext):
            fail(f"--data-path: {args.data_path + ext} does not exist")
    for name in ("num_microbatches", "threads", "seq_length", "sb_block_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if args.sb_topk is not None and args.sb_topk < 0:
        fail("--sb-topk must be >= 0")
    if args.plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        fail(f"--plot: directory of {args.plot} does not exist")


def heldout_microbatches(args, model_args, vocab: int) -> list:
    """The first ``--num-microbatches`` packed micro-batches of the valid split."""
    from megatron.training import data as D
    from megatron.training.arguments import UsageError, _split
    from megatron.training.indexed_io import open_dataset

    try:
        fractions = _split(args.split if args.split is not None else model_args.split)
        dataset = open_dataset(args.data_path)
    except (UsageError, ValueError) as e:
        fail(str(e))
    valid_ids = D.split_documents(len(dataset), fractions)[1]
    if len(valid_ids) == 0:
        fail(f"--data-path: the valid split of {len(dataset)} documents is empty (--split)")
    loader = D.PackedDataLoader(dataset, valid_ids, dp=1, dp_rank=0, micro_batches=args.num_microbatches,
                                seq_length=args.seq_length or model_args.seq_length, strategy="megatron",
                                seed=model_args.seed, shuffle=False, vocab_size=vocab)
    try:
        return loader.next_step().microbatches
    except ValueError as e:
        fail(f"--data-path: {e}")


def score(model, microbatches, arms: dict, block_size: int, dense_layers) -> dict:
    """Forward every micro-batch; per arm, per layer, one :class:`Recall` per micro-batch.

    ``arms``: {name: callable(microbatch index, layer number) -> list of top-k, or
    None (dense)}; an arm's recall pools its list (one :class:`Recall` per entry, each
    over the same queries). Each distinct top-k is scored once per layer and
    micro-batch, whichever arms ask for it.
    """
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from benchmarks.harness.longctx.recall import block_topk_recall, pool
    from sparsebalance.attention.dense import CausalVarlenAttention

    cores = [m for m in model.gpt.modules() if isinstance(m, CausalVarlenAttention)]
    out = {name: {} for name in arms}
    state = {"mb": 0}

    def hook(module, args, kwargs):
        q, k = args[0], args[1]
        cu = kwargs["packed_seq_params"].cu_seqlens_q
        layer = int(module.layer_number)
        cache = {}
        for name, budget_of in arms.items():
            ts = [None] if layer in dense_layers else budget_of(state["mb"], layer)
            for t in ts:
                if t not in cache:
                    cache[t] = block_topk_recall(q.detach(), k.detach(), cu, t, block_size, module.softmax_scale)
            out[name].setdefault(layer, []).append(pool(cache[t] for t in ts))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in cores]
    try:
        with torch.no_grad():
            for i, mb in enumerate(microbatches):
                state["mb"] = i
                cu = mb["cu_seqlens"].to(model.device)
                lens = (cu[1:] - cu[:-1])
                packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                         max_seqlen_q=int(lens.max()), max_seqlen_kv=int(lens.max()))
                model.gpt(mb["tokens"].to(model.device), mb["position_ids"].to(model.device), None,
                          packed_seq_params=packed)
    finally:
        for h in handles:
            h.remove()
    return out


BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the held-out micro-batches in :func:`paired_vs_static`."""


def paired_vs_static(per_arm: dict, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> dict:
    """Each arm's recall minus ``static``'s, per layer and on the mean, with a paired 95%
    bootstrap interval over held-out micro-batches.

    ``per_arm``: :func:`score`'s {arm: {layer: [Recall per micro-batch]}}. Every arm is
    scored on the same queries, so one resample of micro-batch indices serves all arms
    and the interval covers which documents were held out (not which budget tables were
    drawn: an arm's tables are pooled inside each micro-batch). Returns {arm: {"per_layer":
    [{"diff", "ci95"}], "mean": {"diff", "ci95"}, "microbatches", "resamples"}}.
    """
    import numpy as np

    def arrays(layers: dict):
        ordered = [layers[n] for n in sorted(layers)]
        mass = np.array([[r.mass.numpy() for r in mbs] for mbs in ordered])  # [L, M, H]
        queries = np.array([[r.queries for r in mbs] for mbs in ordered], dtype=np.float64)  # [L, M]
        return mass, queries

    def recall(mass, queries, counts):  # counts [R, M] -> per layer [R, L]
        m = np.einsum("rm,lmh->rlh", counts, mass)
        q = np.einsum("rm,lm->rl", counts, queries)
        return (m / np.maximum(q, 1.0)[:, :, None]).mean(axis=2)

    base = arrays(per_arm["static"])
    M = base[1].shape[1]
    rng = np.random.default_rng(seed)
    counts = np.vstack([np.ones((1, M)), rng.multinomial(M, np.full(M, 1.0 / M), size=resamples)])
    b = recall(*base, counts)
    out = {}
    for name, layers in per_arm.items():
        if name == "static":
            continue
        d = recall(*arrays(layers), counts) - b  # row 0: the full sample
        d = np.hstack([d, d.mean(axis=1, keepdims=True)])
        lo, hi = np.percentile(d[1:], [2.5, 97.5], axis=0)
        cells = [{"diff": float(d[0, j]), "ci95": [float(lo[j]), float(hi[j])]} for j in range(d.shape[1])]
        out[name] = {"per_layer": cells[:-1], "mean": cells[-1], "microbatches": M, "resamples": resamples}
    return out


def report(per_arm: dict, sources: dict) -> dict:
    """{arm: {"mean", "per_layer", "per_layer_head", "density", "queries"}} from
    :func:`score`'s per-micro-batch recalls, pooled over micro-batches.

    ``sources``: {arm: budget tables pooled per query} (1 for ``static`` and ``dense``);
    ``queries`` counts each held-out query once.
    """
    from benchmarks.harness.longctx.recall import pool

    arms = {}
    for name, layers in per_arm.items():
        ordered = [pool(layers[n]) for n in sorted(layers)]
        per_head = [r.per_head.tolist() for r in ordered]
        per_layer = [sum(h) / len(h) for h in per_head]
        kept, causal = sum(r.kept_pairs for r in ordered), sum(r.causal_pairs for r in ordered)
        arms[name] = {"mean": sum(per_layer) / len(per_layer), "per_layer": per_layer,
                      "per_layer_head": per_head, "density": kept / causal if causal else 1.0,
                      "queries": ordered[0].queries // sources.get(name, 1)}
    return arms


def plot(path: str, arms: dict, title: str) -> None:
    """Recall per layer, one line per arm (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, a in arms.items():
        layers = range(1, len(a["per_layer"]) + 1)
        ax.plot(layers, a["per_layer"], marker="o", label=f"{name} (mean {a['mean']:.3f}, density {a['density']:.2f})")
    ax.set_xticks(list(range(1, max(len(a["per_layer"]) for a in arms.values()) + 1)))
    ax.set_xlabel("layer")
    ax.set_ylabel("attention recall")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def plot_frontier(path: str, points: list, title: str) -> None:
    """Recall mean against measured ms per 1,000 tokens, one labelled point per arm (PNG, atomic);
    x marks a dominated arm, the grey step joins the others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4 + 0.18 * len(points)))
    best = [p for p in points if not p["dominated_by"]]
    ax.step([p["ms_per_1k_tokens"] for p in best], [p["recall_mean"] for p in best], where="post", color="0.7",
            lw=1, zorder=1, label="not dominated")
    for p in points:  # labels in the legend: neighbouring points would overprint in-plot text
        ax.scatter(p["ms_per_1k_tokens"], p["recall_mean"], zorder=2, marker="o" if not p["dominated_by"] else "x",
                   label=f"{p['arm']}: {p['ms_per_1k_tokens']:.1f} ms/1K tokens, recall {p['recall_mean']:.3f}"
                         + (" (dominated)" if p["dominated_by"] else ""))
    ax.set_xlabel("measured ms per 1,000 tokens (1e6 / tokens/s)")
    ax.set_ylabel("attention recall (mean over layers)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)  # below: no overprint
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)


def frontier_path(plot_path: str) -> str:
    """``<plot stem>_frontier.png`` next to ``--plot``."""
    return os.path.splitext(plot_path)[0] + "_frontier.png"


def budget_arms_of(budget_arms: dict, num_layers: int) -> dict:
    """{name: callable(micro-batch, layer) -> [top-k per table]} for the ``--budgets`` arms."""
    arms = {}
    for name, tables in budget_arms.items():
        stages = tables[0][1].shape[1]
        if num_layers % stages:
            fail(f"--budgets {name}: {stages} stages in {tables[0][0]} do not divide the model's "
                 f"{num_layers} layers")
        per = num_layers // stages
        rows = [t for _, t in tables]
        arms[name] = lambda m, layer, rows=rows, per=per: [int(r[m % len(r), (layer - 1) // per]) for r in rows]
    return arms


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    budget_arms = read_budget_arms(args.budgets)
    steps = read_step_times(args.step_times, budget_arms) if args.step_times else None
    from benchmarks.harness.longctx.model import open_eval_model

    model, args.threads = open_eval_model(args.load, args.train_args, args.threads, fail, sparse=False,
                                          sb_topk=None, sb_block_size=None, backend=None)
    try:
        margs = model.args
        topk = args.sb_topk if args.sb_topk is not None else int(margs.sb_topk)
        block = args.sb_block_size or int(margs.sb_block_size)
        num_layers = int(margs.num_layers)
        arms = {"static": lambda m, layer: [topk], "dense": lambda m, layer: [None],
                **budget_arms_of(budget_arms, num_layers)}
        mbs = heldout_microbatches(args, margs, int(model.gpt.vocab_size))
        dense_layers = frozenset(int(x) for x in (getattr(margs, "sb_dense_layers", None) or ()))
        per_arm = score(model, mbs, arms, block, dense_layers)
    finally:
        model.close()
    arms_out = report(per_arm, {n: len(t) for n, t in budget_arms.items()})
    for name, d in paired_vs_static(per_arm).items():
        arms_out[name]["vs_static"] = d
    config = {"load": args.load, "iteration": model.iteration, "data_path": args.data_path,
              "microbatches": len(mbs), "tokens": int(sum(mb["tokens"].shape[1] for mb in mbs)),
              "documents": int(sum(mb["cu_seqlens"].numel() - 1 for mb in mbs)),
              "sb_topk": topk, "sb_block_size": block, "num_layers": num_layers,
              "dense_layers": sorted(dense_layers),
              "budgets": {n: [p for p, _ in t] for n, t in budget_arms.items()},
              "q_k_from": "dense forward (every arm scored on the same q, k)"}
    rep = {"arms": arms_out, "config": config}
    title = f"{args.load} (iteration {model.iteration}), block {block}"
    if steps is not None:
        config["step_times"] = args.step_times
        rep["frontier"] = frontier(arms_out, steps)
    if args.plot:
        plot(args.plot, arms_out, title)
        if steps is not None:
            plot_frontier(frontier_path(args.plot), rep["frontier"], title)
    if args.json:
        print(json.dumps(rep))
    else:
        for name, a in arms_out.items():
            print(f"{name:<16} mean {a['mean']:.4f}  density {a['density']:.3f}  per layer "
                  + " ".join(f"{x:.3f}" for x in a["per_layer"]))
            if "vs_static" in a:
                print(f"{'':<16} vs static per layer " + "  ".join(
                    f"{c['diff']:+.4f} [{c['ci95'][0]:+.4f}, {c['ci95'][1]:+.4f}]"
                    for c in a["vs_static"]["per_layer"]))
        for p in rep.get("frontier", []):
            print(f"frontier {p['arm']:<20} {p['ms_per_1k_tokens']:.2f} ms/1K tokens  recall {p['recall_mean']:.4f}"
                  + (f"  dominated by {', '.join(p['dominated_by'])}" if p["dominated_by"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
