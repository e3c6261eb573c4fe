"""The real-run campaign: corpus, latency profile, then every arm in a drift-robust order.

Order of work (each step's command is recorded in the result):

1. the corpus (``tools/make_corpus.py``) from the fixed :class:`CorpusRecipe`;
2. a latency profile of this machine (``tools/profile_latency.py --quick``, same model
   flags, DST's budget range, the corpus' length file and scale), once for the sparse
   layer and once for the dense one (the ``dense`` arm), so every arm's driver has
   a predictor (``--sb-profile``) and reports a predicted step time;
3. ``pretrain_gpt.py`` per arm (:func:`benchmarks.harness.compare.real.run_order`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from typing import Callable, Dict, List, Sequence

import numpy as np

from benchmarks.harness import forklaunch
from sparsebalance.io import atomic_write_text

from .arms import get_arm
from .corpus import corpus_stats, describe, length_file, make_corpus_quantile, realised_scale, source_lengths
from .real import RealConfig, RunResult, driver_command, launch, measured_steps, pool, python_exe, run_order
from .timelines import noise_penalty, timeline_stats


def _run_tool(cmd: List[str], cfg: RealConfig, log: Callable, what: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1")
    text = " ".join(shlex.quote(c) for c in cmd)
    log(f"[compare] {what}: OMP_NUM_THREADS={cfg.threads} {text}")
    t0 = time.time()
    p = forklaunch.run(cmd, env=env)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
        raise RuntimeError(f"{what} failed: {last}")
    log(f"[compare] {what}: done in {time.time() - t0:.0f} s")
    return text


def _cached(cmd: List[str], output: str, cfg: RealConfig, log: Callable, what: str) -> str:
    """Run ``cmd`` unless ``output`` exists and was made by the same command (a stamp
    file next to it), e.g. a profile of this machine made earlier with the same flags."""
    stamp = output + ".cmd.json"
    want = {"cmd": cmd[1:], "threads": cfg.threads}
    have = None
    if os.path.isfile(stamp) and os.path.isfile(output):
        with open(stamp) as fh:
            have = json.load(fh)
    if have is not None and have.get("cmd") == want["cmd"] and have.get("threads") == cfg.threads:
        log(f"[compare] {what}: reusing {output} (made {have.get('made', '?')} by the same command)")
        return " ".join(shlex.quote(c) for c in cmd) + f"  # reused, made {have.get('made', '?')}"
    text = _run_tool(cmd, cfg, log, what)
    want["made"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    atomic_write_text(stamp, json.dumps(want))
    return text


def _resampled_corpus(py: str, repo: str, lengths_dir: str, cfg: RealConfig, work: str,
                      log: Callable):
    """tools/make_corpus.py's corpus, lengths resampled from the recipe's length file;
    (info, the length file the profile reads, its scale)."""
    r = cfg.recipe
    src = source_lengths(lengths_dir, r.lengths_file)
    q = make_corpus_quantile(src, r)
    scale = realised_scale(src, r, q)
    prefix = os.path.join(work, "corpus")
    info: dict = {"corpus_prefix": prefix, "quantile": q, "scale": scale, "commands": {}}
    cmd = [py, os.path.join(repo, "tools", "make_corpus.py"), "--output-prefix", prefix,
           "--lengths", r.lengths_file, "--num-docs", str(r.num_docs), "--max-length",
           str(r.seq_length), "--quantile", f"{q:.6f}", "--seed", str(r.seed)]
    info["commands"]["corpus"] = _cached(cmd, prefix + ".idx", cfg, log, "corpus")
    rng = np.random.default_rng(r.seed)  # the same draw as tools/make_corpus.py
    picked = rng.choice(src, size=r.num_docs, replace=True).astype(np.float64)
    lengths = np.clip(np.rint(picked * scale), 2, r.seq_length).astype(np.int64)
    info["stats"] = corpus_stats(lengths, r)
    info["lengths_json"] = os.path.join(work, "corpus_lengths.json")
    atomic_write_text(info["lengths_json"], json.dumps(lengths.tolist()))
    info["recipe_lines"] = describe(r, info["stats"], q, scale)
    return info, length_file(lengths_dir, r.lengths_file), scale


def dataset_vocab(prefix: str) -> int:
    """Largest token id + 1 of the indexed dataset at ``prefix``; ValueError (one line) if it
    is missing or corrupt."""
    from megatron.training.indexed_io import open_dataset

    ds = open_dataset(prefix)
    dtype = np.dtype(ds.index.dtype)
    del ds
    return int(np.memmap(prefix + ".bin", dtype=dtype, mode="r").max()) + 1


def _user_corpus(cfg: RealConfig, work: str):
    """The user's indexed dataset as it is: its document lengths (clipped to the context, as
    the packers cut them) are the length file of the profile, at scale 1."""
    from tools.dataset_lengths import dataset_lengths

    r = cfg.recipe
    lengths = np.clip(np.asarray(dataset_lengths([cfg.data_path]), dtype=np.int64), 1, r.seq_length)
    text = json.dumps(lengths.tolist())
    # named by content: a cached profile is reused only for the same lengths
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    info: dict = {"corpus_prefix": cfg.data_path, "quantile": None, "scale": 1.0, "commands": {},
                  "stats": corpus_stats(lengths, r),
                  "lengths_json": os.path.join(work, f"corpus_lengths_{digest}.json")}
    atomic_write_text(info["lengths_json"], text)
    s = info["stats"]
    info["recipe_lines"] = [
        f"- the user's dataset `{cfg.data_path}` as it is: {s['documents']} documents, its token ids "
        f"the vocabulary (NullTokenizer, vocab {cfg.vocab_size}), longer ones cut to the context",
        *describe(r, s)]
    return info, info["lengths_json"], 1.0


def prepare(repo: str, lengths_dir: str, cfg: RealConfig, work: str, log: Callable,
            kinds: Sequence[str] = ("sparse", "dense")) -> dict:
    """Corpus and the profiles of ``kinds`` (the sparse layer always; the dense one for
    a dense arm); returns their paths, commands and the corpus statistics."""
    r = cfg.recipe
    py = python_exe(repo)
    if cfg.data_path is not None:
        info, lfile, scale = _user_corpus(cfg, work)
    else:
        info, lfile, scale = _resampled_corpus(py, repo, lengths_dir, cfg, work, log)
    kmin, kmax = max(1, r.topk // 2), 2 * r.topk
    for kind in kinds:
        path = os.path.join(work, f"profile_{kind}.json")
        cmd = [py, os.path.join(repo, "tools", "profile_latency.py"), "--quick", "--output", path,
               *cfg.model_flags(), "--length-files", lfile, "--length-scale", f"{scale:.6f}",
               "--threads", str(cfg.threads)]
        if kind == "sparse":
            cmd += ["--sparse-attention", "--budgets", str(kmin), str(r.topk), str(kmax)]
        info["commands"][f"profile_{kind}"] = _cached(cmd, path, cfg, log, f"profile ({kind})")
        info[f"profile_{kind}"] = path
    return info


def run_arms(repo: str, cfg: RealConfig, arms: Sequence[str], work: str, prep: dict,
             log: Callable) -> dict:
    """Launch every arm (see :func:`run_order`); returns runs, pooled metrics and drift."""
    py = python_exe(repo)
    runs: Dict[str, List[RunResult]] = {a: [] for a in arms}
    order = run_order(arms, cfg.rounds)
    log(f"[compare] {len(order)} runs, {cfg.iters} iterations each "
        f"({measured_steps(cfg)} measured after warm-up), order: "
        + ", ".join(f"{a}#{k}" for a, k in order))
    for arm_name, k in order:
        arm = get_arm(arm_name)
        d = os.path.join(work, "runs", f"{arm_name}-{k}")
        os.makedirs(os.path.join(d, "logs"), exist_ok=True)
        summary = os.path.join(d, "summary.json")
        if os.path.exists(summary):
            os.unlink(summary)
        profile = prep.get("profile_sparse" if arm.sparse else "profile_dense")
        cmd = driver_command(py, repo, cfg, arm, prep["corpus_prefix"], summary,
                             os.path.join(d, "logs"), profile, os.path.join(d, "timeline"))
        runs[arm_name].append(launch(cmd, cfg, arm_name, k, summary, d, log))
    pooled = {a: pool(rs) for a, rs in runs.items()}
    for a, p in pooled.items():
        if p is None:
            continue
        stats = [timeline_stats(os.path.join(work, "runs", f"{a}-{r.repeat}", "timeline"),
                                int(r.summary.get("warmup_steps_skipped", 0)))
                 for r in runs[a] if r.summary is not None]
        stats = [s for s in stats if s]
        noise = [noise_penalty(os.path.join(work, "runs", f"{a}-{r.repeat}", "timeline"),
                               int(r.summary.get("warmup_steps_skipped", 0)))
                 for r in runs[a] if r.summary is not None]
        noise = [x for x in noise if x]
        if noise:
            p["op_scatter"] = float(np.mean([x["op_scatter"] for x in noise]))
            p["noise_penalty"] = float(np.mean([x["penalty"] for x in noise]))
        if stats:
            p["replayed_step_ms"] = float(np.mean([s["replayed_ms"] for s in stats]))
            p["op_sum_error"] = float(np.mean([s["op_sum_predicted_ms"] / s["op_sum_measured_ms"] - 1
                                               for s in stats]))
    ratios, pairs = _ratios(runs, cfg)
    drift = None
    base = runs.get("megatron", [])
    if cfg.rounds == 1 and len(base) == 2 and all(r.summary for r in base):
        first, last = (float(np.median(r.summary["step_ms_all"][r.summary["warmup_steps_skipped"]:]))
                       for r in base)
        drift = (last - first) / first
    return {
        "order": [f"{a}#{k}" for a, k in order],
        "runs": [{"arm": r.arm, "repeat": r.repeat, "command": r.command,
                  "returncode": r.returncode, "wall_s": r.wall_s, "error": r.error,
                  "summary": r.summary} for rs in runs.values() for r in rs],
        "arms": {a: p for a, p in pooled.items() if p is not None},
        "failed": {a: [r.error for r in rs] for a, rs in runs.items() if pooled[a] is None},
        "baseline_drift": drift,
        "ratios_vs_megatron": ratios,
        "pairs": pairs,
        "dst_ops": _dst_ops(runs, cfg, work),
        "timelines": {a: os.path.join(work, "runs", f"{a}-0", "timeline") for a in arms},
    }


PAIRS = (("sparsebalance", "sab", "DST (critical-path) on top of SAB"),
         ("sparsebalance", "sparsebalance-inline", "DST planned ahead vs in line"),
         ("dst", "megatron", "DST alone on Megatron packing"),
         ("sparsebalance", "sparsebalance-anchor", "critical-path DST vs the paper's anchor rule, both on SAB"),
         ("sparsebalance-nocut", "sparsebalance", "DST that only raises vs DST that also cuts"),
         ("critical-path-eps0.05", "sparsebalance-anchor",
          "critical-path DST at slack 0.05 vs the anchor rule (both cut about 4% of the attention)"))
"""(arm, reference, what it isolates): throughput ratios reported when both arms ran."""


def _ratios(runs: Dict[str, List[RunResult]], cfg: RealConfig):
    """Per-round throughput ratios vs megatron and for :data:`PAIRS`, median + 95% CI
    (:mod:`benchmarks.harness.compare.stats`); one round pools both megatron runs."""
    from .stats import run_steps

    steps = {a: [run_steps(r.summary, r.repeat if cfg.rounds > 1 else 0)
                 for r in rs if r.summary is not None] for a, rs in runs.items()}
    return _ratios_of(steps)


def _ratios_of(steps: Dict[str, list]):
    from .stats import ratio_estimate

    ratios = {a: ratio_estimate(s, steps["megatron"]).as_dict()
              for a, s in steps.items() if a != "megatron" and s and steps.get("megatron")}
    pairs = {f"{a}/{b}": {**ratio_estimate(steps[a], steps[b]).as_dict(), "isolates": what}
             for a, b, what in PAIRS if steps.get(a) and steps.get(b)}
    return ratios, pairs


def pairs_of_real(real: dict) -> dict:
    """:data:`PAIRS` ratios recomputed from a saved ``real.json``'s run summaries (the same
    bootstrap, so pairs it already holds come out unchanged)."""
    from .stats import run_steps

    rounds = int(real.get("config", {}).get("rounds", 1))
    steps: Dict[str, list] = {}
    for r in real.get("runs", []):
        if r.get("summary") is not None:
            steps.setdefault(r["arm"], []).append(run_steps(r["summary"], r["repeat"] if rounds > 1 else 0))
    return _ratios_of(steps)[1]


def _dst_ops(runs: Dict[str, List[RunResult]], cfg: RealConfig, work: str) -> Dict[str, dict]:
    """Per round, sparsebalance's ops against the same ops of sab (same packing):
    :func:`benchmarks.harness.compare.timelines.paired_ops`."""
    from .timelines import paired_ops

    out = {}
    for r in runs.get("sparsebalance", []):
        ref = [x for x in runs.get("sab", []) if x.repeat == r.repeat and x.summary is not None]
        if r.summary is None or not ref:
            continue
        res = paired_ops(os.path.join(work, "runs", f"sparsebalance-{r.repeat}", "timeline"),
                         os.path.join(work, "runs", f"sab-{r.repeat}", "timeline"),
                         cfg.recipe.topk, int(r.summary.get("warmup_steps_skipped", 0)))
        if res is not None:
            out[str(r.repeat)] = res
    return out


def cpu_prediction(cfg: RealConfig, prep: dict) -> dict:
    """What the pipeline model + this machine's sparse profile predict for the real
    configuration (same corpus lengths, PP, M, routing; DP = 1): the arms' expected
    ratios before measurement, and a reference for the report's "why"."""
    from .cluster_sim import SimConfig, simulate_cell

    with open(prep["lengths_json"]) as fh:
        lengths = json.load(fh)
    r = cfg.recipe
    scfg = SimConfig(pp=cfg.ranks, dp=1, micro_batches=cfg.micro_batches, steps=cfg.iters,
                     seed=cfg.seed, cost_model=prep["profile_sparse"], block_size=r.block_size,
                     topk=r.topk, model=(("num_layers", cfg.num_layers),), threads=cfg.threads)
    return simulate_cell(lengths, r.seq_length, scfg).table
