#!/usr/bin/env python
"""Held-out loss at equal wall-clock: dense, static sparse and SparseBalance.

Every arm trains the same model from the same init (``--seed``) on the same corpus
(:class:`benchmarks.harness.compare.corpus.CorpusRecipe`, made by ``tools/make_corpus.py``
through :func:`benchmarks.harness.compare.campaign.prepare`, which also profiles the layer
for SparseBalance's predictor) for the same wall-clock budget, then is scored with
DENSE attention on held-out long documents. Arms (``pretrain_gpt.py`` flags):

* ``dense``: full causal attention, Megatron packing (compare arm ``dense``);
* ``static``: ``--sparse-attention``, Megatron packing, static top-k (compare arm ``megatron``);
* ``sparsebalance``: ``--sparse-balance --sb-profile PROFILE`` (SAB + critical-path DST, slack 0);
* ``sab`` (only with ``--arms``): SAB packing with the static top-k (compare arm ``sab``),
  which splits SparseBalance's difference to ``static`` into packing and budgets.

Budget: ``--budget-s`` seconds of training per arm. The clock starts when every
training worker has installed its SIGUSR1 handler (the driver does so after setup,
right before its first step: start-up is excluded, as it varies by tens of seconds
with the load of a shared machine); then the tool sends SIGUSR1 to the workers
(``--exit-signal-handler``): they finish the step in flight, save a checkpoint and
exit 0. The LR is constant after warm-up so the cut does not interact with a schedule. Runs are seed-major with
the arm order rotated per seed (each arm first, middle and last equally often), so
the drift of a shared machine hits every arm alike.

Held-out set: the corpus is split ``--split 90,10,0`` by document; training reads
only the train part (``--eval-interval 0``); the held-out set is the first
documents of the valid part longer than twice the top-k cap (where sparse
attention drops keys), the same for every arm and seed. Loss = summed next-token
cross entropy over those documents / their predicted tokens (each document
attends only within itself).

Output: per arm the mean held-out loss over seeds with a 95% t-interval, steps and
tokens trained within the budget; the paired (same seed) differences
sparsebalance - static, sparsebalance - dense, static - dense and, with ``sab``,
sab - static and sparsebalance - sab, with a 95% t-interval and a verdict
("beyond noise" when the interval excludes 0). JSON on stdout with ``--json``, to
``--out`` (atomically), a bar plot with ``--plot``; progress on stderr.

Tiny CPU run (about 1.5 minutes on a quiet 2-core machine; numbers mean nothing)::

    .venv/bin/python benchmarks/heldout_loss.py --smoke --json

The committed comparison (2-core CPU, ~35 min on a quiet machine; ``docs/results.md``)::

    .venv/bin/python benchmarks/heldout_loss.py --budget-s 200 --seeds 1,2,3 \\
        --out results/heldout_loss.json --plot results/heldout_loss.png

Where SparseBalance's difference to static comes from (packing or budgets)::

    .venv/bin/python benchmarks/heldout_loss.py --arms static,sab,sparsebalance --budget-s 200 \\
        --seeds 1,2,3 --workdir runs/heldout-sab --out results/heldout_loss_sab.json

GPU: the runs are CPU runs (torchrun, ``--cpu``, gloo, PP=2), sized for 2 cores; on one
GPU the arms' comparison is ``examples/longctx/gpu.sh`` (retrieval accuracy).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
import time
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")

from benchmarks.harness import forklaunch  # noqa: E402
from megatron.training import quiet_optional_extras  # noqa: E402
from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402

quiet_optional_extras()

PROG = "heldout_loss.py"
ARM_NAMES = ("dense", "static", "sab", "sparsebalance")
"""Every arm the tool can run, in report order."""
DEFAULT_ARMS = ("dense", "static", "sparsebalance")
ARM_COLORS = {"dense": "0.6", "static": "tab:orange", "sab": "tab:green", "sparsebalance": "tab:blue"}
SPLIT = "90,10,0"
KILL_AFTER_S = 300.0  # a run still alive this long after its stop signal is killed (it then fails)


def fail(message: str, code: int = 2) -> NoReturn:
    usage_error(message, prog=PROG, code=code)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _seeds(text: str) -> list:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 0 or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"expected distinct integers >= 0, got {text!r}")
    return vals


def _arms(text: str) -> list:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in ARM_NAMES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct arms from {','.join(ARM_NAMES)}, got {text!r}")
    return [x for x in ARM_NAMES if x in names]


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--budget-s", type=float, default=None,
                   help="training seconds per arm and seed, start-up excluded (default 200; smoke 10)")
    p.add_argument("--seeds", type=_seeds, default=None, help="comma list (default 1,2,3; smoke 1,2)")
    p.add_argument("--heldout-docs", type=int, default=None,
                   help="held-out documents scored (default 24; smoke 4)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny corpus and model, short budget: checks the pipeline, numbers mean nothing")
    p.add_argument("--arms", type=_arms, default=None,
                   help=f"comma list from {','.join(ARM_NAMES)} (default {','.join(DEFAULT_ARMS)})")
    p.add_argument("--workdir", default=None,
                   help="corpus, profile, checkpoints and logs (default runs/heldout; smoke runs/heldout-smoke)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the result here (atomically)")
    p.add_argument("--plot", default=None, metavar="PNG", help="bar plot of held-out loss per arm")
    return p


def check_args(a) -> None:
    a.budget_s = a.budget_s if a.budget_s is not None else (10.0 if a.smoke else 200.0)
    a.seeds = a.seeds or ([1, 2] if a.smoke else [1, 2, 3])
    a.arms = a.arms or list(DEFAULT_ARMS)
    a.heldout_docs = a.heldout_docs if a.heldout_docs is not None else (4 if a.smoke else 24)
    a.workdir = a.workdir or os.path.join(REPO, "runs", "heldout-smoke" if a.smoke else "heldout")
    if not 0 < a.budget_s < float("inf"):
        fail(f"--budget-s must be a finite number > 0, got {a.budget_s:g}")
    if a.heldout_docs < 1:
        fail(f"--heldout-docs must be >= 1, got {a.heldout_docs}")
    for flag, path in (("--out", a.out), ("--plot", a.plot)):
        if path is not None:
            d = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(d):
                fail(f"{flag}: directory {d} does not exist")
            if os.path.isdir(path):
                fail(f"{flag}: {path} is a directory")
    if os.path.isfile(a.workdir):
        fail(f"--workdir: {a.workdir} is a file")


def real_config(smoke: bool):
    """Model, corpus and routing. Full: the compare tool's real-run configuration
    (8K-token micro-batches, block 64, top-30: cap 2048 keys, a quarter of the
    context); smoke: the same shape, 1K tokens, a few hundred documents."""
    from benchmarks.harness.compare.corpus import CorpusRecipe
    from benchmarks.harness.compare.real import RealConfig

    if smoke:
        return RealConfig(recipe=CorpusRecipe(num_docs=200, seq_length=1024, topk=2, scale=0.125),
                          hidden_size=32, ffn_hidden_size=64, micro_batches=2, lr=3e-3)
    return RealConfig()


def arm_flags(name: str, profile: str) -> list:
    from benchmarks.harness.compare.arms import ARMS

    if name == "dense":
        return ARMS["dense"].driver_flags()
    if name == "static":
        return ARMS["megatron"].driver_flags()
    if name == "sab":
        return [*ARMS["sab"].driver_flags(), "--sb-profile", profile]
    return ["--sparse-balance", "--sb-profile", profile]


def train_command(py: str, cfg, arm: str, seed: int, prefix: str, profile: str, run_dir: str) -> list:
    return [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cfg.ranks),
            "--log-dir", os.path.join(run_dir, "logs"), "--redirects", "3",
            os.path.join(REPO, "pretrain_gpt.py"), "--cpu", "--distributed-backend", "gloo",
            "--data-path", prefix, "--split", SPLIT, *cfg.model_flags(),
            "--global-batch-size", str(cfg.micro_batches), "--lr", f"{cfg.lr:g}",
            "--lr-decay-style", "constant", "--lr-warmup-iters", "2", "--train-iters", "1000000",
            "--clip-grad", "1.0", "--seed", str(seed), "--log-interval", "1", "--eval-interval", "0",
            "--no-progress-bar", "--save", os.path.join(run_dir, "ckpt"), "--save-interval", "0",
            "--exit-signal-handler", "--summary-json", os.path.join(run_dir, "summary.json"),
            *arm_flags(arm, profile)]


def _children(pid: int) -> list:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def catches_usr1(pid: int) -> bool:
    """True once process ``pid`` has a SIGUSR1 handler installed (/proc SigCgt mask)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    except OSError:
        pass
    return False


def train_for_budget(cmd: list, workers: int, budget_s: float, threads: int, run_dir: str,
                     start_timeout_s: float = 600.0) -> dict:
    """Run ``cmd`` (torchrun with ``workers`` workers) for ``budget_s`` seconds of training,
    then send SIGUSR1 once to each worker; returns times in seconds since launch.

    The budget starts when every worker has installed its SIGUSR1 handler, which the
    driver does after setup (model, optimizer, data, checkpoint loading) right before
    its first step (``start_s``): start-up is excluded, since on a shared machine it
    varies by tens of seconds with the load. Workers start with USR1 ignored (an early
    signal cannot kill one) and are signalled once: Python restores the default action
    while a process shuts down, so a repeated signal could kill a worker that is
    already exiting cleanly. A run not started within ``start_timeout_s``, or alive
    ``KILL_AFTER_S`` after its budget, is killed.
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    with open(os.path.join(run_dir, "stdout.txt"), "w") as so, \
            open(os.path.join(run_dir, "stderr.txt"), "w") as se:
        t0 = time.time()
        proc = forklaunch.popen(cmd, stdout=so, stderr=se, env=env, ignore_usr1=True, start_new_session=True)
        start, signal_at, signalled = None, None, 0
        try:
            while proc.poll() is None:
                now = time.time() - t0
                if start is None:
                    pids = _children(proc.pid)
                    if len(pids) == workers and all(catches_usr1(p) for p in pids):
                        start = now
                    elif now > start_timeout_s:
                        os.killpg(proc.pid, signal.SIGKILL)
                elif signal_at is None and now >= start + budget_s:
                    for pid in _children(proc.pid):
                        try:
                            os.kill(pid, signal.SIGUSR1)
                            signalled += 1
                        except ProcessLookupError:
                            pass
                    signal_at = now
                elif signal_at is not None and now - signal_at > KILL_AFTER_S:
                    os.killpg(proc.pid, signal.SIGKILL)
                time.sleep(0.1)
        finally:  # interrupted (Ctrl-C): the run is in its own session, end it too
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        wall = time.time() - t0
    summary = None
    path = os.path.join(run_dir, "summary.json")
    if proc.returncode == 0 and os.path.isfile(path):
        with open(path) as fh:
            summary = json.load(fh)
    return {"returncode": proc.returncode, "wall_s": wall, "start_s": start, "signal_at_s": signal_at,
            "workers_signalled": signalled, "summary": summary}


def _evaluate_worker(jobs: list, prefix: str, doc_ids: list, threads: int, queue) -> None:
    """Child process: dense held-out loss of each ``(load, train_flags)`` in ``jobs``."""
    try:
        queue.put(("ok", [heldout_loss(load, flags, prefix, doc_ids, threads) for load, flags in jobs]))
    except BaseException as e:  # reported as one line by the parent
        queue.put(("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))


def heldout_loss(load: str, train_flags: str, prefix: str, doc_ids: list, threads: int) -> dict:
    """Summed next-token cross entropy of the documents ``doc_ids`` under the checkpoint
    in ``load`` with dense attention: ``{"loss", "tokens", "iteration"}``."""
    import torch

    from benchmarks.harness.longctx.model import EvalModelError, open_eval_model
    from megatron.training.indexed_io import open_dataset

    def raise_(message, code=2):
        raise EvalModelError(message, code)

    model, _ = open_eval_model(load, train_flags, threads, raise_, sparse=False, sb_topk=None,
                               sb_block_size=None, backend=None)
    try:
        ds = open_dataset(prefix)
        total, count = 0.0, 0
        with torch.no_grad():
            for i in doc_ids:  # one document per forward: it attends only within itself
                seq = torch.as_tensor(ds[int(i)].astype("int64"))
                logits = model.logits([seq])[0]
                total += float(torch.nn.functional.cross_entropy(logits[:-1], seq[1:], reduction="sum"))
                count += int(seq.numel()) - 1
    finally:
        model.close()
    return {"loss": total / count, "tokens": count, "iteration": model.iteration}


def evaluate(jobs: list, prefix: str, doc_ids: list, threads: int) -> list:
    """:func:`heldout_loss` of every job, in one fresh process (a clean torch.distributed)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_evaluate_worker, args=(jobs, prefix, doc_ids, threads, queue))
    p.start()
    status, payload = queue.get()
    p.join()
    if status != "ok":
        raise RuntimeError(f"held-out evaluation failed: {payload}")
    return payload


def bar(done: int, total: int, width: int = 24) -> str:
    n = int(width * done / max(total, 1))
    return "[" + "#" * n + "." * (width - n) + f"] {done}/{total}"


def summarize(runs: list) -> dict:
    """Per arm mean loss with interval, steps, tokens; paired differences."""
    from benchmarks.harness.compare.heldout import mean_interval, paired_difference

    arms, by_seed = {}, {}
    for name in ARM_NAMES:
        rs = [r for r in runs if r["arm"] == name and r.get("heldout_loss") is not None]
        if not rs:
            continue
        by_seed[name] = {r["seed"]: r["heldout_loss"] for r in rs}
        arms[name] = {**mean_interval([r["heldout_loss"] for r in rs]),
                      "per_seed": {str(r["seed"]): r["heldout_loss"] for r in rs},
                      "steps": [r["steps"] for r in rs], "tokens": [r["tokens"] for r in rs],
                      "steps_mean": sum(r["steps"] for r in rs) / len(rs),
                      "tokens_mean": sum(r["tokens"] for r in rs) / len(rs),
                      "wall_s": [r["wall_s"] for r in rs]}
    diffs = {}
    for a, b in (("sparsebalance", "static"), ("sparsebalance", "dense"), ("static", "dense"),
                 ("sab", "static"), ("sparsebalance", "sab")):
        if a in by_seed and b in by_seed:
            d = paired_difference(by_seed[a], by_seed[b])
            if d is not None:
                diffs[f"{a} - {b}"] = d
    return {"arms": arms, "differences": diffs}


def plot(path: str, result: dict) -> None:
    """Mean held-out loss per arm with its 95% interval and each seed as a dot (atomic PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparsebalance.io import atomic_path

    arms = result["arms"]
    names = [n for n in ARM_NAMES if n in arms]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for i, n in enumerate(names):
        a = arms[n]
        lo, hi = a["ci95"] if a["ci95"] else (a["mean"], a["mean"])
        ax.bar(i, a["mean"], color=ARM_COLORS[n], alpha=0.8)
        ax.errorbar(i, a["mean"], yerr=[[a["mean"] - lo], [hi - a["mean"]]], color="k", capsize=6)
        ax.scatter([i] * len(a["per_seed"]), list(a["per_seed"].values()), color="k", s=10, zorder=3)
        ax.text(i, hi, f"{a['mean']:.3f}\n{a['steps_mean']:.0f} steps", ha="center", va="bottom", fontsize=7)
    tops = [max([*arms[n]["per_seed"].values(), *(arms[n]["ci95"] or [arms[n]["mean"]])]) for n in names]
    ax.set_ylim(0, 1.2 * max(tops))
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.set_ylabel("held-out loss, dense attention (nats/token)")
    cfg = result["config"]
    ax.set_title(f"equal wall-clock {cfg['budget_s']:g} s per arm, {len(cfg['seeds'])} seeds "
                 f"(mean, 95% t-interval, seeds as dots)", fontsize=8)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def run(a) -> dict:
    import numpy as np

    from benchmarks.harness.compare.campaign import prepare
    from benchmarks.harness.compare.heldout import heldout_documents, interleaved_order
    from benchmarks.harness.compare.real import python_exe
    from megatron.training import data as D
    from megatron.training.arguments import _split
    from megatron.training.indexed_io import open_dataset

    cfg = real_config(a.smoke)
    os.makedirs(a.workdir, exist_ok=True)
    prep = prepare(REPO, LENGTHS_DIR, cfg, a.workdir, log, kinds=("sparse",))
    prefix, profile = prep["corpus_prefix"], prep["profile_sparse"]
    ds = open_dataset(prefix)
    lengths = np.array(ds.sequence_lengths, dtype=np.int64)  # a copy: the index is memory-mapped
    train_ids, valid_ids, _ = D.split_documents(len(lengths), _split(SPLIT))
    min_len = 2 * cfg.recipe.cap
    docs = heldout_documents(lengths, train_ids, valid_ids, min_len, a.heldout_docs)
    py = python_exe(REPO)
    order = interleaved_order(a.arms, a.seeds)
    log(f"[heldout] {len(order)} runs of {a.budget_s:g} s, order: " + ", ".join(f"{x}#{s}" for x, s in order))
    runs = []
    for i, (arm, seed) in enumerate(order):
        run_dir = os.path.join(a.workdir, "runs", f"{arm}-seed{seed}")
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.join(run_dir, "logs"))
        cmd = train_command(py, cfg, arm, seed, prefix, profile, run_dir)
        log(f"[heldout] {bar(i, len(order))} training {arm} seed {seed}")
        r = train_for_budget(cmd, cfg.ranks, a.budget_s, cfg.threads, run_dir)
        s = r["summary"]
        if s is None:
            with open(os.path.join(run_dir, "stderr.txt"), errors="replace") as fh:
                errs = [ln.strip() for ln in fh if "error" in ln.lower()]
            raise RuntimeError(f"training {arm} seed {seed} failed (exit {r['returncode']}): "
                               f"{errs[-1] if errs else 'see ' + run_dir}")
        runs.append({"arm": arm, "seed": seed, "position": i, "run_dir": run_dir,
                     "command": " ".join(shlex.quote(c) for c in cmd),
                     "wall_s": r["wall_s"], "start_s": r["start_s"], "signal_at_s": r["signal_at_s"],
                     "workers_signalled": r["workers_signalled"],
                     "train_s": r["wall_s"] - r["start_s"],
                     "stopped_by_signal": bool(s.get("preempted")), "steps": int(s["iterations"]),
                     "tokens": int(s["tokens"]), "tokens_per_s": s["tokens_per_s"],
                     "median_step_s": s["median_step_s"], "train_loss_last": s["last_loss"],
                     "density": s.get("density_mean")})
        log(f"[heldout] {arm} seed {seed}: {r['wall_s']:.0f} s, {s['iterations']} steps, "
            f"{s['tokens']} tokens, last train loss {s['last_loss']:.3f}")
    log(f"[heldout] {bar(len(order), len(order))} trained; scoring {len(docs)} held-out documents "
        f"(> {min_len} tokens) with dense attention")
    flags = " ".join(shlex.quote(x) for x in cfg.model_flags())
    scores = evaluate([(os.path.join(r["run_dir"], "ckpt"), flags) for r in runs], prefix,
                      [int(x) for x in docs], 2 * cfg.threads)
    for r, sc in zip(runs, scores):
        r["heldout_loss"], r["checkpoint_iteration"] = sc["loss"], sc["iteration"]
    out = summarize(runs)
    out["heldout"] = {"doc_ids": [int(x) for x in docs], "lengths": [int(lengths[x]) for x in docs],
                      "tokens_scored": scores[0]["tokens"], "min_length": min_len,
                      "train_ids": [int(train_ids[0]), int(train_ids[-1]) + 1],
                      "valid_ids": [int(valid_ids[0]), int(valid_ids[-1]) + 1], "split": SPLIT,
                      "attention": "dense"}
    out["runs"] = runs
    out["config"] = {**cfg.as_dict(), "budget_s": a.budget_s, "seeds": a.seeds, "smoke": a.smoke,
                     "arms": a.arms, "arm_flags": {n: arm_flags(n, profile) for n in a.arms},
                     "order": [f"{x}#{s}" for x, s in order], "prep_commands": prep["commands"],
                     "corpus": prep["stats"]}
    out["notes"] = [
        "Equal wall-clock: budget_s seconds of training per arm, counted from the moment every worker has "
        "installed its SIGUSR1 handler (after setup, right before the first step; start_s = start-up) to "
        "SIGUSR1 (--exit-signal-handler); the step in flight then finishes and a checkpoint is saved "
        "(train_s = start to exit). Steps/tokens count every step the run took.",
        "Runs are interleaved seed-major with the arm order rotated per seed, so drift in the machine's "
        "load hits all arms alike; on a shared machine absolute speeds are contended.",
        "Corpus text is a first-order word Markov chain (tools/make_corpus.py): predicting it needs no "
        "long-range context, so the held-out loss measures how far each arm trained in the budget and "
        "whether sparse-attention training hurts the weights under dense attention, not retrieval.",
        "Intervals: 95% Student-t over seeds; differences are paired by seed (same init and document stream; "
        "SAB packs the stream differently).",
    ]
    return out


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_args(a)
    t0 = time.time()
    try:
        result = run(a)
    except (RuntimeError, OSError, ValueError) as e:
        print(f"{PROG}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    result["command"] = "benchmarks/heldout_loss.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["seconds"] = time.time() - t0
    if a.out:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
    if a.plot:
        plot(a.plot, result)
    if a.json:
        print(json.dumps(result))
    else:
        for n, x in result["arms"].items():
            ci = "n/a" if x["ci95"] is None else f"[{x['ci95'][0]:.4f}, {x['ci95'][1]:.4f}]"
            print(f"{n:<14} held-out loss {x['mean']:.4f} 95% {ci}  steps {x['steps_mean']:.0f}  "
                  f"tokens {x['tokens_mean']:.0f}")
        for k, d in result["differences"].items():
            ci = "n/a" if d["ci95"] is None else f"[{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
            print(f"{k:<24} {d['mean']:+.4f} 95% {ci}  {d['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
