#!/usr/bin/env python
"""Accuracy of sparse-attention budgets on a converted pretrained model: held-out loss per
packed micro-batch and RULER-style retrieval, under dense, static top-k, threshold routing
and SparseBalance's per-micro-batch budgets (issue 50 items 1-2).

The model is a ``convert.py gguf-to-megatron`` / ``hf-to-megatron`` checkpoint (``--load``,
flags from ``LOAD/model_flags.txt``, tokenizer ``LOAD/hf``), built as the driver builds it
(PP=1, ``--sparse-attention``, the library's kernels); every arm runs on the same weights,
only the attention differs (post-hoc sparsity, no fine-tuning). Arms:

* ``dense``; ``static-kK``: top-K in every layer and micro-batch (block ``--block-size``, sink
  and diagonal kept);
* ``threshold``: threshold routing (``--threshold`` TAU, count per (query block, head), cap
  ``--threshold-cap``);
* ``sparsebalance-ppP``: DST's budgets for a PP=P pipeline of the micro-batches, planned as the
  driver plans them (``sparsebalance.balancer.Balancer.plan``: ``--sparse-balance``'s
  critical-path policy, budgets within [K/2, 2K], the predictor of ``--sb-cost-model`` or
  ``--sb-profile``); a layer takes its stage's budget. The packing is held fixed (the
  driver's ``megatron`` packing of the corpus in order): this measures budgets, not SAB.
* ``sparsebalance-ppP-sens`` (``--sensitivity estimate``): the same DST plan refined towards
  the micro-batches whose pairs are worth most (``sparsebalance.tuning.sensitivity``'s swaps:
  one op a level down, another of a more sensitive micro-batch a level up), at the slack-only
  plan's planned step time (never above it) and planned kept pairs (within
  ``SENS_PAIRS_TOL``; the driver's refinement would first raise into the leftover float,
  which adds pairs: left out here). Each micro-batch's weight comes from its documents'
  predicted sensitivities: a ``SensitivityEstimator`` fitted on ``--sensitivity-study``'s
  documents (another set than the scored corpus), read by the corpus sidecars' source and
  compression ratio, never from the losses scored here. ``sens_minus_slack`` is the
  sensitivity arm minus ``sparsebalance-ppP`` per micro-batch (paired bootstrap, as below);
  a micro-batch whose budgets the refinement left alone reuses the slack-only forward.
* ``sparsebalance-ppP-stage`` (``--sensitivity stage``): the same refinement, at the same planned
  step time and kept pairs, with a weight per stage instead of per micro-batch: the stage profile
  of ``--stage-sensitivity`` (``benchmarks/stage_sensitivity.py``: loss per dropped pair of each
  stage's layers, measured on calibration documents that are not the scored corpus's), so a
  level moves from a stage whose layers pay little to one whose layers pay much. A stage's
  weight is the profile's per-layer value times its layers in the model over its layers in the
  plan (a 30-layer model is planned as 32). ``stage_minus_slack`` and ``stage_minus_static`` (at
  equal kept pairs, as ``sb_minus_static``) hold the paired intervals.

* ``sparsebalance-ppP-eqtime`` (always, with the loss part): DST at static top-k's planned step
  time, the paper's "free accuracy": the plan with the most kept pairs whose planned step time (the
  driver's predictor and pipeline model) is at most that of every op at ``--topk``
  (``sparsebalance.tuning.equal_time``: the static and critical-path plans, raised into the slack
  under that deadline). ``equal_step_time`` compares it with ``static-kK`` (K = ``--topk``, k0):
  ``{"ppP": {"topk": {"loss_minus_static": [2.5%, 50%, 97.5%], "pairs_over_static": ratio},
  "threshold": {...}}}`` (paired bootstrap over micro-batches; kept pairs as the forwards count
  them).
* ``sparsebalance-ppP-tau-eqtime`` (always, with the loss part): the same under threshold routing,
  DST's lever being TAU: the plan with the most kept pairs whose planned step time is at most that of
  every op at TAU0 (``--threshold``), over the driver's default TAU ladder around TAU0 (0.8 to 0.97 at
  0.9), each level priced by SAB's density estimator at that TAU
  (``sparsebalance.tuning.from_predictor.build_tau_instance``); the cap ``--threshold-cap`` stays
  a guard at every level. The estimator is the driver's ``ThresholdDensity`` (corpus sidecars:
  source, compression ratio) after seeing ``--density-study``'s documents measured at TAU0 (another
  corpus: nothing of the scored micro-batches). ``equal_step_time[ppP]["threshold"]`` compares it
  with the ``threshold`` arm (static threshold routing at TAU0, same cap and least count).

Loss (``--loss-tokens``): mean next-token cross entropy over the second half of each
document (default; its first half is mostly within the dense reach of the sink, diagonal and
top-k blocks), or over every predicted token. Pairing at equal kept pairs: top-k routing keeps
a number of pairs fixed by the document lengths, so SparseBalance's total over the
micro-batches is computed first and the static budgets ``k_lo, k_lo + 1`` around it are run;
the static loss at equal pairs is their per-micro-batch interpolation at the weight that
matches the totals. ``sb_minus_static`` is SparseBalance minus that, per micro-batch,
token-weighted, with a paired bootstrap over micro-batches ([2.5%, 50%, 97.5%]) and a
t-interval.

Retrieval: ``niah_single``, ``niah_multikey``, ``variable_tracking`` (``--tasks``) at
``--lengths`` tokens of the model's tokenizer, through its chat template, greedy decoding
of the answer (``benchmarks/harness/longctx/real.py``: the prompt prefilled under the arm's block
routing, the answer decoded with per-token routing from a full KV cache, in one forward).
The SparseBalance arm takes DST's budgets for a PP=``--retrieval-pp`` pipeline whose
micro-batches are the prompts (one per micro-batch, steps of ``--num-microbatches``); the static
arm's top-k is the one whose kept pairs over the prompts are nearest SparseBalance's. Each arm's
accuracy has a Wilson 95% interval (``retrieval_ci95``) and each sparse arm its gap to dense on
the same prompts with a paired bootstrap over prompts (``retrieval_minus_dense``).

Tiny CPU run (a few minutes; ``make real-model`` first)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/real_accuracy.py --load runs/models/smollm2-135m \\
        --data-path runs/real/accuracy --seq-length 1024 --num-microbatches 4 --pp 4 \\
        --tasks niah_single --lengths 1024 --num-samples 1 --json

Equal step time and needle retrieval with intervals (``results/real_accuracy_equal_time.json``,
``results/real_needle_30.json``; one core each)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_accuracy.py --load runs/models/smollm2-135m \\
        --data-path runs/real-accuracy/corpus --seq-length 2048 --num-microbatches 16 --pp 4,8 \\
        --num-samples 0 --threads 1 --out results/real_accuracy_equal_time.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_accuracy.py --load runs/models/smollm2-135m \\
        --num-microbatches 0 --tasks niah_single --lengths 2048 --num-samples 30 --threads 1 \\
        --out results/real_needle_30.json

Sensitivity-aware DST against slack-only DST (the reduced run of
``results/real_accuracy_sensitivity.json``, ~20 minutes on one busy core)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_accuracy.py --load runs/models/smollm2-135m \\
        --data-path runs/real-accuracy/corpus --seq-length 2048 --num-microbatches 12 --pp 4,8 \\
        --num-samples 0 --threads 1 --sensitivity estimate --out results/real_accuracy_sensitivity.json

Stage-aware DST (``results/real_accuracy_stage.json``, 10 minutes on one core; the profile from
``benchmarks/stage_sensitivity.py``)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/real_accuracy.py --load runs/models/smollm2-135m \\
        --data-path runs/real-accuracy/corpus --seq-length 2048 --num-microbatches 12 --pp 4,8 \\
        --num-samples 0 --threads 1 --sensitivity stage --stage-sensitivity results/stage_sensitivity.json \\
        --out results/real_accuracy_stage.json

``make real-accuracy`` runs the sized default (<= 45 minutes on 2 threads). GPU (one GPU, the
model built with PP=1)::

    python benchmarks/real_accuracy.py --load /ckpt/smollm2-ft --data-path /data/real/corpus \\
        --seq-length 16384 --num-microbatches 16 --lengths 4096,8192 --num-samples 10 \\
        --out /ckpt/smollm2-ft/real_accuracy.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tools")]

from megatron.training.arguments import OneLineParser, usage_error  # noqa: E402

PROG = "real_accuracy.py"
RETRIEVAL_TASKS = ("niah_single", "niah_multikey", "variable_tracking")
DEFAULT_STUDY = os.path.join(REPO, "results", "real_study.json")
SENS_PAIRS_TOL = 0.005
"""Most the sensitivity arm's planned kept pairs may differ from slack-only DST's (fraction)."""


def fail(message: str, code: int = 2) -> NoReturn:
    usage_error(message, prog=PROG, code=code)


def log(message: str) -> None:
    print(f"[real_accuracy] {message}", file=sys.stderr, flush=True)


def _ints(text: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"expected comma-separated integers, got {text!r}")


def build_parser():
    p = OneLineParser(prog=PROG, description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="converted checkpoint (model_flags.txt, hf/)")
    p.add_argument("--data-path", default=None, help="corpus prefix (.bin/.idx; benchmarks/make_real_corpus.py)")
    p.add_argument("--seq-length", type=int, default=4096, help="micro-batch tokens")
    p.add_argument("--num-microbatches", type=int, default=8, help="micro-batches scored (0: no loss part)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--topk", type=int, default=8, help="static budget K (DST's k0)")
    p.add_argument("--threshold", type=float, default=0.9, help="threshold arm's TAU")
    p.add_argument("--threshold-cap", type=int, default=None, help="threshold arm's cap (default 2K)")
    p.add_argument("--pp", default="4,8", help="pipeline sizes DST plans for (one arm each)")
    p.add_argument("--sb-cost-model", default=None, help="DST's predictor (default h100-analytic)")
    p.add_argument("--sb-profile", default=None, help="DST's predictor: a latency profile instead")
    p.add_argument("--loss-tokens", choices=("second-half", "all"), default="second-half")
    p.add_argument("--tasks", default=",".join(RETRIEVAL_TASKS))
    p.add_argument("--lengths", default="2048,4096,8192", help="retrieval context lengths (tokens)")
    p.add_argument("--num-samples", type=int, default=2, help="retrieval samples per (task, length); 0: none")
    p.add_argument("--retrieval-pp", type=int, default=4, help="pipeline size of the retrieval DST arm")
    p.add_argument("--sensitivity", choices=("off", "estimate", "stage"), default="off",
                   help="estimate: add the sparsebalance-ppP-sens arms (sensitivity-aware DST); stage: "
                        "the sparsebalance-ppP-stage arms (stage-aware DST, --stage-sensitivity)")
    p.add_argument("--stage-sensitivity", default=None, metavar="JSON",
                   help="stage profile (benchmarks/stage_sensitivity.py) of --sensitivity stage")
    p.add_argument("--sensitivity-study", default=DEFAULT_STUDY, metavar="JSON",
                   help="sensitivity study whose documents the estimator is fitted on (benchmarks/sparsity_study.py "
                        "--real); default results/real_study.json")
    p.add_argument("--density-study", default=DEFAULT_STUDY, metavar="JSON",
                   help="sparsity study (benchmarks/sparsity_study.py --real) whose documents SAB's density "
                        "estimator has seen: prices the TAU levels of equal_step_time's threshold arm; default "
                        "results/real_study.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--finetune-check", default=None, metavar="JSON",
                   help="check_real_model.py's output: adds pretrained_loss and finetune_first_loss_dense")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--out", default=None, help="also write the report here (atomically)")
    return p


def check_args(a) -> None:
    a.study = read_study(a.sensitivity_study) if a.sensitivity == "estimate" else None
    if a.sensitivity != "off" and a.num_microbatches == 0:
        fail(f"--sensitivity {a.sensitivity} compares losses: it needs --num-microbatches >= 1")
    if (a.sensitivity == "stage") != (a.stage_sensitivity is not None):
        fail("--sensitivity stage and --stage-sensitivity JSON go together")
    a.stage_profile = None
    if a.stage_sensitivity is not None:
        from sparsebalance.tuning.stage_sensitivity import read_stage_profile

        try:
            a.stage_profile = read_stage_profile(a.stage_sensitivity)
        except ValueError as e:
            fail(f"--stage-sensitivity: {e}")
    if not os.path.isfile(os.path.join(a.load, "model_flags.txt")):
        fail(f"--load: {a.load} has no model_flags.txt (make real-model writes runs/models/smollm2-135m)")
    if a.num_microbatches > 0 and (a.data_path is None or not os.path.isfile(a.data_path + ".idx")):
        fail("--data-path: a corpus (.bin/.idx) is needed for the loss part (benchmarks/make_real_corpus.py)")
    for name in ("seq_length", "block_size", "topk", "retrieval_pp"):
        if getattr(a, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1")
    if a.num_microbatches < 0 or a.num_samples < 0:
        fail("--num-microbatches and --num-samples must be >= 0")
    if not 0 < a.threshold <= 1:
        fail("--threshold must be in (0, 1]")
    if a.sb_cost_model and a.sb_profile:
        fail("give either --sb-cost-model or --sb-profile")
    a.pp = _ints(a.pp)
    a.lengths = _ints(a.lengths)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.threshold_cap = a.threshold_cap or 2 * a.topk
    a.density_docs = read_density_study(a.density_study, a.threshold, a.block_size) if a.num_microbatches else None
    a.predictor = ["--sb-profile", a.sb_profile] if a.sb_profile else ["--sb-cost-model",
                                                                       a.sb_cost_model or "h100-analytic"]


def _read_json(path: str, flag: str):
    """The JSON file ``path`` given to ``flag``, or one usage error line."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        fail(f"{flag}: cannot read {path} ({e.strerror})")
    except ValueError as e:
        fail(f"{flag}: {path} is not JSON ({e})")


def read_density_study(path: str, tau0: float, block_size: int) -> list:
    """The documents of the sparsity study at ``path`` measured at ``tau0`` (per-head counts, each
    with ``_density``), or one usage error line naming what is wrong with it."""
    study = _read_json(path, "--density-study")
    if not isinstance(study, dict) or not isinstance(study.get("documents"), list):
        fail(f"--density-study: {path} is not a sparsity study (no documents)")
    block = (study.get("config") or {}).get("block_size")
    if block is not None and int(block) != block_size:
        fail(f"--density-study: {path} was measured with blocks of {block} tokens, not --block-size {block_size}")
    docs = []
    for d in study["documents"]:
        got = {float(k): v for k, v in ((d.get("densities") or {}) if isinstance(d, dict) else {}).items()}
        v = got.get(float(tau0))
        v = v.get("per_head") if isinstance(v, dict) else v
        if isinstance(v, (int, float)) and 0 < v <= 1 and "length" in d:
            docs.append({**d, "_density": float(v)})
    if not docs:
        fail(f"--density-study: {path} has no documents with a length and a per-head density at TAU {tau0:g} "
             f"(benchmarks/sparsity_study.py --real --taus ...)")
    return docs


def read_study(path: str) -> dict:
    """The sensitivity study, or one usage error line naming what is wrong with it."""
    study = _read_json(path, "--sensitivity-study")
    docs = study.get("documents") if isinstance(study, dict) else None
    if not isinstance(docs, list) or not any(isinstance(d, dict) and d.get("loss_delta") is not None
                                             and "length" in d for d in docs):
        fail(f"--sensitivity-study: {path} has no documents with length and loss_delta")
    return study


# --- the model and its attention modules ---------------------------------------------------


def model_flags(load: str) -> list:
    # the pretrained models train without dropout (conversions before the flags carried it)
    with open(os.path.join(load, "model_flags.txt")) as f:
        return ["--hidden-dropout", "0", "--attention-dropout", "0", *f.read().split(),
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", os.path.join(load, "hf")]


def open_model(a):
    import shlex

    from benchmarks.harness.longctx.model import open_eval_model

    flags = model_flags(a.load) + ["--seq-length", str(max([a.seq_length, *a.lengths]))]
    model, a.threads = open_eval_model(a.load, " ".join(shlex.quote(x) for x in flags), a.threads, fail,
                                       sparse=True, sb_topk=a.topk, sb_block_size=a.block_size, backend=None)
    return model


def attention_modules(model) -> list:
    from sparsebalance.attention.sparse import SparseAttention

    return [m for m in model.gpt.modules() if isinstance(m, SparseAttention)]


def set_arm(cores, arm, microbatch: int) -> None:
    """Point every attention module at ``arm``'s budget (and TAU) for ``microbatch`` (the modules
    read their static ``topk`` and routing rule per call; the packed params carry no budget)."""
    from sparsebalance.ops.plan import RoutingRule

    for m in cores:
        m.topk = arm.budget(microbatch, m.layer_number, len(cores))
        tau = arm.tau(microbatch, m.layer_number, len(cores))
        m.rule = None if tau is None else RoutingRule(threshold=tau, topk_min=arm.topk_min)


def forward(model, tokens, cu, records=None):
    """``[T, V]`` logits of one packed THD forward of documents ``cu`` (int32 ``[n + 1]``)."""
    import torch

    from sparsebalance.attention.packed import BudgetedPackedSeqParams

    lens = (cu[1:] - cu[:-1]).tolist()
    dev = model.device
    pos = torch.cat([torch.arange(n) for n in lens]).view(1, -1).to(dev)
    params = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(dev), cu_seqlens_kv=cu.to(dev),
                                     max_seqlen_q=max(lens), max_seqlen_kv=max(lens), cu_seqlens_host=cu.cpu(),
                                     records=records)
    return model.gpt(tokens.view(1, -1).to(dev), pos, None, packed_seq_params=params)[0].float().cpu()


# --- DST's budgets, as the driver plans them ------------------------------------------------


def dst_balancer(a, vocab: int, mb_lengths: list, pp: int, threshold: bool = False) -> tuple:
    """(``Balancer``, policy name, planned layers) of a PP=``pp`` pipeline (dp 1) of
    micro-batches ``mb_lengths``: the driver's flags -> config. A model whose layers do not
    split over ``pp`` stages is planned with the next multiple of ``pp`` layers (the driver
    needs an even split; per-stage times then scale alike). ``threshold``: the threshold arm's
    routing (``--sb-routing threshold --sb-threshold TAU0``, cap ``--threshold-cap`` as
    ``--sb-topk``, least count ``--topk // 2`` as ``--sb-topk-min``): DST's levels are then
    the driver's default TAU ladder around TAU0 (``Balancer.taus``)."""
    import shlex

    from benchmarks.harness.longctx.model import EvalModelError, parse_train_args
    from megatron.training.arg_checks import validate_balance
    from megatron.training.sb_config import sparsebalance_config
    from sparsebalance.balancer import Balancer, build_predictor

    flags = model_flags(a.load)
    layers = int(flags[flags.index("--num-layers") + 1])
    planned_layers = math.ceil(layers / pp) * pp
    routing = (["--sb-routing", "threshold", "--sb-threshold", str(a.threshold), "--sb-topk", str(a.threshold_cap),
                "--sb-topk-min", str(a.topk // 2)] if threshold else ["--sb-topk", str(a.topk)])
    flags += ["--num-layers", str(planned_layers), "--sparse-balance", *a.predictor,
              "--pipeline-model-parallel-size", str(pp), *routing, "--sb-block-size",
              str(a.block_size), "--seq-length", str(max(sum(x) for x in mb_lengths))]
    try:
        args = parse_train_args(" ".join(shlex.quote(x) for x in flags))
    except EvalModelError as e:
        fail(str(e), e.code)
    validate_balance(args)
    config = sparsebalance_config(args, vocab)
    return Balancer(config, build_predictor(config)), args.sb_dst, planned_layers


def dst_plan(a, vocab: int, mb_lengths: list, pp: int) -> dict:
    """DST's ``[micro-batch, stage]`` budgets for one step of ``mb_lengths`` on a PP=``pp``
    pipeline (dp 1), as ``Balancer.plan`` makes them (:func:`dst_balancer`)."""
    balancer, policy, planned_layers = dst_balancer(a, vocab, mb_lengths, pp)
    forecast = balancer.plan([mb_lengths])
    return {"budget": forecast.budget[0], "step_ms": forecast.step_ms, "baseline_step_ms": forecast.baseline_step_ms,
            "planned_layers": planned_layers, "policy": policy}


def equal_time_dst_plan(a, vocab: int, mb_lengths: list, pp: int) -> dict:
    """DST's plan at the static plan's step time: the most kept pairs whose planned step time
    (the driver's predictor and pipeline model) is at most that of every op at ``--topk``
    (:func:`sparsebalance.tuning.equal_time.equal_time_plan`, budgets within the driver's
    [K/2, 2K]). ``attn``: planned kept pairs x layers, one head."""
    from sparsebalance.tuning.equal_time import equal_time_plan

    balancer, _, planned_layers = dst_balancer(a, vocab, mb_lengths, pp)
    plan = equal_time_plan(balancer.instance([mb_lengths]))
    if plan.step_ms > plan.baseline_step_ms * (1 + 1e-9):
        raise RuntimeError(f"equal-time plan at PP={pp} is slower than static ({plan.step_ms} ms)")
    return {"budget": plan.budget[0], "step_ms": plan.step_ms, "static_step_ms": plan.baseline_step_ms,
            "planned_attn": plan.attn, "static_planned_attn": plan.baseline_attn, "planned_layers": planned_layers,
            "policy": plan.policy}


def equal_time_tau_plan(a, vocab: int, mb_lengths: list, pp: int, density, packing) -> dict:
    """DST's TAU plan at static threshold routing's step time: the most kept pairs whose planned
    step time (the driver's predictor and pipeline model) is at most that of every op at TAU0
    (``--threshold``), the levels the driver's TAU ladder around TAU0, each priced by SAB's
    estimator ``density`` (``ThresholdDensity``, :func:`sab_density`) at that TAU for the
    documents of ``packing`` (``sparsebalance.balancer.level_densities``, as
    ``StepPlanner`` prices them), the cap ``--threshold-cap`` a guard at every level.
    ``tau``: the ``[M, stages]`` TAU table; ``attn``: planned kept pairs x layers, one head."""
    from sparsebalance.balancer import level_densities
    from sparsebalance.tuning.equal_time import equal_time_plan

    segs = [[s[2] for s in mb] for mb in packing.ranks[0]]
    if len(segs) != len(mb_lengths) or any(list(x[:len(s)]) != s for s, x in zip(segs, mb_lengths)):
        raise RuntimeError("the packing's segments are not the micro-batches' documents")
    balancer, _, planned_layers = dst_balancer(a, vocab, mb_lengths, pp, threshold=True)
    densities = level_densities(density, packing, [mb_lengths], balancer.taus)
    plan = equal_time_plan(balancer.instance([mb_lengths], densities=densities))
    if plan.step_ms > plan.baseline_step_ms * (1 + 1e-9):
        raise RuntimeError(f"equal-time TAU plan at PP={pp} is slower than static ({plan.step_ms} ms)")
    return {"tau": plan.budget[0], "step_ms": plan.step_ms, "static_step_ms": plan.baseline_step_ms,
            "planned_attn": plan.attn, "static_planned_attn": plan.baseline_attn, "planned_layers": planned_layers,
            "taus": list(balancer.taus), "tau0": a.threshold, "cap": a.threshold_cap, "topk_min": a.topk // 2,
            "predicted_density_tau0": [float(x) for mb in densities[float(a.threshold)][0] for x in mb],
            "policy": plan.policy}


def sensitivity_dst_plan(a, vocab: int, mb_lengths: list, pp: int, weight) -> dict:
    """DST's plan of :func:`dst_plan` and the same plan refined by the micro-batch weights
    ``weight`` [M] (nats per dropped pair; or [M, stages] per op) at its planned step time and kept pairs (module
    docstring): ``budget`` (the refined ``[M, stages]``), ``slack_budget``, both arms'
    ``step_ms`` and planned kept pairs (``attn``: pairs x layers, one head), the weights, the
    ops that moved. RuntimeError if the refinement broke either equality."""
    import numpy as np

    from sparsebalance.tuning.plan import make_plan
    from sparsebalance.tuning.sensitivity import sensitivity_indices

    balancer, policy, planned_layers = dst_balancer(a, vocab, mb_lengths, pp)
    forecast = balancer.plan([mb_lengths])
    w = np.asarray(weight, dtype=float)[None]
    inst = balancer.instance([mb_lengths], w)
    base = inst.indices(forecast.budget)
    slack = make_plan(inst, base, policy)
    sens = make_plan(inst, sensitivity_indices(inst, base, w, raise_first=False, pairs_tol=SENS_PAIRS_TOL),
                     policy + "+sensitivity")
    if sens.step_ms > slack.step_ms * (1 + 1e-6) or abs(sens.attn / slack.attn - 1) > SENS_PAIRS_TOL + 1e-6:
        raise RuntimeError(f"sensitivity plan at PP={pp}: step {sens.step_ms:.4f} ms, pairs {sens.attn:.6g} against "
                           f"slack-only's {slack.step_ms:.4f} ms, {slack.attn:.6g}")
    return {"budget": sens.budget[0], "slack_budget": slack.budget[0], "step_ms": sens.step_ms,
            "slack_step_ms": slack.step_ms, "planned_attn": sens.attn, "slack_planned_attn": slack.attn,
            "pairs_tol": SENS_PAIRS_TOL, "weight": w[0].tolist(),
            "changed_ops": int((sens.budget != slack.budget).sum()),
            "changed_microbatches": int((sens.budget[0] != slack.budget[0]).any(axis=1).sum()),
            "planned_layers": planned_layers, "policy": sens.policy}


# --- loss per micro-batch -------------------------------------------------------------------


def microbatches(a, vocab: int) -> tuple:
    """(micro-batches of one step of the corpus in order, its packing, the dataset)."""
    import numpy as np

    from megatron.training import data as D
    from megatron.training.indexed_io import open_dataset

    ds = open_dataset(a.data_path)
    loader = D.PackedDataLoader(ds, np.arange(len(ds)), dp=1, dp_rank=0, micro_batches=a.num_microbatches,
                                seq_length=a.seq_length, strategy="megatron", seed=a.seed, shuffle=False,
                                vocab_size=vocab)
    step = loader.next_step(more=False)
    return step.microbatches, step.planned.packing, ds


def sensitivity_weights(a, packing, ds, mb_lengths: list) -> tuple:
    """([M] weights, where they came from) of the step's micro-batches: the estimator fitted
    on ``a.study``'s documents predicts each scored document's sensitivity from its source
    and compression ratio (the corpus sidecars) and length; nothing of the scored losses."""
    import numpy as np

    from megatron.training.doc_features import document_features
    from sparsebalance.balancer import SensitivityWeights

    src, comp = document_features([(1.0, a.data_path)], ds)
    sw = SensitivityWeights.from_study(a.study, sources=src, compression=comp)
    w = sw(packing, [mb_lengths])[0]
    fitted = [d for d in a.study["documents"] if d.get("loss_delta") is not None]
    known = {d.get("source") for d in fitted}
    segs = [s for mb in packing.ranks[0] for s in mb]
    ids = [s[0] for s in segs]
    return w, {"study": a.sensitivity_study, "study_documents": len(fitted),
               "study_corpus": a.study.get("config", {}).get("data_path"),
               "ref_topk": sw.ref_topk, "block_size": sw.block_size,
               "features": "source (corpus sidecar), compression ratio, length",
               "scored_segments": len(segs),
               "scored_segments_of_known_source": int(sum(src[i] in known for i in ids)),
               "predicted_nats_per_token": [float(x) for x in sw.documents(ids, [s[2] for s in segs])],
               "microbatch_weight": np.asarray(w).tolist()}


def sab_density(a, ds):
    """(SAB's ``ThresholdDensity`` over the corpus ``ds``, what it has seen): the driver's estimator
    (``megatron.training.doc_features.threshold_density``: each document read by its source and
    compression sidecars, learning at TAU0, moved to other TAUs along the measured
    ``sparsebalance.batching.tau_curve.MEASURED``) after seeing ``--density-study``'s documents at
    TAU0 (per-head counts; another corpus than the scored one), as a run's estimator has seen earlier
    steps' documents; nothing of the scored micro-batches."""
    import numpy as np

    from megatron.training.doc_features import document_features
    from sparsebalance.batching.density_feedback import ThresholdDensity

    src, comp = document_features([(1.0, a.data_path)], ds)
    td = ThresholdDensity(block_size=a.block_size, topk_min=a.topk // 2, sources=src, compression=comp,
                          tau0=a.threshold)
    docs = a.density_docs
    c = [d.get("compression_ratio") for d in docs]
    td.estimator.update_many([d.get("source") for d in docs], [int(d["length"]) for d in docs],
                             [d["_density"] for d in docs], None,
                             [np.nan if x is None else float(x) for x in c] if any(x is not None for x in c) else None)
    return td, {"study": a.density_study, "documents": len(docs), "tau0": a.threshold, "counts": "per_head",
                "block_size": a.block_size, "features": "source (corpus sidecar), compression ratio, length",
                "tau_curve": td.curve.as_dict()}


def scored_loss(logits, tokens, cu, which: str) -> tuple:
    """(summed cross entropy, scored tokens) of each document's targets: its second half
    (targets at positions >= len/2) or all."""
    import torch

    total, count = 0.0, 0
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        first = s + 1 + ((e - s) // 2 - 1 if which == "second-half" else 0)  # first scored target
        if e - first < 1:
            continue
        lg = logits[first - 1:e - 1].float()
        total += float(torch.nn.functional.cross_entropy(lg, tokens[first:e], reduction="sum"))
        count += e - first
    return total, count


def loss_part(a, model, vocab: int) -> dict:
    import numpy as np
    import torch

    from benchmarks.harness.compare.real_arms import Arm, arm_pairs, bracket, equal_time_entry, paired_interval

    cores = attention_modules(model)
    L, heads = len(cores), int(model.args.num_attention_heads)
    mbs, packing, ds = microbatches(a, vocab)
    mb_lengths = [(mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist() for mb in mbs]
    sb_arms, plans, sens_arms, sens_plans, estimate = [], {}, [], {}, None
    suffix = {"estimate": "-sens", "stage": "-stage"}.get(a.sensitivity)
    if a.sensitivity == "estimate":
        weight, estimate = sensitivity_weights(a, packing, ds, mb_lengths)
    eq_arms = []  # DST at static-k{topk}'s planned step time (equal_step_time)
    tau_arms = []  # DST's TAU levels at static threshold routing's planned step time (equal_step_time)
    density, density_info = sab_density(a, ds)
    for pp in a.pp:
        plan = dst_plan(a, int(model.gpt.vocab_size), mb_lengths, pp)
        plans[f"sparsebalance-pp{pp}"] = plan
        sb_arms.append(Arm(f"sparsebalance-pp{pp}", stage_budgets=plan["budget"]))
        eq = equal_time_dst_plan(a, int(model.gpt.vocab_size), mb_lengths, pp)
        plans[f"sparsebalance-pp{pp}-eqtime"] = eq
        eq_arms.append(Arm(f"sparsebalance-pp{pp}-eqtime", stage_budgets=eq["budget"]))
        teq = equal_time_tau_plan(a, int(model.gpt.vocab_size), mb_lengths, pp, density, packing)
        plans[f"sparsebalance-pp{pp}-tau-eqtime"] = teq
        tau_arms.append(Arm(f"sparsebalance-pp{pp}-tau-eqtime", topk=a.threshold_cap, stage_taus=teq["tau"],
                            topk_min=a.topk // 2))
        if suffix is not None:
            if a.sensitivity == "stage":
                weight = np.tile(stage_weight(a, pp, L, plan["planned_layers"]), (len(mb_lengths), 1))
            sp = sensitivity_dst_plan(a, int(model.gpt.vocab_size), mb_lengths, pp, weight)
            if not np.array_equal(sp["slack_budget"], plan["budget"]):
                raise RuntimeError(f"PP={pp}: the sensitivity arm's slack-only plan is not the driver's")
            sens_plans[f"sparsebalance-pp{pp}{suffix}"] = sp
            sens_arms.append(Arm(f"sparsebalance-pp{pp}{suffix}", stage_budgets=sp["budget"]))
    slack_of = {arm.name: arm.name[:-len(suffix)] for arm in sens_arms}
    slack_of.update({arm.name: arm.name[:-len("-eqtime")] for arm in eq_arms})  # reuse a forward of equal budgets
    slack_of.update({arm.name: "threshold" for arm in tau_arms})
    judged = sb_arms + (sens_arms if a.sensitivity == "stage" else [])  # against static at equal pairs

    def static_pairs(k):
        return arm_pairs(Arm("s", topk=k), mb_lengths, a.block_size, L, heads)

    brackets = {arm.name: bracket(arm_pairs(arm, mb_lengths, a.block_size, L, heads), static_pairs)
                for arm in judged}
    ks = sorted({a.topk} | {k for lo, hi, _ in brackets.values() for k in (lo, hi)})  # k0: equal_step_time's
    arms = [Arm("dense"), *[Arm(f"static-k{k}", topk=k) for k in ks],
            Arm("threshold", topk=a.threshold_cap, threshold=a.threshold, topk_min=a.topk // 2), *sb_arms,
            *eq_arms, *tau_arms, *sens_arms]
    per = {arm.name: {"loss": [], "tokens": [], "kept_pairs": 0, "causal_pairs": 0} for arm in arms}
    by_name = {arm.name: arm for arm in arms}
    t0 = time.time()
    with torch.no_grad():
        for i, mb in enumerate(mbs):
            tokens, cu = mb["tokens"].view(-1), mb["cu_seqlens"].to(torch.int32)
            last = {}
            for arm in arms:
                ref = slack_of.get(arm.name)
                if ref is not None and arm.routing(i, L) == by_name[ref].routing(i, L):
                    last[arm.name] = last[ref]  # the same budgets (and TAUs): the same forward
                else:
                    set_arm(cores, arm, i)
                    recs = []
                    total, count = scored_loss(forward(model, tokens, cu, recs), tokens, cu, a.loss_tokens)
                    last[arm.name] = (total / count, count, sum(x.kept_pairs for x in recs),
                                      sum(x.causal_pairs for x in recs))
                r = per[arm.name]
                loss, count, kept, causal = last[arm.name]
                r["loss"].append(loss)
                r["tokens"].append(count)
                r["kept_pairs"] += kept
                r["causal_pairs"] += causal
            log(f"micro-batch {i + 1}/{len(mbs)} ({len(mb_lengths[i])} documents, {int(tokens.numel())} tokens) "
                f"{time.time() - t0:.0f} s: " + " ".join(f"{n} {r['loss'][-1]:.4f}" for n, r in per.items()))
    for r in per.values():
        r["mean"] = float(np.average(r["loss"], weights=r["tokens"]))
        r["density"] = r["kept_pairs"] / r["causal_pairs"]
    weights = per["dense"]["tokens"]
    diffs = {}
    for arm in judged:
        lo, hi, w = brackets[arm.name]
        static_eq = (1 - w) * np.array(per[f"static-k{lo}"]["loss"]) + w * np.array(per[f"static-k{hi}"]["loss"])
        d = np.array(per[arm.name]["loss"]) - static_eq
        diffs[arm.name] = {**paired_interval(d, weights, seed=a.seed), "per_microbatch": d.tolist(),
                           "static_at_equal_pairs": {"k_lo": lo, "k_hi": hi, "w_hi": w},
                           "kept_pairs": per[arm.name]["kept_pairs"],
                           "static_kept_pairs": (1 - w) * per[f"static-k{lo}"]["kept_pairs"]
                           + w * per[f"static-k{hi}"]["kept_pairs"]}
    for name in per:
        if name != "dense":
            d = np.array(per[name]["loss"]) - np.array(per["dense"]["loss"])
            per[name]["minus_dense"] = paired_interval(d, weights, seed=a.seed)
    eq_report = {}
    statics = (("topk", eq_arms, per[f"static-k{a.topk}"]), ("threshold", tau_arms, per["threshold"]))
    for routing, arms, static in statics:
        for arm in arms:  # DST at the static arm's planned step time, against that arm
            cell = equal_time_entry(per[arm.name]["loss"], static["loss"], weights, per[arm.name]["kept_pairs"],
                                    static["kept_pairs"], seed=a.seed)
            p = plans[arm.name]
            cell.update(planned_step_ms=p["step_ms"], static_planned_step_ms=p["static_step_ms"],
                        planned_pairs_over_static=p["planned_attn"] / p["static_planned_attn"])
            eq_report.setdefault(arm.name.split("-")[1], {})[routing] = cell
    out = {"arms": per, "sb_minus_static": {arm.name: diffs[arm.name] for arm in sb_arms},
           "equal_step_time": eq_report, "threshold_density": density_info,
           "plans": {n: {k: np.asarray(v).tolist() if k in ("budget", "tau") else v for k, v in p.items()}
                     for n, p in plans.items()},
           "microbatch_lengths": mb_lengths, "loss_tokens": a.loss_tokens, "seconds": time.time() - t0}
    if a.sensitivity == "estimate":
        out["sens_minus_slack"] = sensitivity_report(per, sens_plans, seed=a.seed)
        out["sensitivity_estimate"] = estimate
    elif a.sensitivity == "stage":
        out["stage_minus_slack"] = sensitivity_report(per, sens_plans, seed=a.seed)
        out["stage_minus_static"] = {arm.name: diffs[arm.name] for arm in sens_arms}
        out["stage_profile"] = {"path": a.stage_sensitivity, "num_layers": a.stage_profile.num_layers,
                                "stages": {str(p): list(v) for p, v in a.stage_profile.stages.items()}}
    return out


def stage_weight(a, pp: int, num_layers: int, planned_layers: int):
    """[pp] weights of a PP=``pp`` plan from the stage profile: its nats per dropped pair (one
    layer) times the stage's layers in the model over its layers in the plan (the planner counts
    a stage's pairs over ``planned_layers / pp`` layers)."""
    import numpy as np

    from benchmarks.harness.compare.real_arms import stage_of

    try:
        w = a.stage_profile.weights(pp, num_layers)
    except ValueError as e:
        fail(f"--stage-sensitivity: {e}")
    real = np.bincount([stage_of(x, num_layers, pp) for x in range(1, num_layers + 1)], minlength=pp)
    return w * real / (planned_layers / pp)


def sensitivity_report(per: dict, sens_plans: dict, seed: int = 0) -> dict:
    """Per sensitivity arm ``NAME-sens`` (or ``NAME-stage``): its loss minus ``NAME``'s per micro-batch
    (``paired_interval``: token-weighted mean, ``interval`` [2.5%, 50%, 97.5%] of a paired
    bootstrap), with both arms' planned step ms and kept pairs (planned and measured)."""
    import numpy as np

    from benchmarks.harness.compare.real_arms import paired_interval

    out = {}
    for name, sp in sens_plans.items():
        slack = name.rsplit("-", 1)[0]
        d = np.array(per[name]["loss"]) - np.array(per[slack]["loss"])
        out[name] = {**paired_interval(d, per[slack]["tokens"], seed=seed), "per_microbatch": d.tolist(),
                     "planned_step_ms": {"slack": sp["slack_step_ms"], "sens": sp["step_ms"]},
                     "planned_kept_pairs": {"slack": sp["slack_planned_attn"], "sens": sp["planned_attn"]},
                     "kept_pairs": {"slack": per[slack]["kept_pairs"], "sens": per[name]["kept_pairs"]},
                     "changed_ops": sp["changed_ops"], "changed_microbatches": sp["changed_microbatches"],
                     "budget": np.asarray(sp["budget"]).tolist(), "weight": sp["weight"]}
    return out


# --- retrieval ------------------------------------------------------------------------------


def chat_wrapper(hf_dir: str):
    """The model's chat template as ``wrap(user) -> text`` (identity without a template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    if not getattr(tok, "chat_template", None):
        return lambda user: user, False
    return (lambda user: tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)), True


def decode_routing(cores, state: dict):
    """Swap each module's ``_attend`` for prefill-then-decode routing (see
    benchmarks/harness/longctx/real.py); ``state["prompt"]`` is the prompt's token count.
    Returns a function that puts the originals back."""
    import torch

    from benchmarks.harness.longctx.real import decode_attention
    from sparsebalance.attention.packed import BudgetedPackedSeqParams
    from sparsebalance.ops.plan import default_scale

    def make(m, orig):
        def attend(q, k, v, cu_seqlens, packed_seq_params=None):
            P = state["prompt"]
            cu = torch.tensor([0, P], dtype=torch.int32)
            dcu = cu.to(q.device)
            params = BudgetedPackedSeqParams(qkv_format="thd", cu_seqlens_q=dcu, cu_seqlens_kv=dcu, max_seqlen_q=P,
                                             max_seqlen_kv=P, cu_seqlens_host=cu,
                                             records=getattr(packed_seq_params, "records", None))
            head = orig(q[:P], k[:P], v[:P], dcu, params)
            tail = decode_attention(q[P:], k, v, P, topk=m.topk, block_size=m.block_size,
                                    scale=default_scale(q.shape[2], m.softmax_scale), rule=m.rule)
            return torch.cat([head, tail.to(head.dtype)])
        return attend

    saved = [(m, m._attend) for m in cores]
    for m, orig in saved:
        m._attend = make(m, orig)
    return lambda: [delattr(m, "_attend") for m, _ in saved]


def retrieval_part(a, model) -> dict:
    import numpy as np
    import torch

    from benchmarks.harness.compare.real_arms import Arm, arm_pairs, bracket, paired_gap, wilson_interval
    from benchmarks.harness.longctx.real import answer_correct, sized_sample
    from megatron.training.tokenizer import HFJsonTokenizer

    tok = HFJsonTokenizer(os.path.join(a.load, "hf"))
    wrap, chat = chat_wrapper(os.path.join(a.load, "hf"))
    count = lambda t: len(tok.encode(t))  # noqa: E731
    items = []
    for task in a.tasks:
        for n in a.lengths:
            for i in range(a.num_samples):
                s, prompt, answer = sized_sample(task, n, a.seed, i, count, wrap)
                p_ids, a_ids = tok.encode(prompt), tok.encode(answer)
                items.append({"task": task, "length": n, "index": i, "prompt_tokens": len(p_ids),
                              "answer": s.answer, "ids": (p_ids, a_ids)})
    # DST: the prompts as micro-batches (one each), steps of --num-microbatches in item order
    step = max(a.num_microbatches, a.retrieval_pp)
    sb_budget = []
    for j in range(0, len(items), step):
        lens = [[len(x["ids"][0]) + len(x["ids"][1])] for x in items[j:j + step]]
        sb_budget += list(dst_plan(a, int(model.gpt.vocab_size), lens, a.retrieval_pp)["budget"])
    cores = attention_modules(model)
    sb = Arm(f"sparsebalance-pp{a.retrieval_pp}", stage_budgets=np.array(sb_budget))
    # the static arm keeps (about) SparseBalance's pairs over the prompts: the nearer bracketing budget
    lens = [[len(x["ids"][0]) + len(x["ids"][1])] for x in items]
    heads = int(model.args.num_attention_heads)
    lo, hi, w = bracket(arm_pairs(sb, lens, a.block_size, len(cores), heads),
                        lambda k: arm_pairs(Arm("s", topk=k), lens, a.block_size, len(cores), heads))
    k_eq = hi if w >= 0.5 else lo
    arms = [Arm("dense"), Arm(f"static-k{k_eq}", topk=k_eq),
            Arm("threshold", topk=a.threshold_cap, threshold=a.threshold, topk_min=a.topk // 2), sb]
    pairs = {arm.name: 0 for arm in arms}
    state = {"prompt": 0}
    restore = decode_routing(cores, state)
    t0 = time.time()
    try:
        with torch.no_grad():
            for j, it in enumerate(items):
                p_ids, a_ids = it["ids"]
                seq = torch.tensor(p_ids + a_ids, dtype=torch.long)
                cu = torch.tensor([0, len(seq)], dtype=torch.int32)
                state["prompt"] = len(p_ids)
                it["correct"] = {}
                for arm in arms:
                    set_arm(cores, arm, j)
                    recs = []
                    pred = forward(model, seq, cu, recs)[len(p_ids) - 1:].argmax(-1)
                    pairs[arm.name] += sum(r.kept_pairs for r in recs)
                    it["correct"][arm.name] = answer_correct(pred, torch.tensor(a_ids), tok.decode)
                    it.setdefault("greedy", {})[arm.name] = tok.decode(pred.tolist())  # argmax given the gold prefix
                log(f"retrieval {j + 1}/{len(items)} {it['task']} {it['length']} ({time.time() - t0:.0f} s): "
                    + " ".join(f"{n} {'ok' if c else 'no'}" for n, c in it["correct"].items()))
    finally:
        restore()
    acc = {arm.name: float(np.mean([it["correct"][arm.name] for it in items])) for arm in arms}
    hits = {arm.name: [bool(it["correct"][arm.name]) for it in items] for arm in arms}
    ci = {n: wilson_interval(sum(h), len(h)) for n, h in hits.items()}
    minus_dense = {n: paired_gap(h, hits["dense"], seed=a.seed) for n, h in hits.items() if n != "dense"}
    cells = {}
    for it in items:
        cell = cells.setdefault(it["task"], {}).setdefault(str(it["length"]), {arm.name: 0 for arm in arms})
        for n, c in it["correct"].items():
            cell[n] += int(c)
    for it in items:
        del it["ids"]
    return {"accuracy": acc, "accuracy_ci95": ci, "minus_dense": minus_dense,
            "intervals": "accuracy_ci95: Wilson score 95%; minus_dense: arm minus dense on the same prompts, "
                         "[2.5%, 50%, 97.5%] of a paired bootstrap over prompts",
            "prompt_kept_pairs": pairs, "static_topk": k_eq, "correct_per_cell": cells,
            "samples_per_cell": a.num_samples, "chat_template": chat,
            "items": items, "seconds": time.time() - t0,
            "decode": "prompt prefilled under the arm's block routing; answer tokens routed one by one "
                      "(Bq = 1) from a full KV cache; greedy, one teacher-forced forward"}


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    check_args(a)
    t0 = time.time()
    model = open_model(a)
    try:
        vocab = int(model.gpt.vocab_size)
        hide = ("json", "out", "study", "stage_profile", "density_docs") + (
            ("sensitivity",) if a.sensitivity == "off" else ()) + (
            ("sensitivity_study",) if a.sensitivity != "estimate" else ()) + (
            ("stage_sensitivity",) if a.sensitivity != "stage" else ())
        out = {"config": {k: v for k, v in vars(a).items() if k not in hide}, "iteration": model.iteration}
        if a.num_microbatches:
            out["loss"] = loss_part(a, model, vocab)
            sb = out["loss"]["sb_minus_static"]
            out["sb_minus_static_loss"] = sb[f"sparsebalance-pp{a.pp[0]}"]["interval"] if sb else None
            out["sb_minus_static_loss_by_pp"] = {n: d["interval"] for n, d in sb.items()}
            out["equal_step_time"] = {pp: {r: None if c is None else {k: c[k] for k in ("loss_minus_static",
                                                                                      "pairs_over_static")}
                                           for r, c in cells.items()}
                                      for pp, cells in out["loss"]["equal_step_time"].items()}
            if a.sensitivity == "stage":
                for key in ("stage_minus_slack", "stage_minus_static"):
                    out[f"{key}_loss_by_pp"] = {n: d["interval"] for n, d in out["loss"][key].items()}
            if a.sensitivity == "estimate":
                sens = out["loss"]["sens_minus_slack"]
                out["sens_minus_slack_loss"] = sens[f"sparsebalance-pp{a.pp[0]}-sens"]["interval"]
                out["sens_minus_slack_loss_by_pp"] = {n: d["interval"] for n, d in sens.items()}
        if a.num_samples:
            out["retrieval_detail"] = retrieval_part(a, model)
            out["retrieval"] = out["retrieval_detail"]["accuracy"]
            out["retrieval_ci95"] = out["retrieval_detail"]["accuracy_ci95"]
            out["retrieval_minus_dense"] = {n: d["interval"] for n, d in out["retrieval_detail"]["minus_dense"].items()}
    finally:
        model.close()
    if a.finetune_check:
        with open(a.finetune_check) as f:
            chk = json.load(f)
        out["pretrained_loss"] = chk["loss_transformers"]
        out["finetune_first_loss_dense"] = chk["loss_driver"]
        out["finetune_check"] = chk
    out["seconds"] = time.time() - t0
    out["command"] = "benchmarks/real_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.out:
        from sparsebalance.io import atomic_write_text

        atomic_write_text(a.out, json.dumps(out, indent=1) + "\n")
    keys = ("equal_step_time", "sb_minus_static_loss", "sb_minus_static_loss_by_pp", "retrieval", "retrieval_ci95",
            "retrieval_minus_dense", "pretrained_loss", "finetune_first_loss_dense")
    if a.sensitivity == "estimate":
        keys += ("sens_minus_slack_loss", "sens_minus_slack_loss_by_pp")
    if a.sensitivity == "stage":
        keys += ("stage_minus_slack_loss_by_pp", "stage_minus_static_loss_by_pp")
    print(json.dumps(out) if a.json else json.dumps({k: out.get(k) for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
