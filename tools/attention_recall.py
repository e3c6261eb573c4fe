"""Attention recall of a pretrain_gpt.py checkpoint under each arm's top-k budgets.

Recall (:mod:`sparsebalance.eval.recall`): per query, the fraction of its dense
causal softmax mass (inside its own document) on the key blocks block top-k
routing keeps; reported per layer and head as the mean over queries.

The model is built and loaded as ``tools/eval_longctx.py`` does (PP=1, the
driver's ``load_weights``) with dense attention, and runs its forward on
held-out packed micro-batches: the valid part of ``--split`` (the checkpoint's
by default), packed like the driver's validation loader. A forward pre-hook on
every layer's ``core_attention`` module takes q ``[T, H, D]`` (after RoPE) and
k ``[T, Hkv, D]`` and scores every arm on the same q and k, so arms differ
only in their budgets:

* ``static``: ``--sb-topk`` (default: the checkpoint's) for every micro-batch;
* ``dense``: recall 1.0;
* ``--budgets NAME=FILE`` (repeatable): a DST budget table, JSON with key
  ``budget`` of shape ``[dp][microbatch][stage]`` (the driver's
  ``--sb-timeline`` ``*.predicted.json`` files). Held-out micro-batch ``i``
  takes row ``i mod (dp * microbatches)`` of the flattened table; layer ``l``
  (1-based) belongs to stage ``(l - 1) // (num_layers / stages)`` as in the driver.

Layers the checkpoint kept dense (``--sb-dense-layers``) have recall 1.0 in
every arm, as in training. Output: one JSON object
``{"arms": {arm: {"mean", "per_layer", "per_layer_head", "density", "queries"}}, "config": {...}}``
with ``--json`` (a short table otherwise); ``--plot PNG`` draws recall per layer per arm.

Tiny CPU run::

    OMP_NUM_THREADS=2 .venv/bin/python tools/attention_recall.py --load runs/demo/ckpt \\
        --data-path data/tiny --train-args "--num-layers 4 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 512" --num-microbatches 2 --budgets dst=runs/demo/timeline/step_0000010.predicted.json --json

GPU cluster run (one GPU; the model is built with PP=1)::

    python tools/attention_recall.py --load /lustre/ckpt/run1 --data-path /lustre/data/prolong \\
        --num-microbatches 16 --budgets sparsebalance=/lustre/run1/timeline/step_0001000.predicted.json \\
        --json --plot /lustre/ckpt/run1/recall.png > /lustre/ckpt/run1/recall.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402

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
    p.add_argument("--budgets", action="append", default=[], metavar="NAME=FILE",
                   help="an arm with per-micro-batch, per-stage budgets (JSON key 'budget' [dp][mb][stage])")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS)")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw recall per layer per arm")
    return p


def read_budget_arms(specs: list[str]) -> dict:
    """``NAME=FILE`` -> {name: (path, int64 array [rows, stages])}; bad input exits 2."""
    import numpy as np

    arms = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            fail(f"--budgets: expected NAME=FILE, got {spec!r}")
        if name in ("static", "dense") or name in arms:
            fail(f"--budgets: arm name {name!r} is taken")
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except OSError as e:
            fail(f"--budgets {name}: cannot read {path} ({e.strerror})")
        except ValueError as e:
            fail(f"--budgets {name}: {path} is not JSON ({e})")
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
        arms[name] = (path, b.astype(np.int64).reshape(-1, b.shape[2]))
    return arms


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
    """Forward every micro-batch; per arm, per layer, the pooled :class:`Recall`.

    ``arms``: {name: callable(microbatch index, layer number) -> top-k or None (dense)}.
    """
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from sparsebalance.attention.dense import CausalVarlenAttention
    from sparsebalance.eval.recall import block_topk_recall

    cores = [m for m in model.gpt.modules() if isinstance(m, CausalVarlenAttention)]
    out = {name: {} for name in arms}
    state = {"mb": 0}

    def hook(module, args, kwargs):
        q, k = args[0], args[1]
        cu = kwargs["packed_seq_params"].cu_seqlens_q
        layer = int(module.layer_number)
        for name, budget_of in arms.items():
            t = None if layer in dense_layers else budget_of(state["mb"], layer)
            r = block_topk_recall(q.detach(), k.detach(), cu, t, block_size, module.softmax_scale)
            prev = out[name].get(layer)
            out[name][layer] = r if prev is None else prev + r

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


def report(per_arm: dict) -> dict:
    """{arm: {"mean", "per_layer", "per_layer_head", "density", "queries"}} from pooled recalls."""
    arms = {}
    for name, layers in per_arm.items():
        ordered = [layers[n] for n in sorted(layers)]
        per_head = [r.per_head.tolist() for r in ordered]
        per_layer = [sum(h) / len(h) for h in per_head]
        kept, causal = sum(r.kept_pairs for r in ordered), sum(r.causal_pairs for r in ordered)
        arms[name] = {"mean": sum(per_layer) / len(per_layer), "per_layer": per_layer,
                      "per_layer_head": per_head, "density": kept / causal if causal else 1.0,
                      "queries": ordered[0].queries}
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
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    budget_arms = read_budget_arms(args.budgets)
    from eval_longctx import open_eval_model

    model, args.threads = open_eval_model(args.load, args.train_args, args.threads, fail, sparse=False,
                                          sb_topk=None, sb_block_size=None, backend=None)
    try:
        margs = model.args
        topk = args.sb_topk if args.sb_topk is not None else int(margs.sb_topk)
        block = args.sb_block_size or int(margs.sb_block_size)
        num_layers = int(margs.num_layers)
        arms = {"static": lambda m, layer: topk, "dense": lambda m, layer: None}
        for name, (path, rows) in budget_arms.items():
            stages = rows.shape[1]
            if num_layers % stages:
                fail(f"--budgets {name}: {stages} stages in {path} do not divide the model's {num_layers} layers")
            per = num_layers // stages
            arms[name] = lambda m, layer, rows=rows, per=per: int(rows[m % len(rows), (layer - 1) // per])
        mbs = heldout_microbatches(args, margs, int(model.gpt.vocab_size))
        dense_layers = frozenset(int(x) for x in (getattr(margs, "sb_dense_layers", None) or ()))
        per_arm = score(model, mbs, arms, block, dense_layers)
    finally:
        model.close()
    arms_out = report(per_arm)
    config = {"load": args.load, "iteration": model.iteration, "data_path": args.data_path,
              "microbatches": len(mbs), "tokens": int(sum(mb["tokens"].shape[1] for mb in mbs)),
              "documents": int(sum(mb["cu_seqlens"].numel() - 1 for mb in mbs)),
              "sb_topk": topk, "sb_block_size": block, "num_layers": num_layers,
              "dense_layers": sorted(dense_layers), "budgets": {n: p for n, (p, _) in budget_arms.items()},
              "q_k_from": "dense forward (every arm scored on the same q, k)"}
    rep = {"arms": arms_out, "config": config}
    if args.plot:
        plot(args.plot, arms_out, f"{args.load} (iteration {model.iteration}), block {block}")
    if args.json:
        print(json.dumps(rep))
    else:
        for name, a in arms_out.items():
            print(f"{name:<16} mean {a['mean']:.4f}  density {a['density']:.3f}  per layer "
                  + " ".join(f"{x:.3f}" for x in a["per_layer"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
