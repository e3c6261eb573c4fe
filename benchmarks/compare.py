#!/usr/bin/env python
"""End-to-end evaluation: SparseBalance vs the Megatron baseline and the peers.

``--mode sim``: cluster-scale simulation (packers + DST planners + megatron's 1F1B
model + a cost model) at PP=8, DP=8, M=32, seq-length 64K and 128K, on every shared
length file. ``--mode real``: ``pretrain_gpt.py`` per arm under torchrun (gloo,
CPU, PP=2 on 2 cores; ``--ranks 4`` for PP=4 oversubscribed) on a fixed corpus
recipe, after profiling this machine's layer latency. ``--mode all``: both.
``--report DIR`` stores the raw results (sim.json, real.json) and writes DIR/report.md
with PNG figures (results of the other mode already in DIR are included).
``--scaling`` (sim mode) runs the scaling study instead: context 32K-256K, three model
shapes, PP 4-16, DP 8-64, CP 1-4 (the cells in benchmarks/harness/compare/scaling.py),
saving DIR/scaling.json and the scaling_*.png figures.
``--regime`` (sim mode): where balance pays, WLB-LLM's regime of PP micro-batches per
replica, dense and sparse (benchmarks/harness/compare/regime.py; DIR/regime.{json,md,png});
``--wlb-validation``: the simulator against WLB-LLM's published numbers
(benchmarks/harness/compare/wlb_validation.py; DIR/validation.{json,md}).
``--mode sim --json`` prints ``{"cost_model", "cells": [{"model", "context", "pp", "dp",
"cp", "arms": {arm: tokens_per_s}, "best_baseline", "sb_vs_best"}]}``
(benchmarks/harness/compare/cells.py); ``--mode real|all --json`` prints the summary object
(arms, speedup_vs_megatron, sim, validation), which ``--report`` always saves as
DIR/summary.json. Without
``--json``, real runs end with a side-by-side table: per arm tokens/s, the throughput
ratio vs megatron as the median over ``--rounds`` interleaved rounds with a 95%
bootstrap interval, retained attention vs static top-k on the same documents,
micro-batch imbalance, bubble per stage and planning time; then the ratios that
isolate one mechanism (DST on top of SAB, planning ahead vs in line) with a verdict
(beyond or within noise). ``make demo`` is this table for megatron vs sparsebalance.

``--sim-cp 1,2`` (the default) also simulates every cell with context parallelism 2
(the paper's SP2: each micro-batch split over 2 ranks, K/V all-gathered per layer;
the predictor charges the slowest CP rank, see sparsebalance/predictor/context_parallel.py);
``--sim-cp 1`` is the simulation without it.

Tiny CPU run (simulation, under a minute)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode sim --quick --json

Full evaluation on the 2-core CPU machine (simulation + real runs, background it)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode all --report results/compare
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode real --quick --report results/compare
    .venv/bin/python benchmarks/compare.py --mode real --rounds 3 --iters 23 \
        --arms megatron,sab,sparsebalance,sparsebalance-inline --report results/compare

Scaling study (a few minutes on one core; --quick: three cells)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode sim --scaling --json \
        --report results/scaling > results/scaling/cells.json

The same cells under threshold routing, each document's density drawn from a sparsity
study's measured documents (``--density-mode bucket-mean``: each replaced by its length
bucket's mean; benchmarks/harness/compare/density_study.py says how documents are drawn)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compare.py --mode sim --scaling --routing threshold \
        --density-study results/sparsity_study_real.json --report results/scaling_threshold

``--cost-model auto`` (the default) uses the first GPU-measured latency profile
committed as results/gpu_check/*profile*.json that loads, h100-analytic otherwise; the
JSON's ``cost_model`` says which.

GPU cluster (simulation with a profile of the target GPU instead of h100-analytic)::

    python benchmarks/compare.py --mode sim --cost-model profiles/qwen05b_h100.json \\
        --sim-models qwen05b --report results/compare_h100
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
LENGTHS_DIR = os.path.join(REPO, "data", "lengths")


class UsageError(Exception):
    """Bad command line (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _ints(text: str) -> list:
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _taus(text: str) -> tuple:
    from sparsebalance.config import check_ladder

    try:
        vals = tuple(float(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated TAUs, got {text!r}")
    why = check_ladder(vals, min(vals) if vals else 0.5)
    if why:
        raise argparse.ArgumentTypeError(why)
    return vals


def _names(text: str) -> list:
    return [x for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="benchmarks/compare.py", description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--mode", choices=("sim", "real", "all", "report"), default="sim",
                   help="report: only re-render DIR/report.md from the results saved in DIR "
                        "(the arm-pair ratios are recomputed from the saved runs)")
    p.add_argument("--report", metavar="DIR", help="write raw results, report.md and PNGs here")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--quick", action="store_true",
                   help="short: 2 sim steps (scaling: 3 cells); real: one round of 23 "
                        "iterations, no frontier")
    p.add_argument("--scaling", action="store_true",
                   help="sim mode: the scaling study (benchmarks/harness/compare/scaling.py) "
                        "instead of --sim-models x --seq-lengths x --sim-cp at --pp/--dp")
    p.add_argument("--scaling-models", type=_names, default=None, metavar="MODELS",
                   help="--scaling: only the cells of these models (comma list)")
    p.add_argument("--regime", action="store_true",
                   help="sim mode: where balance pays (benchmarks/harness/compare/regime.py): M in "
                        "{PP, 2xPP, 32}, dense/top-k/threshold, 64K-160K, PP 4 and 8")
    p.add_argument("--wlb-validation", action="store_true",
                   help="sim mode: the simulator against WLB-LLM's published numbers "
                        "(benchmarks/harness/compare/wlb_validation.py)")
    g = p.add_argument_group("simulation")
    g.add_argument("--lengths", nargs="*", default=None,
                   help="length files, e.g. your corpus' from tools/dataset_lengths.py (default data/lengths/*.json)")
    g.add_argument("--seq-lengths", type=_ints, default=[65536, 131072])
    g.add_argument("--pp", type=int, default=8)
    g.add_argument("--dp", type=int, default=8)
    g.add_argument("--micro-batches", type=int, default=32)
    g.add_argument("--sim-steps", type=int, default=None, help="steps per cell (default 6; quick 2)")
    g.add_argument("--sim-models", type=_names, default=["llama7b", "qwen05b"],
                   help="model shapes (first = the --json sim section)")
    g.add_argument("--sim-cp", type=_ints, default=[1, 2], metavar="SIZES",
                   help="context-parallel sizes to simulate (CP=1 always runs: it is the "
                        "summary's sim section; each larger size adds models.<m>.cp.<size> to "
                        "sim.json and a CP table to report.md; 2 = the paper's SP2)")
    g.add_argument("--cost-model", default="auto",
                   help="predictor name or profile path; auto: a GPU profile committed as "
                        "results/gpu_check/*profile*.json, else h100-analytic")
    g.add_argument("--block-size", type=int, default=256)
    g.add_argument("--topk", type=int, default=32,
                   help="static budget k0 (threshold routing: the cap)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--routing", choices=("topk", "threshold"), default="topk",
                   help="threshold: content-dependent kept pairs, each document's density drawn "
                        "from --density-study (benchmarks/harness/compare/density_study.py)")
    g.add_argument("--density-study", metavar="JSON",
                   help="benchmarks/sparsity_study.py --output JSON whose 'documents' (source, length, "
                        "density[, compression_ratio]) give the documents their densities")
    g.add_argument("--density-mode", choices=("measured", "bucket-mean"), default="measured",
                   help="bucket-mean: every study density replaced by its length bucket's mean "
                        "(what sparsity-awareness itself buys)")
    g.add_argument("--topk-min", type=int, default=0, help="threshold routing's floor of chosen blocks")
    g.add_argument("--taus", type=_taus, default=None, metavar="TAUS",
                   help="threshold routing: DST's TAU levels, comma list (default: the study's TAU with its "
                        "tail 1 - TAU scaled by 2, 1.5, 0.7, 0.5, 0.3: 0.8,0.85,0.9,0.93,0.95,0.97 at 0.9)")
    g = p.add_argument_group("real runs")
    g.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages")
    g.add_argument("--arms", type=_names, default=None, help="comma list (default: all main arms)")
    g.add_argument("--frontier", action="store_true",
                   help="also run the frontier points (anchor p / critical-path eps)")
    g.add_argument("--iters", type=int, default=None, help="iterations per run (default 33; quick 23)")
    g.add_argument("--rounds", type=int, default=None,
                   help="rounds of all arms, alternating order (default 2; quick 1)")
    g.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    g.add_argument("--real-micro-batches", type=int, default=8, metavar="M",
                   help="micro-batches per step (= global batch at DP 1); --ranks is WLB-LLM's regime")
    g.add_argument("--real-attention", choices=("sparse", "dense"), default="sparse",
                   help="dense: every key block kept (top-k = the context's blocks), so the packers "
                        "balance dense attention")
    g.add_argument("--corpus-lengths", default=None, metavar="FILE",
                   help="real: resample the corpus' document lengths from this JSON list (e.g. your "
                        "corpus', from tools/dataset_lengths.py) instead of data/lengths/wlb_reconstruction.json")
    g.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="real: train on your indexed dataset (<prefix>.bin/.idx, e.g. from "
                        "tools/preprocess_data.py) as it is, its token ids the vocabulary, instead of "
                        "the resampled corpus")
    g.add_argument("--workdir", default=os.path.join(REPO, "runs", "compare"),
                   help="corpus, profiles and run logs")
    return p


def _check(a) -> None:
    for name in ("pp", "dp", "micro_batches", "block_size", "topk", "ranks", "threads", "real_micro_batches"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    for name in ("sim_steps", "iters", "rounds"):
        v = getattr(a, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if a.lengths is None:
        a.lengths = sorted(glob.glob(os.path.join(LENGTHS_DIR, "*.json")))
        if not a.lengths and a.mode in ("sim", "all"):
            raise UsageError(f"no length files in {LENGTHS_DIR}")
    for f in a.lengths:
        if not os.path.isfile(f):
            raise UsageError(f"--lengths: {f} does not exist")
    from benchmarks.harness.compare.cluster_sim import MODELS

    bad = [m for m in a.sim_models if m not in MODELS]
    if bad or not a.sim_models:
        raise UsageError(f"--sim-models must be from {sorted(MODELS)}, got {bad or a.sim_models}")
    if a.arms is not None:
        from benchmarks.harness.compare import get_arm

        try:
            for n in a.arms:
                get_arm(n)
        except ValueError as e:
            raise UsageError(f"--arms: {e}")
    if a.scaling + a.regime + a.wlb_validation > 1:
        raise UsageError("--scaling, --regime and --wlb-validation are separate studies: pick one")
    for flag in ("scaling", "regime", "wlb_validation"):
        if getattr(a, flag) and a.mode != "sim":
            raise UsageError(f"--{flag.replace('_', '-')} needs --mode sim")
    if a.scaling_models is not None and not a.scaling:
        raise UsageError("--scaling-models needs --scaling")
    if a.regime and a.routing == "threshold":
        raise UsageError("--regime picks the routing per cell: give --density-study alone")
    if not a.regime and (a.routing == "threshold") != (a.density_study is not None):
        raise UsageError("--routing threshold and --density-study go together")
    if a.routing == "threshold" and a.mode != "sim":
        raise UsageError("--routing threshold needs --mode sim")
    if a.taus is not None and a.routing != "threshold" and not a.regime:
        raise UsageError("--taus are threshold routing's DST levels: they need --routing threshold")
    if a.density_study is not None:
        from benchmarks.harness.compare.density_study import load_study

        try:
            load_study(a.density_study)
        except (OSError, ValueError) as e:
            raise UsageError(f"--density-study: {str(e).splitlines()[0]}")
    if a.report and os.path.isfile(a.report):
        raise UsageError(f"--report {a.report} is a file, expected a directory")
    if a.mode == "report" and not (a.report and (os.path.isfile(os.path.join(a.report, "sim.json"))
                                                 or os.path.isfile(os.path.join(a.report, "real.json")))):
        raise UsageError("--mode report needs --report DIR holding sim.json or real.json")
    a.cost_note = None
    if a.mode in ("sim", "all"):
        a.cost_model, a.cost_note = _resolve_cost_model(a.cost_model)
    a.sim_cfgs = _sim_configs(a) if a.mode in ("sim", "all") else {}
    a.length_arrays = ({os.path.splitext(os.path.basename(f))[0]: _read_lengths(f)
                        for f in a.lengths} if a.mode in ("sim", "all") else {})
    a.real_cfg = _real_config(a) if a.mode in ("real", "all") else None


def _resolve_cost_model(name: str) -> tuple:
    """``(cost model, note)``. ``auto``: the first results/gpu_check/*profile*.json that
    loads as a predictor, else h100-analytic; any other name is kept. The note says
    which (logged once the command line is known to be good)."""
    if name != "auto":
        return name, f"cost model: {name}"
    from sparsebalance.predictor import get_predictor

    skipped = []
    for path in sorted(glob.glob(os.path.join(REPO, "results", "gpu_check", "*profile*.json"))):
        try:
            get_predictor(path)
        except (ValueError, OSError, KeyError) as e:
            skipped.append(f"{os.path.basename(path)} ({str(e).splitlines()[0]})")
            continue
        return path, f"cost model: GPU-measured profile {path}"
    return "h100-analytic", ("cost model: h100-analytic (no usable GPU profile under "
                             "results/gpu_check/" + (f"; skipped {', '.join(skipped)}" if skipped
                                                     else "") + ")")


def _sim_configs(a) -> dict:
    """SimConfig per simulated model, with its predictor (shape) loaded: a bad cost model
    is a usage error before any work."""
    from benchmarks.harness.compare.cluster_sim import MODELS, SimConfig

    out = {}
    if a.scaling:
        from benchmarks.harness.compare.scaling import GRID, QUICK_GRID

        a.grid = QUICK_GRID if a.quick else GRID
        if a.scaling_models is not None:
            a.grid = tuple(c for c in a.grid if c[0] in a.scaling_models)
            if not a.grid:
                raise UsageError(f"--scaling-models {','.join(a.scaling_models)}: no cell of the "
                                 f"{'quick ' if a.quick else ''}grid has these models")
        a.sim_models = sorted({c[0] for c in a.grid})
    for model in a.sim_models:
        try:
            cfg = SimConfig(pp=a.pp, dp=a.dp, micro_batches=a.micro_batches,
                            steps=a.sim_steps or (2 if a.quick else 6), seed=a.seed,
                            cost_model=a.cost_model, block_size=a.block_size, topk=a.topk,
                            model=tuple(MODELS[model].items()), routing=a.routing,
                            density_study=a.density_study, density_mode=a.density_mode,
                            topk_min=a.topk_min, taus=a.taus)
            out[model] = (cfg, cfg.predictor().shape.as_dict())
        except (ValueError, OSError) as e:
            raise UsageError(str(e).splitlines()[0])
    a.sim_cp_sizes = sorted(set(a.sim_cp) - {1})
    return out


def _real_config(a):
    from benchmarks.harness.compare.corpus import CorpusRecipe
    from benchmarks.harness.compare.real import RealConfig, measured_steps

    given = a.corpus_lengths
    if given is not None and not (given.endswith(".json") and os.path.isfile(given)):
        raise UsageError(f"--corpus-lengths {a.corpus_lengths}: not an existing .json length file")
    recipe = CorpusRecipe() if a.corpus_lengths is None else CorpusRecipe(lengths_file=a.corpus_lengths)
    data = {}
    if a.data_path is not None:
        if given is not None:
            raise UsageError("--data-path and --corpus-lengths: give one (your dataset brings its lengths)")
        from benchmarks.harness.compare.campaign import dataset_vocab
        from megatron.training import quiet_optional_extras

        quiet_optional_extras()  # megatron-core's warnings about absent GPU extras
        try:
            data = {"data_path": a.data_path, "vocab_size": dataset_vocab(a.data_path)}
        except ValueError as e:
            raise UsageError(f"--data-path: {e}")
    if a.real_attention == "dense":
        recipe = dataclasses.replace(recipe, topk=recipe.seq_length // recipe.block_size - 2)
    try:
        cfg = RealConfig(ranks=a.ranks, iters=a.iters or (23 if a.quick else 33),
                         rounds=a.rounds or (1 if a.quick else 2), threads=a.threads, recipe=recipe,
                         micro_batches=a.real_micro_batches, **data)
    except ValueError as e:
        raise UsageError(str(e))
    if measured_steps(cfg) * cfg.rounds < 20:
        raise UsageError(f"--iters {cfg.iters} x --rounds {cfg.rounds} leaves "
                         f"{measured_steps(cfg) * cfg.rounds} measured steps per arm after "
                         "warm-up; need >= 20")
    return cfg


def _read_lengths(path: str):
    import numpy as np

    try:
        with open(path) as fh:
            vals = json.load(fh)
        arr = np.asarray(vals, dtype=np.int64)
    except (OSError, ValueError, TypeError) as e:
        raise UsageError(f"--lengths {path}: not a JSON list of integers ({e})".splitlines()[0])
    if arr.ndim != 1 or arr.size == 0 or arr.min() < 1:
        raise UsageError(f"--lengths {path}: expected a non-empty JSON list of lengths >= 1")
    return arr


def run_sim(a, figs: dict, log) -> dict:
    from benchmarks.harness.compare.cluster_sim import simulate_cell

    t0 = time.time()
    files = a.length_arrays
    out = {"config": None, "primary_model": a.sim_models[0], "models": {}}
    for model, (cfg, shape) in a.sim_cfgs.items():
        out["config"] = {k: v for k, v in cfg.__dict__.items() if k != "model"}
        cells, gantt = {}, None
        for fname, lengths in files.items():
            cells[fname] = {}
            for seq in a.seq_lengths:
                log(f"[compare] sim {model} {fname} seq {seq}")
                try:
                    res = simulate_cell(lengths, seq, cfg)
                except ValueError as e:
                    raise UsageError(f"{fname} at seq-length {seq}: {e}")
                cells[fname][str(seq)] = res.table
                if gantt is None:
                    gantt = (fname, seq, res.gantt)
        out["models"][model] = {"shape": shape, "cells": cells}
        if a.sim_cp_sizes:
            out["models"][model]["cp"] = _sim_cp(a, model, cfg, files, log)
        if a.report:
            _sim_figures(a.report, model, cells, gantt, figs)
    out["config"]["cp_sizes"] = [1] + a.sim_cp_sizes
    out["seconds"] = time.time() - t0
    return out


def run_scaling(a, log) -> dict:
    """The scaling study: ``{"cost_model", "cells", "tables", "config"}`` (cells: the
    --json rows; tables: per cell, the full per-file cell tables)."""
    from benchmarks.harness.compare.scaling import run_study

    cfg = next(iter(a.sim_cfgs.values()))[0]
    try:
        res = run_study(a.grid, a.length_arrays, cfg, log)
    except ValueError as e:
        raise UsageError(f"scaling: {str(e).splitlines()[0]}")
    return {"cost_model": a.cost_model, "cells": [r["cell"] for r in res],
            "tables": [r["tables"] for r in res],
            "config": {k: v for k, v in cfg.__dict__.items() if k not in ("model", "pp", "dp", "cp",
                                                                        "micro_batches")}}


def _scaling_report(d: str, res: dict) -> None:
    from benchmarks.harness.compare.figures import scaling_heatmap, scaling_lines
    from benchmarks.harness.compare.report_md import scaling_report
    from sparsebalance.io import atomic_write_text

    _dump(d, "scaling.json", res)
    scaling_heatmap(os.path.join(d, "scaling_sb_vs_best.png"), res["cells"], res["cost_model"])
    scaling_lines(os.path.join(d, "scaling_vs_context.png"), res["cells"], res["cost_model"])
    atomic_write_text(os.path.join(d, "scaling.md"), scaling_report(res))


def _sim_cp(a, model: str, cfg, files: dict, log) -> dict:
    """``{cp: {"cells": {file: {seq: cell table}}}}`` for every ``--sim-cp`` size > 1."""
    from dataclasses import replace

    from benchmarks.harness.compare.cluster_sim import simulate_cell

    out = {}
    for cp in a.sim_cp_sizes:
        cells = {}
        for fname, lengths in files.items():
            cells[fname] = {}
            for seq in a.seq_lengths:
                log(f"[compare] sim {model} {fname} seq {seq} cp {cp}")
                try:
                    cells[fname][str(seq)] = simulate_cell(lengths, seq, replace(cfg, cp=cp)).table
                except ValueError as e:
                    raise UsageError(f"{fname} at seq-length {seq}, CP {cp}: {e}")
        out[str(cp)] = {"cells": cells}
    return out


def _sim_charts(d: str, sim: dict, figs: dict) -> None:
    """Speedup bars and frontier of every simulated model (from the saved results)."""
    from benchmarks.harness.compare.figures import frontier, speedup_bars

    for model, m in sim["models"].items():
        speedup_bars(os.path.join(d, f"sim_speedup_{model}.png"), None, m["cells"])
        figs[f"sim_speedup_{model}"] = f"sim_speedup_{model}.png"
        frontier(os.path.join(d, f"sim_frontier_{model}.png"), m["cells"])
        figs[f"sim_frontier_{model}"] = f"sim_frontier_{model}.png"


def _sim_figures(d: str, model: str, cells: dict, gantt, figs: dict) -> None:
    """The Gantt of one simulated step (needs the run's step results)."""
    import numpy as np

    from sparsebalance.pipeline.trace import write_gantt

    fname, seq, res = gantt
    if "megatron" in res and "sparsebalance" in res:
        rep = int(np.argmax(res["megatron"].replica_step_ms))
        write_gantt(os.path.join(d, f"sim_gantt_{model}.png"),
                    {"megatron": res["megatron"], "sparsebalance": res["sparsebalance"]},
                    replicas=[rep], unit="ms per 1,000 tokens",
                    title=f"{model} {fname} {seq // 1024}K, step 0, replica "
                          f"{rep} (megatron's slowest), per 1,000 real tokens of the step")
        figs[f"sim_gantt_{model}"] = f"sim_gantt_{model}.png"


def run_real(a, figs: dict, log) -> dict:
    from benchmarks.harness.compare.arms import ARMS, FRONTIER, get_arm
    from benchmarks.harness.compare.campaign import cpu_prediction, prepare, run_arms

    arms = a.arms or list(ARMS)
    if a.frontier and not a.quick:
        arms += [n for n in FRONTIER if n not in arms]
    from benchmarks.harness.compare import machine_load as ml

    cfg = a.real_cfg
    os.makedirs(a.workdir, exist_ok=True)
    idle = ml.idle_window()
    start = idle[1]
    kinds = ["sparse"] + (["dense"] if any(not get_arm(n).sparse for n in arms) else [])
    prep = prepare(REPO, LENGTHS_DIR, cfg, a.workdir, log, kinds)
    pred = cpu_prediction(cfg, prep)
    log("[compare] predicted (profile + pipeline model) throughput vs megatron: " + ", ".join(
        f"{n} {r['speedup_vs_megatron']:.3f}x" for n, r in pred["arms"].items()))
    res = run_arms(REPO, cfg, arms, a.workdir, prep, log)
    res["machine_load"] = ml.verdict(idle, (start, ml.sample()), ml.cpus())
    if res["machine_load"]["warning"]:
        log(f"[compare] {res['machine_load']['warning']}")
    res["cpu_prediction"] = pred
    res["config"] = cfg.as_dict()
    res["prep"] = prep
    return res


def _real_frontier(arms: dict) -> dict:
    from benchmarks.harness.compare.arms import FRONTIER, get_arm

    base, sab = arms.get("megatron"), arms.get("sab")
    if not base or not sab:
        return {}
    pts = {}
    for n, r in arms.items():
        arm = get_arm(n)
        if n in FRONTIER or n in ("sparsebalance", "sparsebalance-anchor"):
            key = f"{'anchor-p' if arm.dst == 'anchor' else 'critical-path-eps'}{arm.param:g}"
            pts[key] = {"family": arm.dst, "param": arm.param,
                        "retained_vs_static": r["density"] / sab["density"],
                        "speedup_vs_megatron": r["tokens_per_s"] / base["tokens_per_s"]}
    return pts


def _real_figures(d: str, res: dict, figs: dict) -> None:
    from benchmarks.harness.compare.figures import frontier, last_timeline, real_gantt, speedup_bars, validation_scatter
    arms = res["arms"]
    if "megatron" in arms:
        base = arms["megatron"]["tokens_per_s"]
        speedup_bars(os.path.join(d, "real_speedup.png"),
                     {n: r["tokens_per_s"] / base for n, r in arms.items()}, None)
        figs["real_speedup"] = "real_speedup.png"
    if any(r.get("predicted_step_ms") is not None for r in arms.values()):
        validation_scatter(os.path.join(d, "real_validation.png"), arms)
        figs["real_validation"] = "real_validation.png"
    tl = {n: last_timeline(res["timelines"][n]) for n in ("megatron", "sparsebalance")
          if n in res["timelines"]}
    if all(tl.values()) and len(tl) == 2:
        real_gantt(d, arms, tl, figs)
    pts = _real_frontier(arms)
    if len(pts) >= 2:
        frontier(os.path.join(d, "real_frontier.png"), {}, pts)
        figs["real_frontier"] = "real_frontier.png"
    res["frontier"] = pts


def _cell_lines(cells: list) -> list:
    return [f"{c['model']} {c['context'] // 1024}K pp{c['pp']} dp{c['dp']} cp{c['cp']}: "
            f"sb_vs_best {c['sb_vs_best']:.3f}x (best baseline {c['best_baseline']}); "
            + ", ".join(f"{n} {v / c['arms']['megatron']:.3f}x" for n, v in c["arms"].items())
            for c in cells]


def _load(d: str, name: str):
    path = os.path.join(d, name)
    if os.path.isfile(path):
        with open(path) as fh:
            return json.load(fh)
    return None


def _dump(d: str, name: str, obj) -> None:
    from sparsebalance.io import atomic_write_text

    atomic_write_text(os.path.join(d, name), json.dumps(obj, indent=1))


def main(argv=None) -> int:
    import warnings

    # A stale profile is an error (one line below), not a warning plus an error.
    warnings.filterwarnings("ignore", message="latency profile .* does not match")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        a = build_parser().parse_args(argv)
        _check(a)
        if a.cost_note:
            log(f"[compare] {a.cost_note}")
        log(f"[compare] OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} (this process); "
            f"real runs use {a.threads} per rank")
        figs: dict = {}
        if a.report:
            os.makedirs(a.report, exist_ok=True)
        cmd = ("OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)") + " benchmarks/compare.py "
               + " ".join(argv if argv is not None else sys.argv[1:]))
        if a.regime or a.wlb_validation:
            from benchmarks.harness.compare.studies import run_study

            return run_study(a, cmd, log)
        if a.scaling:
            res = run_scaling(a, log)
            res["command"] = cmd
            if a.report:
                _scaling_report(a.report, res)
            from benchmarks.harness.compare.cells import check_cells
            from benchmarks.harness.compare.scaling import summary_lines

            out = {"cost_model": res["cost_model"], "cells": res["cells"]}
            check_cells(out)
            for line in summary_lines(res["cells"]):
                log(f"[compare] {line}")
            print(json.dumps(out) if a.json else "\n".join(_cell_lines(res["cells"])))
            return 0
        sim = run_sim(a, figs, log) if a.mode in ("sim", "all") else None
        if sim is not None:
            sim["command"] = cmd
        if a.report and sim is not None:
            _dump(a.report, "sim.json", sim)
        real = run_real(a, figs, log) if a.mode in ("real", "all") else None
        if real is not None:
            real["command"] = cmd
        if a.report and real is not None:
            _dump(a.report, "real.json", real)
    except UsageError as e:
        print(f"benchmarks/compare.py: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ValueError) as e:
        print(f"benchmarks/compare.py: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    from benchmarks.harness.compare.report_md import build_report
    from benchmarks.harness.compare.summary import build_summary, check_summary
    from sparsebalance.io import atomic_write_text

    if a.report:  # the other mode's earlier results in DIR join the report
        sim = sim if sim is not None else _load(a.report, "sim.json")
        if real is None:
            real = _load(a.report, "real.json")
            if real is not None and real.get("runs"):  # pairs added since the runs
                from benchmarks.harness.compare.campaign import pairs_of_real

                try:
                    pairs = pairs_of_real(real)
                except (KeyError, TypeError, ValueError):  # summaries too old: keep the saved pairs
                    pairs = real.get("pairs", {})
                if pairs != real.get("pairs"):
                    real["pairs"] = pairs
                    _dump(a.report, "real.json", real)
        for f in glob.glob(os.path.join(a.report, "sim_gantt_*.png")):  # needs the run
            figs.setdefault(os.path.splitext(os.path.basename(f))[0], os.path.basename(f))
        if sim is not None:
            _sim_charts(a.report, sim, figs)
        if real is not None:
            _real_figures(a.report, real, figs)
    summary = build_summary(real, (sim["models"][sim["primary_model"]]["cells"] if sim else None))
    check_summary(summary)
    if a.report:
        header = [f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Results "
                  "from:", ""]
        header += [f"- {k}: `{r.get('command', '?')}`" for k, r in (("simulation", sim),
                                                                     ("real runs", real)) if r]
        if real is not None and (real.get("machine_load") or {}).get("warning"):
            header += ["", f"**{real['machine_load']['warning']}**"]
        notes = [
            "Notes: throughput (real tokens per second or per predicted ms) is the fair "
            "measure because arms fit different numbers of tokens into a step (SAB fills "
            "~90% of capacity by design, Megatron's next-fit of whole documents less). The "
            "simulation's primary model is `llama7b`, the layer `h100-analytic` was fitted "
            "on (no FLOP rescaling); `qwen05b` is also shown: at PP=8 its last stage carries "
            "a 151,936-token output layer, a per-token straggler that neither packing nor "
            "attention budgets can touch, which caps every arm's gain. The real-run corpus "
            "recipe (`benchmarks/harness/compare/corpus.py`) was fixed before any arm ran and "
            "was not changed after."]
        atomic_write_text(os.path.join(a.report, "report.md"), build_report(real, sim, figs, header, notes))
        _dump(a.report, "summary.json", summary)
    if a.json and a.mode == "sim":
        from benchmarks.harness.compare.cells import check_cells, sim_cells

        out = {"cost_model": a.cost_model, "cells": sim_cells(sim)}
        check_cells(out)
        if a.report:
            _dump(a.report, "cells.json", out)
        print(json.dumps(out))
    elif a.json:
        print(json.dumps(summary))
    else:
        if real is not None and real.get("arms"):
            from benchmarks.harness.compare.report_md import real_table

            print("\n".join(real_table(real)))
            if (real.get("machine_load") or {}).get("warning"):
                print(real["machine_load"]["warning"])
        if a.report and real is not None:
            for key in ("real_gantt", "real_trace"):
                if key in figs:
                    print(f"{key.split('_')[1]}: {os.path.join(a.report, figs[key])}")
        for f, by in (sim["models"][sim["primary_model"]]["cells"] if sim else {}).items():
            for seq, c in by.items():
                print(f"sim {f} {seq}: " + ", ".join(
                    f"{n} {r['speedup_vs_megatron']:.3f}x" for n, r in c["arms"].items()))
        for cp, by_cp in (sim["models"][sim["primary_model"]].get("cp", {}) if sim else {}).items():
            for f, by in by_cp["cells"].items():
                for seq, c in by.items():
                    print(f"sim {f} {seq} cp{cp}: " + ", ".join(
                        f"{n} {r['speedup_vs_megatron']:.3f}x" for n, r in c["arms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
